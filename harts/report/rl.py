"""Online-RL report: `reports/rl.pdf` and `.csv` from `harts rl` records (DESIGN §6, the paper's §5.3).

Input: rl records, one per (seed, execution) of one RL config: the warm start's summary and one
record per step (reward, KL, loss, S/C, the step's times). Output:
- CSV in long form, columns `RL_COLUMNS`: one row per (execution, seed, step) with the step's
  figures (times in seconds; `train_seconds` is the timed training step, sampling and the reference
  forward are outside it), one row with `error` for a failed run.
- PDF: (1) the reward curves of both executions: per step the mean over seeds, smoothed by a
  centred moving average over `SMOOTHING` steps, with the band from the lowest to the highest seed
  (each seed smoothed the same way), the paper's statement beside them and our values at steps 0,
  N/4, N/2 and N (the smoothed mean with its seed band, and the raw mean over seeds); (2) KL to the initial policy,
  loss, S/C of the step's trees and the time per training step of each execution (median over
  seeds, sampling dashed); (3) the table per execution.
Agreement of the curves is summarised as the fraction of steps at which the two seed bands
overlap; nothing is estimated beyond what the records hold.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import numpy as np

from harts.report.records import ERROR, format_value, is_number, load_records, provenance_lines
from harts.report.render import footer, page, save_pdf, table_pages, wrap_header, write_csv

RL_COLUMNS = [
    "name", "model", "execution", "seed", "step", "update", "reward", "reward_all", "tool_calls", "loss",
    "policy_loss", "moe_loss", "pooled_balance_loss", "kl", "grad_norm", "trajectories", "retries", "semantic_tokens",
    "compact_tokens", "compression", "rows", "train_seconds", "plan_seconds", "layout_seconds", "forward_seconds",
    "backward_seconds", "optimizer_seconds", "sample_seconds", "reference_seconds", "error",
]
PAPER_STATEMENT = ("Paper (§5.3, τ³-Bench, first 120 steps): reward curves of HARTS and the baseline "
                   "with similar trend and spread.")
SMOOTHING = 9
"""Steps of the centred moving average of the plotted curves (fewer at the ends)."""
EXECUTION_LABELS = {"compact": "HARTS (compact)", "baseline": "baseline (per-trajectory)"}
EXECUTION_COLORS = {"compact": "#3182bd", "baseline": "#e6550d"}


def rl_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for record in records:
        config = record["config"]
        base = {"name": config.get("name"), "model": config.get("rl", {}).get("model"),
                "execution": config.get("execution"), "seed": config.get("seed")}
        if "error" in record:
            rows.append({**base, "error": record["error"]})
            continue
        for step in record["results"]["steps"]:
            seconds = step["seconds"]
            rows.append({**base, **{k: step.get(k) for k in RL_COLUMNS if k in step and k not in base},
                         **{f"{k}_seconds": seconds.get(k) for k in
                            ("train", "plan", "layout", "forward", "backward", "optimizer", "sample", "reference")}})
    return rows


def smooth(values: np.ndarray, window: int = SMOOTHING) -> np.ndarray:
    """Centred moving average along the last axis (the window shrinks at the ends)."""
    half = window // 2
    out = np.empty_like(values, dtype=np.float64)
    for t in range(values.shape[-1]):
        out[..., t] = values[..., max(0, t - half): t + half + 1].mean(axis=-1)
    return out


def curves(records: list[dict[str, Any]], key: str) -> dict[str, np.ndarray]:
    """{execution: [seeds, steps]} of a per-step figure (runs with an error left out)."""
    by_execution: dict[str, list[list[float]]] = {}
    for record in records:
        if "error" in record:
            continue
        values = [np.nan if not is_number(s.get(key)) else s[key] for s in record["results"]["steps"]]
        by_execution.setdefault(record["config"]["execution"], []).append(values)
    out = {}
    for execution, runs in by_execution.items():
        length = min(len(r) for r in runs)
        out[execution] = np.asarray([r[:length] for r in runs], dtype=np.float64)
    return out


def checkpoints(num_steps: int) -> list[int]:
    """Steps 0, N/4, N/2 and N (0/30/60/120 for 120 steps)."""
    return sorted({0, num_steps // 4, num_steps // 2, num_steps})


def reward_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per execution at the checkpoints: the smoothed mean over seeds, its seed band (lowest and
    highest smoothed seed), the raw mean over seeds; the seed count; and the fraction of steps where
    the two executions' seed bands overlap."""
    rewards = curves(records, "reward")
    summary: dict[str, Any] = {"executions": {}}
    bands = {}
    for execution, values in rewards.items():
        smoothed = smooth(values)
        bands[execution] = (smoothed.min(axis=0), smoothed.max(axis=0))
        steps = checkpoints(values.shape[1] - 1)
        summary["executions"][execution] = {
            "seeds": values.shape[0], "steps": steps,
            "smoothed": [float(smoothed.mean(axis=0)[t]) for t in steps],
            "low": [float(smoothed.min(axis=0)[t]) for t in steps],
            "high": [float(smoothed.max(axis=0)[t]) for t in steps],
            "raw": [float(values.mean(axis=0)[t]) for t in steps],
        }
    if {"compact", "baseline"} <= set(bands):
        (lo_a, hi_a), (lo_b, hi_b) = bands["compact"], bands["baseline"]
        length = min(len(lo_a), len(lo_b))
        overlap = (np.maximum(lo_a[:length], lo_b[:length]) <= np.minimum(hi_a[:length], hi_b[:length]))
        summary["band_overlap"] = float(overlap.mean())
    return summary


