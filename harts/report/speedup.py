"""Speedup report: `reports/speedup.pdf` and `.csv` from `harts bench speedup` records (DESIGN §6).

Input: speedup records (one per step and configuration: model, parallel configuration, planner,
device, dtype, recomputation, LM-head gradient precision, MLA attention backends). Output:
- CSV, one row per record plus the paper's row, columns `SPEEDUP_COLUMNS`: `source` (`ours` or
  `paper`), the configuration, step, S, C, the trie lower bound, compression S/C, baseline and
  compact F+B+Grad and planning seconds, F/B/Grad speedup, Core speedup, efficiency
  (F/B/Grad speedup / compression), compression and efficiency counted in model FLOPs (`flops_compression`,
  `flops_efficiency`: `harts.bench.speedup.metrics.flops_metrics`), peak memory of both executions,
  `timing_flags` (why the record's timings should not be trusted, `; `-separated, empty when nothing was flagged: see
  `harts.bench.speedup.metrics.timing_flags`; the PDF's table marks the efficiency "(flagged)") and `error`
  (the record's error message). A cell the record does not hold says `not measured`; a failed case
  says `error` in every figure; a figure the paper does not give says `not reported`.
- PDF: (1) compression beside F/B/Grad and Core speedup per configuration (median over steps,
  range as error bars) with the paper's 5.62x rows / 4.81x measured beside them; (2) each
  execution's step time split into forward, backward, gradient reduction and planning,
  relative to the baseline's, and the efficiency against the paper's 0.86; (3) where it exists,
  the op-level breakdown of the compact time beyond (C/S) x baseline; then the table.
Every figure is read from the records; nothing is estimated here.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from harts.config.execution import DEFAULT_CAPACITY, DEFAULT_LOGPROB_CHUNK_ROWS
from harts.report.records import (
    ERROR, NOT_MEASURED, NOT_REPORTED, format_value, get, is_number, load_records, provenance_lines,
)
from harts.report.render import footer, markdown_table, page, save_pdf, table_pages, wrap_header, write_csv

SPEEDUP_COLUMNS = [
    "source", "model", "parallel", "planner", "world_size", "device", "dtype", "recompute", "recompute_blocks",
    "compact_recompute_blocks", "recompute_by_rows", "keep_attention", "keep_kda_intermediates", "kda_calls",
    "logprob_grad_precision", "attention_backend", "compact_attention_backend", "experts_backend", "kda_backend",
    "gdn_kernel", "capacity", "logprob_chunk_rows", "trees", "step",
    "semantic_tokens", "compact_tokens", "lower_bound_compact_tokens", "compression", "baseline_fbg_s",
    "compact_fbg_s", "baseline_planning_s", "compact_planning_s", "fbg_speedup", "core_speedup", "efficiency",
    "flops_compression", "flops_efficiency", "baseline_peak_memory_bytes", "compact_peak_memory_bytes",
    "timing_flags", "error",
]
_RESULT_KEYS = {
    "semantic_tokens": ("semantic_tokens",), "compact_tokens": ("compact_tokens",),
    "lower_bound_compact_tokens": ("lower_bound_compact_tokens",), "compression": ("compression",),
    "baseline_fbg_s": ("baseline", "fbg_s"), "compact_fbg_s": ("compact", "fbg_s"),
    "baseline_planning_s": ("baseline", "planning_s"), "compact_planning_s": ("compact", "planning_s"),
    "fbg_speedup": ("fbg_speedup",), "core_speedup": ("core_speedup",), "efficiency": ("efficiency",),
    "flops_compression": ("flops_compression",), "flops_efficiency": ("flops_efficiency",),
    "baseline_peak_memory_bytes": ("baseline", "peak_memory_bytes"),
    "compact_peak_memory_bytes": ("compact", "peak_memory_bytes"),
}
PAPER_SETUP = "Ling-3.0-tiny, 8 GPUs, BF16, T = 65,536, full recomputation"


def paper_figures() -> dict[str, float]:
    from harts.bench.speedup.records import PAPER

    return dict(PAPER)


def attention_backends(config: dict[str, Any]) -> tuple[str, str]:
    """(baseline, compact) MLA backends of a record, the bench's default resolved by the record's device (a
    record of the default and one naming the same backend are one configuration)."""
    from harts.config.execution import default_attention_backend

    baseline = config.get("attention_backend") or default_attention_backend(config.get("device") or "cpu")
    return baseline, config.get("compact_attention_backend") or baseline


def experts_backend(config: dict[str, Any]) -> str:
    """The MoE experts backend a record's model ran ("auto" resolved by the record's device, as the layer does)."""
    from harts.model.moe import resolve_experts_backend

    backend = get(config, "model_config", "moe", "experts_backend")
    return resolve_experts_backend(backend if isinstance(backend, str) else "auto", config.get("device") == "cuda")


def kda_backend(config: dict[str, Any]) -> str:
    """The KDA backend a record ran (the bench's default resolved by the record's device)."""
    from harts.config.execution import default_kda_backend

    return config.get("kda_backend") or default_kda_backend(config.get("device") or "cpu")


def gdn_kernel(config: dict[str, Any]) -> str | None:
    """The kernel a record's baseline ran its Gated DeltaNet calls on, fla's "gdn" or "kda" (a record from before
    the knob: "gdn"); None where no fla GDN call ran (a KDA model, or the torch backend)."""
    if get(config, "model_config", "gdn") is None or kda_backend(config) != "fla":
        return None
    return config.get("gdn_kernel") or "gdn"


def configuration(record: dict[str, Any]) -> tuple:
    c = record["config"]
    return (c.get("model"), c.get("parallel", "single"), c.get("planner"), c.get("device"), c.get("dtype"),
            bool(c.get("recompute")), c.get("recompute_blocks"), bool(c.get("keep_attention")),
            c.get("logprob_grad_precision") or "fp32", attention_backends(c), experts_backend(c), kda_backend(c),
            c.get("capacity"), c.get("logprob_chunk_rows") or DEFAULT_LOGPROB_CHUNK_ROWS,
            bool(c.get("keep_kda_intermediates")), compact_recompute_blocks(c), bool(c.get("recompute_by_rows")),
            gdn_kernel(c), kda_calls(c))


def kda_calls(config: dict[str, Any]) -> str:
    """How the compact KDA calls ran: separate (also a record from before the knob) or linked."""
    return config.get("kda_calls") or "separate"


def compact_recompute_blocks(config: dict[str, Any]) -> int | None:
    """The compact execution's recompute_blocks of a record (the same as the baseline's before records named it)."""
    return config.get("compact_recompute_blocks", config.get("recompute_blocks"))


def settings_label(recompute: bool, recompute_blocks: int | None, grad_precision: str,
                   attention: tuple[str, str] | None = None, experts: str | None = None, *,
                   keep_attention: bool = False, short: bool = False, kda: str | None = None,
                   capacity: int | None = None, chunk_rows: int | None = None,
                   kda_intermediates_kept: bool = False, compact_recompute_blocks: int | None = None,
                   by_rows: bool = False, gdn: str | None = None, linked_kda_calls: bool = False) -> str:
    """The step settings beside device and dtype: the capacity T (callers pass it where it is not the default),
    recomputation (of every block or the first N; the attention kept where it is), bf16 LM-head gradients, the
    MLA backend (the compact execution's after a slash where it differs), the MoE experts backend and the KDA
    backend (callers pass these where they are not the device's default: `shown_experts`, `shown_kda`), the
    baseline's GDN kernel where it is not fla's GDN kernel (`shown_gdn`), the compact KDA calls linked into one
    launch (`linked_kda_calls`); the LM head's chunk rows where not the default. The compact execution's
    recomputed blocks follow the baseline's
    after a slash where they differ."""
    parts = []
    if capacity is not None:
        parts.append(f"T={capacity:,}" if short else f"T = {capacity:,}")
    if recompute:
        name = "rc" if short else "recompute"
        blocks = [recompute_blocks]
        if compact_recompute_blocks != recompute_blocks:
            blocks.append(compact_recompute_blocks)
        if blocks != [None]:
            parts.append(f"{name} {'/'.join('all' if b is None else str(b) for b in blocks)} blocks")
        else:
            parts.append(name)
        if by_rows:
            parts.append("by rows")
        if keep_attention:
            parts.append("attn kept" if short else "attention kept")
        if kda_intermediates_kept:
            parts.append("KDA interm. kept" if short else "KDA intermediates kept")
    if grad_precision == "input":
        parts.append("bf16 LM-head grads")
    if chunk_rows is not None:
        parts.append(f"LM-head chunks {chunk_rows:,}")
    if attention is not None:
        baseline, compact = attention
        parts.append(baseline if baseline == compact else f"{baseline}/{compact}")
    if experts is not None:
        parts.append(f"{experts} experts")
    if kda is not None:
        parts.append(f"{kda} KDA")
    if gdn is not None:
        parts.append("GDN baseline on KDA kernels" if not short else "GDN on KDA")
    if linked_kda_calls:
        parts.append("KDA calls linked" if not short else "linked KDA")
    return "".join((" " if short else ", ") + part for part in parts)


def shown_experts(experts: str, device: str | None) -> str | None:
    """The experts backend for a label: None where it is the device's default (what "auto" runs)."""
    from harts.model.moe import resolve_experts_backend

    return None if experts == resolve_experts_backend("auto", device == "cuda") else experts


def shown_kda(kda: str, device: str | None) -> str | None:
    """The KDA backend for a label: None where it is the device's default."""
    from harts.config.execution import default_kda_backend

    return None if kda == default_kda_backend(device or "cpu") else kda


def shown_gdn(kernel: str | None) -> str | None:
    """The baseline's GDN kernel for a label: None where it is fla's GDN kernel (the default) or none ran."""
    return kernel if kernel == "kda" else None


def shown_chunk_rows(chunk_rows: Any) -> int | None:
    """The LM head's chunk rows for a label: None where they are the default (or not recorded)."""
    return chunk_rows if is_number(chunk_rows) and chunk_rows != DEFAULT_LOGPROB_CHUNK_ROWS else None


def shown_capacity(capacity: Any) -> int | None:
    """The capacity for a label: None where it is the bench's default (or not recorded)."""
    return capacity if is_number(capacity) and capacity != DEFAULT_CAPACITY else None


def _key_settings(key: tuple, short: bool) -> str:
    (_, _, _, device, _, recompute, recompute_blocks, kept, grad_precision, attention, experts, kda,
     capacity, chunk_rows, kda_kept, compact_blocks, by_rows, gdn, calls) = key
    return settings_label(recompute, recompute_blocks, grad_precision, attention, shown_experts(experts, device),
                          keep_attention=kept, short=short, kda=shown_kda(kda, device),
                          capacity=shown_capacity(capacity), chunk_rows=shown_chunk_rows(chunk_rows),
                          kda_intermediates_kept=kda_kept, compact_recompute_blocks=compact_blocks,
                          by_rows=by_rows, gdn=shown_gdn(gdn), linked_kda_calls=calls == "linked")


def configuration_label(key: tuple) -> str:
    model, parallel, planner, device, dtype = key[:5]
    return f"{model} / {parallel} / {planner}\n{device} {dtype}{_key_settings(key, short=False)}"


def short_configuration_label(key: tuple) -> str:
    """One line for the figures' axes and legends: the configuration and its settings (not device and dtype)."""
    model, parallel, planner = key[:3]
    return f"{model} / {parallel} / {planner}" + _key_settings(key, short=True)


def speedup_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """CSV rows (SPEEDUP_COLUMNS), the records' rows first, then the paper's."""
    rows = []
    for record in records:
        c = record["config"]
        attention, compact_attention = attention_backends(c)
        row = {"source": "ours", "model": c.get("model"), "parallel": c.get("parallel", "single"),
               "planner": c.get("planner"), "world_size": c.get("world_size", 1), "device": c.get("device"),
               "dtype": c.get("dtype"), "recompute": bool(c.get("recompute")),
               "recompute_blocks": c.get("recompute_blocks"), "compact_recompute_blocks": compact_recompute_blocks(c),
               "recompute_by_rows": bool(c.get("recompute_by_rows")), "keep_attention": bool(c.get("keep_attention")),
               "keep_kda_intermediates": bool(c.get("keep_kda_intermediates")),
               "kda_calls": kda_calls(c),
               "logprob_grad_precision": c.get("logprob_grad_precision") or "fp32",
               "attention_backend": attention, "compact_attention_backend": compact_attention,
               "experts_backend": experts_backend(c), "kda_backend": kda_backend(c), "gdn_kernel": gdn_kernel(c),
               "capacity": c.get("capacity"),
               "logprob_chunk_rows": c.get("logprob_chunk_rows") or DEFAULT_LOGPROB_CHUNK_ROWS,
               "trees": c.get("trees"),
               "step": c.get("step"), "error": record.get("error", "")}
        for column, keys in _RESULT_KEYS.items():
            if "error" in record:
                row[column] = ERROR
            else:
                value = get(record["results"], *keys)
                row[column] = value if is_number(value) else NOT_MEASURED
        flags = None if "error" in record else record["results"].get("timing_flags")
        row["timing_flags"] = ERROR if "error" in record else NOT_MEASURED if flags is None else "; ".join(flags)
        rows.append(row)
    paper = paper_figures()
    row = {column: NOT_REPORTED for column in SPEEDUP_COLUMNS}
    row.update({"source": "paper", "model": "Ling-3.0-tiny", "parallel": "8 GPUs", "planner": "harts",
                "world_size": 8, "device": "cuda", "dtype": "bf16", "recompute": True, "trees": "paper workload",
                "step": "all", "compression": paper["compression"], "fbg_speedup": paper["speedup"],
                "efficiency": paper["efficiency"], "error": ""})
    rows.append(row)
    return rows


def display_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    header = ["source", "model", "parallel", "planner", "device / dtype", "step", "S", "C", "S/C",
              "baseline F+B+G s", "compact F+B+G s", "F/B/Grad speedup", "Core speedup", "efficiency", "note"]
    table = []
    for r in rows:
        ours = r["source"] == "ours"  # the paper's row names no backends, capacity or chunk
        blocks = r["recompute_blocks"] if is_number(r["recompute_blocks"]) else None
        compact_blocks = r["compact_recompute_blocks"] if ours and is_number(r["compact_recompute_blocks"]) else blocks
        dtype = f"{r['device']} {r['dtype']}" + settings_label(
            r["recompute"] is True, blocks,
            r["logprob_grad_precision"],
            (r["attention_backend"], r["compact_attention_backend"]) if ours else None,
            shown_experts(r["experts_backend"], r["device"]) if ours else None,
            keep_attention=r["keep_attention"] is True, short=True,
            kda_intermediates_kept=r["keep_kda_intermediates"] is True,
            compact_recompute_blocks=compact_blocks,
            by_rows=r["recompute_by_rows"] is True,
            kda=shown_kda(r["kda_backend"], r["device"]) if ours else None,
            gdn=shown_gdn(r["gdn_kernel"]) if ours else None,
            linked_kda_calls=r["kda_calls"] == "linked",
            capacity=shown_capacity(r["capacity"]) if ours else None,
            chunk_rows=shown_chunk_rows(r["logprob_chunk_rows"]) if ours else None)
        table.append([
            r["source"], str(r["model"]), str(r["parallel"]), str(r["planner"]), dtype, str(r["step"]),
            format_value(r["semantic_tokens"], ","), format_value(r["compact_tokens"], ","),
            format_value(r["compression"], ".2f"),
            format_value(r["baseline_fbg_s"], ".3g"), format_value(r["compact_fbg_s"], ".3g"),
            format_value(r["fbg_speedup"], ".2f", "x"),
            format_value(r["core_speedup"], ".2f", "x"),
            format_value(r["efficiency"], ".2f") + (" (flagged)" if _flagged(r) else ""),
            _short(r["error"] or (f"timing flagged: {r['timing_flags']}" if _flagged(r) else "")),
        ])
    return header, table


def _flagged(row: dict[str, Any]) -> bool:
    return row["timing_flags"] not in ("", ERROR, NOT_MEASURED, NOT_REPORTED)


def _short(text: str, width: int = 48) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _summaries(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration: median and range over its measured steps of each headline figure."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault(configuration(record), []).append(record)
    summaries = []
    for key, group in groups.items():
        done = [r["results"] for r in group if "error" not in r]
        summary: dict[str, Any] = {"key": key, "label": configuration_label(key),
                                   "short_label": short_configuration_label(key), "steps": len(group),
                                   "errors": [r["error"] for r in group if "error" in r]}
        for name in ("compression", "fbg_speedup", "core_speedup", "efficiency"):
            values = [r[name] for r in done if is_number(r.get(name))]
            summary[name] = (statistics.median(values), min(values), max(values)) if values else None
        parts = {}
        for execution in ("baseline", "compact"):
            phases = {}
            for phase in ("forward_s", "backward_s", "grad_reduction_s", "planning_s"):
                values = [get(r, execution, phase) for r in done]
                values = [v for v in values if is_number(v)]
                phases[phase] = statistics.median(values) if values else None
            parts[execution] = phases
        summary["phases"] = parts
        terms = [get(r, "breakdown", "terms_s") for r in done]
        terms = [t for t in terms if isinstance(t, dict)]
        summary["terms"] = ({name: statistics.median(t[name] for t in terms) for name in terms[0]}
                            if terms else None)
        summary["ideal_s"] = statistics.median([get(r, "breakdown", "ideal_compact_fbg_s") for r in done
                                                if is_number(get(r, "breakdown", "ideal_compact_fbg_s"))] or [0.0])
        summaries.append(summary)
    return summaries


def _speedup_figure(summaries: list[dict[str, Any]], footer_lines: list[str]):
    import numpy as np

    paper = paper_figures()
    fig = page("Speedup of compact execution over the per-trajectory baseline",
               f"ours: median over steps, bars span min-max; paper: {PAPER_SETUP}")
    ax = fig.add_axes((0.07, 0.2, 0.9, 0.65))
    metrics = [("compression", "rows S/C (compression)", "#9ecae1"), ("fbg_speedup", "F/B/Grad speedup", "#3182bd"),
               ("core_speedup", "Core speedup (planning included)", "#08519c")]
    labels = [s["label"] for s in summaries] + ["paper\nLing-3.0-tiny, 8 GPUs"]
    x = np.arange(len(labels))
    width = 0.26
    top = max([paper["compression"]] + [s[m][2] for s in summaries for m, _, _ in metrics if s[m]])
    for j, (name, legend, color) in enumerate(metrics):
        offset = (j - 1) * width
        labelled = False
        for i, s in enumerate(summaries):
            value = s[name]
            if value is None:
                text = ERROR if s["errors"] else NOT_MEASURED
                ax.text(x[i] + offset, 0.02 * top, text, rotation=90, ha="center", va="bottom", fontsize=8,
                        color="firebrick")
                continue
            median, low, high = value
            ax.bar(x[i] + offset, median, width, color=color, label=None if labelled else legend,
                   yerr=[[median - low], [high - median]] if high > low else None, capsize=3)
            labelled = True
            ax.text(x[i] + offset, high + 0.01 * top, f"{median:.2f}x", ha="center", va="bottom", fontsize=8)
        paper_value = {"compression": paper["compression"], "fbg_speedup": paper["speedup"]}.get(name)
        xp = x[-1] + offset
        if paper_value is None:
            ax.text(xp, 0.02 * top, NOT_REPORTED, rotation=90, ha="center", va="bottom", fontsize=8, color="0.4")
        else:
            ax.bar(xp, paper_value, width, color=color, hatch="//", edgecolor="white",
                   label=None if labelled else legend)
            ax.text(xp, paper_value + 0.01 * top, f"{paper_value:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="0.3", linewidth=0.8, linestyle="--")
    ax.set_xticks(x, labels)
    ax.set_ylabel("x over the per-trajectory baseline")
    ax.set_ylim(0, top * 1.1)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    footer(fig, footer_lines)
    return fig


def _time_figure(summaries: list[dict[str, Any]], footer_lines: list[str]):

    paper = paper_figures()
    fig = page("Step time by phase and efficiency",
               "left: median step time of each execution relative to the baseline's F+B+Grad+planning; "
               "right: F/B/Grad speedup / compression")
    ax = fig.add_axes((0.25, 0.2, 0.38, 0.65))
    phases = [("forward_s", "forward", "#6baed6"), ("backward_s", "backward", "#2171b5"),
              ("grad_reduction_s", "gradient reduction", "#fd8d3c"), ("planning_s", "planning + layout", "#74c476")]
    labels, positions, labelled = [], [], set()
    for i, s in enumerate(summaries):
        base = s["phases"]["baseline"]
        total = sum(v for v in base.values() if is_number(v))
        for j, execution in enumerate(("baseline", "compact")):
            y = 2.6 * i + j
            positions.append(y)
            labels.append(f"{s['short_label']}: {execution}")
            left = 0.0
            values = s["phases"][execution]
            if not total or all(v is None for v in values.values()):
                ax.text(0.01, y, ERROR if s["errors"] else NOT_MEASURED, va="center", fontsize=8, color="firebrick")
                continue
            for name, legend, color in phases:
                value = values[name]
                if not is_number(value):
                    continue
                ax.barh(y, value / total, left=left, color=color, label=None if name in labelled else legend)
                labelled.add(name)
                left += value / total
            seconds = sum(v for v in values.values() if is_number(v))
            ax.text(left + 0.01, y, f"{seconds:.3g} s", va="center", fontsize=8)
    ax.set_yticks(positions, labels)
    ax.invert_yaxis()
    ax.set_xlabel("fraction of the baseline's step time")
    ax.set_xlim(0, 1.25)
    ax.legend(loc="lower right")
    ax.grid(axis="x", alpha=0.3)

    ax2 = fig.add_axes((0.82, 0.2, 0.15, 0.65))
    names = [s["short_label"] for s in summaries] + ["paper"]
    values = [s["efficiency"][0] if s["efficiency"] else None for s in summaries] + [paper["efficiency"]]
    for i, value in enumerate(values):
        if value is None:
            ax2.text(0.02, i, NOT_MEASURED, va="center", fontsize=8, color="firebrick")
        else:
            ax2.barh(i, value, color="0.55" if i == len(values) - 1 else "#3182bd")
            ax2.text(value, i, f" {value:.2f}", va="center", fontsize=8,
                     bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5})
    ax2.axvline(1.0, color="0.3", linewidth=0.8, linestyle="--")
    ax2.set_yticks(range(len(names)), names)
    ax2.invert_yaxis()
    ax2.set_xlabel("efficiency")
    ax2.set_xlim(0, max([1.2] + [v * 1.25 for v in values if v is not None]))
    footer(fig, footer_lines)
    return fig


def _breakdown_figure(summaries: list[dict[str, Any]], footer_lines: list[str]):
    import numpy as np

    with_terms = [s for s in summaries if s["terms"]]
    fig = page("Compact step time beyond the ideal (C/S) x baseline",
               "op-level fwd+bwd on real microbatch layouts (harts bench speedup breakdown), median over steps; "
               "terms sum to the excess, negative = faster than ideal")
    ax = fig.add_axes((0.2, 0.2, 0.77, 0.65))
    names = list(with_terms[0]["terms"])
    height = 0.8 / len(with_terms)
    for j, s in enumerate(with_terms):
        y = np.arange(len(names)) + (j - (len(with_terms) - 1) / 2) * height
        values = [s["terms"][n] for n in names]
        ax.barh(y, values, height, label=f"{s['short_label']} (ideal {s['ideal_s']:.3g} s)")
    ax.axvline(0.0, color="0.3", linewidth=0.8)
    ax.set_yticks(range(len(names)), [n.replace("_", " ") for n in names])
    ax.invert_yaxis()
    ax.set_xlabel("seconds per step")
    ax.legend(loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    footer(fig, footer_lines)
    return fig


def write_speedup_report(record_paths: list[str | Path], pdf: str | Path, csv: str | Path) -> list[dict[str, Any]]:
    """Write the PDF and CSV; return the CSV rows."""
    records = load_records(record_paths, "speedup")
    if not records:
        raise ValueError("speedup report: no records given")
    rows = speedup_rows(records)
    write_csv(csv, SPEEDUP_COLUMNS, rows)
    lines = provenance_lines(records)
    summaries = _summaries(records)
    figures = [_speedup_figure(summaries, lines), _time_figure(summaries, lines)]
    if any(s["terms"] for s in summaries):
        figures.append(_breakdown_figure(summaries, lines))
    header, table = display_table(rows)
    notes = [
        "F/B/Grad speedup = baseline (forward + backward + gradient reduction) / compact; Core speedup adds "
        "planning (microbatch planner + layout building) to both sides; efficiency = F/B/Grad speedup / (S/C).",
        "Baseline: each trajectory its own sequence, packed to capacity T; same model, kernels, recomputation and "
        "parallel configuration. Records: " + ", ".join(str(p) for p in record_paths),
    ]
    figures += table_pages("Speedup per step", wrap_header(header, 10), table, notes, lines)
    save_pdf(figures, pdf)
    return rows


def speedup_markdown(record_paths: list[str | Path]) -> str:
    records = load_records(record_paths, "speedup")
    header, table = display_table(speedup_rows(records))
    return markdown_table(header, table)