def _band_plot(ax, data: dict[str, np.ndarray], ylabel: str, smooth_window: int = SMOOTHING) -> None:
    for execution, values in data.items():
        smoothed = smooth(values, smooth_window)
        steps = np.arange(values.shape[1])
        color = EXECUTION_COLORS.get(execution, "0.3")
        label = f"{EXECUTION_LABELS.get(execution, execution)}, {values.shape[0]} seed(s)"
        ax.plot(steps, smoothed.mean(axis=0), color=color, label=label, linewidth=1.8)
        ax.fill_between(steps, smoothed.min(axis=0), smoothed.max(axis=0), color=color, alpha=0.2, linewidth=0)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def _reward_figure(records, lines: list[str], summary: dict[str, Any]):
    name = records[0]["config"].get("name")
    rl = records[0]["config"].get("rl", {})
    fig = page(f"Online RL: reward curves, HARTS vs the per-trajectory baseline ({name})",
               f"model {rl.get('model')}, {rl.get('device')} {rl.get('dtype')}; lookup-tool tasks, "
               f"{rl.get('rollout', {}).get('tasks_per_step')} trees per step; GRPO from the same initial weights "
               "and sampling seeds in both executions")
    ax = fig.add_axes((0.07, 0.17, 0.52, 0.68))
    _band_plot(ax, curves(records, "reward"), "reward (success rate of the step's samples)")
    ax.set_ylim(0, 1.02)
    ax.legend(loc="lower right")
    ax.set_title(f"mean over seeds, moving average over {SMOOTHING} steps; band: lowest to highest seed")
    text = [PAPER_STATEMENT, "", "Ours (reward: smoothed mean [seed band] / raw mean over seeds):"]
    for execution, info in summary["executions"].items():
        text.append(f"{EXECUTION_LABELS.get(execution, execution)} ({info['seeds']} seeds):")
        text += [f"  step {t}: {s:.3f} [{lo:.3f}-{hi:.3f}] / {r:.3f}" for t, s, lo, hi, r in
                 zip(info["steps"], info["smoothed"], info["low"], info["high"], info["raw"])]
    if "band_overlap" in summary:
        text += ["", f"Seed bands overlap at {summary['band_overlap']:.0%} of the steps."]
    times = {e: statistics.median(train.ravel()) for e, (train, _) in _seconds(records).items()}
    if times:
        text += ["", "Time per training step (median; sampling outside it):"]
        text += [f"  {EXECUTION_LABELS.get(e, e)}: {seconds:.3f} s" for e, seconds in times.items()]
        if {"compact", "baseline"} <= set(times):
            text.append(f"  baseline / compact: {times['baseline'] / times['compact']:.2f}x")
    errors = [r for r in records if "error" in r]
    if errors:
        text += ["", f"{len(errors)} run(s) failed: " + "; ".join(
            f"seed {r['config'].get('seed')} {r['config'].get('execution')}: {r['error']}" for r in errors)]
    fig.text(0.63, 0.85, "\n".join(text), ha="left", va="top", fontsize=9.5, wrap=True)
    footer(fig, lines)
    return fig


def _detail_figure(records, lines: list[str]):
    fig = page("Online RL: KL, loss, compression and time per training step")
    axes = [fig.add_axes(box) for box in ((0.07, 0.55, 0.4, 0.32), (0.56, 0.55, 0.4, 0.32),
                                          (0.07, 0.12, 0.4, 0.32), (0.56, 0.12, 0.4, 0.32))]
    _band_plot(axes[0], curves(records, "kl"), "KL to the initial policy (k3, symlog)")
    # The k3 mean is heavy-tailed once the policy is sharp (a rarely sampled token weighs exp(λ_ref − λ)).
    axes[0].set_yscale("symlog", linthresh=1e-2)
    axes[0].set_title("KL to the initial policy")
    _band_plot(axes[1], curves(records, "loss"), "GRPO loss")
    axes[1].set_title("loss")
    _band_plot(axes[2], curves(records, "compression"), "S / C", smooth_window=1)
    axes[2].set_title("S/C of the step's trees (semantic / compact tokens)")
    times = _seconds(records)
    for execution, (train, sample) in times.items():
        steps = np.arange(train.shape[1])
        color = EXECUTION_COLORS.get(execution, "0.3")
        axes[3].plot(steps, np.median(train, axis=0), color=color, label=f"{EXECUTION_LABELS.get(execution, execution)}: "
                     "training step")
        axes[3].plot(steps, np.median(sample, axis=0), color=color, linestyle="--", alpha=0.7,
                     label=f"{EXECUTION_LABELS.get(execution, execution)}: sampling (not in the step)")
    axes[3].set_xlabel("GRPO step")
    axes[3].set_ylabel("seconds (median over seeds)")
    axes[3].set_title("time per step")
    axes[3].grid(alpha=0.3)
    axes[3].legend(fontsize=7.5)
    axes[0].legend(fontsize=8)
    footer(fig, lines)
    return fig


def _seconds(records) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{execution: ([seeds, update steps] training seconds, sampling seconds)}."""
    out: dict[str, tuple[list, list]] = {}
    for record in records:
        if "error" in record:
            continue
        steps = [s for s in record["results"]["steps"] if s["update"]]
        train, sample = out.setdefault(record["config"]["execution"], ([], []))
        train.append([s["seconds"]["train"] for s in steps])
        sample.append([s["seconds"]["sample"] for s in steps])
    result = {}
    for execution, (train, sample) in out.items():
        length = min(len(r) for r in train)
        result[execution] = (np.asarray([r[:length] for r in train]), np.asarray([r[:length] for r in sample]))
    return result


def display_table(records: list[dict[str, Any]], summary: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = ["execution", "seeds", "reward at steps (smoothed)", "median training step s", "median forward+backward s",
              "median sampling s", "median reference s", "mean S/C", "mean rows / S", "final KL"]
    table = []
    for execution, info in summary["executions"].items():
        runs = [r for r in records if "error" not in r and r["config"]["execution"] == execution]
        updates = [s for r in runs for s in r["results"]["steps"] if s["update"]]
        every = [s for r in runs for s in r["results"]["steps"]]
        kl = [r["results"]["steps"][-1]["kl"] for r in runs if is_number(r["results"]["steps"][-1]["kl"])]
        table.append([
            EXECUTION_LABELS.get(execution, execution), str(info["seeds"]),
            ", ".join(f"{t}: {v:.3f}" for t, v in zip(info["steps"], info["smoothed"])),
            format_value(statistics.median(s["seconds"]["train"] for s in updates), ".3f"),
            format_value(statistics.median(s["seconds"]["forward"] + s["seconds"]["backward"] for s in updates), ".3f"),
            format_value(statistics.median(s["seconds"]["sample"] for s in updates), ".3f"),
            format_value(statistics.median(s["seconds"]["reference"] for s in updates), ".3f"),
            format_value(statistics.fmean(s["compression"] for s in every), ".2f"),
            format_value(statistics.fmean(s["rows"] / s["semantic_tokens"] for s in every), ".3f"),
            format_value(statistics.fmean(kl), ".4f") if kl else "not measured",
        ])
    for record in records:
        if "error" in record:
            table.append([EXECUTION_LABELS.get(record["config"].get("execution"), str(record["config"].get("execution"))),
                          f"seed {record['config'].get('seed')}", ERROR] + [ERROR] * 7)
    return header, table


def check_one_run(records: list[dict[str, Any]]) -> None:
    """The records are one run's: the same resolved RL config but for the seeds (a `--num-steps`, `--device`
    or `--dtype` override keeps the config's name, and curves of different lengths or devices must not be
    averaged), and each (seed, execution) once."""
    def without_seeds(record):
        return {k: v for k, v in record["config"].get("rl", {}).items() if k != "seeds"}

    first = without_seeds(records[0])
    seen = set()
    for record in records:
        here = without_seeds(record)
        if here != first:
            keys = sorted(k for k in set(first) | set(here) if first.get(k) != here.get(k))
            raise ValueError(f"rl report: seed {record['config'].get('seed')} ({record['config'].get('execution')}) "
                             f"was run with other settings than seed {records[0]['config'].get('seed')}: "
                             f"rl.{', rl.'.join(keys)}")
        key = (record["config"].get("seed"), record["config"].get("execution"))
        if key in seen:
            raise ValueError(f"rl report: seed {key[0]} ({key[1]}) appears twice in the records")
        seen.add(key)


def write_rl_report(record_paths: list[str | Path], pdf: str | Path, csv: str | Path) -> list[dict[str, Any]]:
    """Write the PDF and CSV; return the CSV rows."""
    records = load_records(record_paths, "rl")
    if not records:
        raise ValueError("rl report: no records given")
    names = {r["config"].get("name") for r in records}
    if len(names) != 1:
        raise ValueError(f"rl report: the records are of several RL configs ({', '.join(sorted(map(str, names)))})")
    check_one_run(records)
    rows = rl_rows(records)
    write_csv(csv, RL_COLUMNS, rows)
    if all("error" in r for r in records):
        raise ValueError("rl report: every run failed: " + records[0]["error"])
    lines = provenance_lines(records)
    summary = reward_summary(records)
    header, table = display_table(records, summary)
    notes = [
        "Training step = plan + layout + forward + backward + optimizer (the timed step); sampling the trees and the "
        "reference policy's forward run outside it. rows / S: rows computed per semantic token (1 for the baseline).",
        "Records: " + ", ".join(str(p) for p in record_paths),
    ]
    figures = [_reward_figure(records, lines, summary), _detail_figure(records, lines)]
    figures += table_pages("Online RL per execution", wrap_header(header, 14), table, notes, lines)
    save_pdf(figures, pdf)
    return rows
