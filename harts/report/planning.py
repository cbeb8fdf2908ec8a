"""Planning-quality report: `reports/planning.pdf` and `.csv` from `harts bench planning` records (DESIGN §2).

Input: planning records (one per step and planner) and the two planners to compare, ours first
(HARTS) and the baseline second (the OR-Tools planner). Output:
- CSV, columns `PLANNING_COLUMNS`: per (dataset, step) one `ours` row, then per dataset an
  `all` row (Σ compact tokens, Σ seconds, the P95 over the slots of every step, the largest step
  imbalance), then the paper's row. `compression` = baseline compact tokens / ours (the paper's
  per-step 1.007-1.079x), `compact_token_change` = ours / baseline - 1 (the paper's -3.28%),
  `planning_speedup` = baseline seconds / ours (7.24-9.73x), each planner's seconds with the
  step's prefix index built inside it; `planning_speedup_without_index` the same of the
  `*_plan_seconds_without_index`, each planner given the index built once per step (the runtime
  shares it; records from before that timing say `not measured`); imbalances are fractions (0.0214 =
  2.14%). A cell without a record says `not measured`, a failed plan `error` (message in `error`),
  a figure the paper does not give `not reported`; the paper's ranges are written `low-high`.
- PDF: per step, the compression and the planning speedup (bars; index excluded: diamonds)
  against the paper's ranges, and the P95 slot imbalance and step imbalance of both planners
  against the paper's values; then the table, whose notes name the OR-Tools planner's reading
  (replica assignment, slot order) and its CP-SAT solves: how many, how many proven optimal, how
  many stopped at the time limit (`harts.bench.planning.solve_note`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harts.report.records import (
    ERROR, NOT_MEASURED, NOT_REPORTED, format_value, is_number, load_records, provenance_lines,
)
from harts.report.render import footer, markdown_table, page, save_pdf, table_pages, wrap_header, write_csv

PLANNING_COLUMNS = [
    "source", "dataset", "step", "capacity", "dp", "trajectories", "semantic_tokens", "lower_bound_compact_tokens",
    "ours_planner", "baseline_planner", "ours_compact_tokens", "baseline_compact_tokens", "compact_token_change",
    "compression", "ours_plan_seconds", "baseline_plan_seconds", "planning_speedup", "ours_plan_seconds_without_index",
    "baseline_plan_seconds_without_index", "planning_speedup_without_index", "ours_p95_slot_imbalance",
    "baseline_p95_slot_imbalance", "ours_step_imbalance", "baseline_step_imbalance", "ours_microbatches",
    "baseline_microbatches", "error",
]
LABELS = {"harts": "HARTS", "treetrain-ortools": "OR-Tools", "greedy-trie": "greedy-trie",
          "per-trajectory": "per-trajectory"}
PAPER_SETUP = "ten steps of about 44M tokens, T = 65,536, 8 replicas"


def paper_figures() -> dict[str, tuple[float, float]]:
    from harts.bench.planning import PAPER

    return dict(PAPER)


def dataset_name(config: dict[str, Any]) -> str:
    if config.get("data"):
        return Path(config["data"]).name
    return Path(str(config.get("trees", "?"))).stem


def _result(record: dict[str, Any] | None, key: str) -> Any:
    if record is None:
        return NOT_MEASURED
    if "error" in record:
        return ERROR
    value = record["results"].get(key)
    return value if is_number(value) else NOT_MEASURED


def _ratio(a: Any, b: Any, minus_one: bool = False) -> Any:
    if is_number(a) and is_number(b) and b:
        return a / b - 1.0 if minus_one else a / b
    if ERROR in (a, b):
        return ERROR
    return NOT_MEASURED


def planning_rows(records: list[dict[str, Any]], ours: str = "harts",
                  baseline: str = "treetrain-ortools") -> list[dict[str, Any]]:
    """CSV rows (PLANNING_COLUMNS): per step, per dataset over all steps, then the paper's."""
    from harts.planning.microbatch import nearest_rank

    by_key: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for record in records:
        c = record["config"]
        by_key.setdefault((dataset_name(c), c.get("step")), {})[c.get("planner")] = record
    rows = []
    datasets: dict[str, list[tuple[dict, dict]]] = {}
    for (dataset, step), planners in sorted(by_key.items(), key=lambda item: (item[0][0], item[0][1])):
        mine, theirs = planners.get(ours), planners.get(baseline)
        any_record = mine or theirs or next(iter(planners.values()))
        c = any_record["config"]
        done = next((r for r in (mine, theirs) if r and "error" not in r), None)
        row = {"source": "ours", "dataset": dataset, "step": step, "capacity": c.get("capacity"), "dp": c.get("dp"),
               "ours_planner": ours, "baseline_planner": baseline,
               "error": "; ".join(f"{r['config']['planner']}: {r['error']}" for r in (mine, theirs)
                                  if r and "error" in r)}
        for key in ("trajectories", "semantic_tokens", "lower_bound_compact_tokens"):
            row[key] = done["results"].get(key) if done else (ERROR if mine or theirs else NOT_MEASURED)
        for side, record in (("ours", mine), ("baseline", theirs)):
            row[f"{side}_compact_tokens"] = _result(record, "compact_tokens")
            row[f"{side}_plan_seconds"] = _result(record, "plan_seconds")
            row[f"{side}_plan_seconds_without_index"] = _result(record, "plan_seconds_without_index")
            row[f"{side}_p95_slot_imbalance"] = _result(record, "p95_slot_imbalance")
            row[f"{side}_step_imbalance"] = _result(record, "step_imbalance")
            row[f"{side}_microbatches"] = _result(record, "microbatches")
        row["compact_token_change"] = _ratio(row["ours_compact_tokens"], row["baseline_compact_tokens"], True)
        row["compression"] = _ratio(row["baseline_compact_tokens"], row["ours_compact_tokens"])
        _speedups(row)
        rows.append(row)
        datasets.setdefault(dataset, []).append((mine, theirs))

    for dataset, pairs in datasets.items():
        row = {"source": "ours", "dataset": dataset, "step": "all", "ours_planner": ours, "baseline_planner": baseline,
               "error": ""}
        first = next(r for pair in pairs for r in pair if r)["config"]
        row["capacity"], row["dp"] = first.get("capacity"), first.get("dp")
        for side, index in (("ours", 0), ("baseline", 1)):
            measured = [pair[index] for pair in pairs if pair[index] and "error" not in pair[index]]
            complete = len(measured) == len(pairs)
            if not complete:
                failed = any(pair[index] and "error" in pair[index] for pair in pairs)
                for key in ("compact_tokens", "plan_seconds", "plan_seconds_without_index", "p95_slot_imbalance",
                            "step_imbalance", "microbatches"):
                    row[f"{side}_{key}"] = ERROR if failed else NOT_MEASURED
                continue
            results = [r["results"] for r in measured]
            row[f"{side}_compact_tokens"] = sum(r["compact_tokens"] for r in results)
            row[f"{side}_plan_seconds"] = sum(r["plan_seconds"] for r in results)
            alone = [r.get("plan_seconds_without_index") for r in results]
            row[f"{side}_plan_seconds_without_index"] = (sum(alone) if all(is_number(a) for a in alone)
                                                         else NOT_MEASURED)
            row[f"{side}_microbatches"] = sum(r["microbatches"] for r in results)
            slots = [v for r in results for v in r.get("slot_imbalance", [])]
            import numpy as np

            row[f"{side}_p95_slot_imbalance"] = float(nearest_rank(np.asarray(slots), 95)) if slots else NOT_MEASURED
            row[f"{side}_step_imbalance"] = max(r["step_imbalance"] for r in results)
        complete_steps = [pair for pair in pairs if all(r and "error" not in r for r in pair)]
        for key in ("trajectories", "semantic_tokens", "lower_bound_compact_tokens"):
            row[key] = (sum(pair[0]["results"][key] for pair in complete_steps)
                        if len(complete_steps) == len(pairs) else NOT_MEASURED)
        row["compact_token_change"] = _ratio(row["ours_compact_tokens"], row["baseline_compact_tokens"], True)
        row["compression"] = _ratio(row["baseline_compact_tokens"], row["ours_compact_tokens"])
        _speedups(row)
        rows.append(row)

    paper = paper_figures()
    tokens_ours, tokens_theirs = paper["compact_tokens"]
    row = {column: NOT_REPORTED for column in PLANNING_COLUMNS}
    row.update({
        "source": "paper", "dataset": "paper workload", "step": "all", "capacity": 65536, "dp": 8,
        "ours_planner": "harts", "baseline_planner": "treetrain-ortools",
        "ours_compact_tokens": tokens_ours, "baseline_compact_tokens": tokens_theirs,
        "compact_token_change": tokens_ours / tokens_theirs - 1.0,
        "compression": "{}-{}".format(*paper["compression"]), "planning_speedup": "{}-{}".format(*paper["speedup"]),
        "ours_p95_slot_imbalance": paper["p95_slot_imbalance"][0],
        "baseline_p95_slot_imbalance": paper["p95_slot_imbalance"][1],
        "ours_step_imbalance": paper["max_step_imbalance"][0], "baseline_step_imbalance": paper["max_step_imbalance"][1],
        "error": "",
    })
    rows.append(row)
    return rows


def _speedups(row: dict[str, Any]) -> None:
    row["planning_speedup"] = _ratio(row["baseline_plan_seconds"], row["ours_plan_seconds"])
    row["planning_speedup_without_index"] = _ratio(row["baseline_plan_seconds_without_index"],
                                                   row["ours_plan_seconds_without_index"])


def _percent(value: Any) -> str:
    return f"{100 * value:.2f}%" if is_number(value) else str(value)


def display_table(rows: list[dict[str, Any]], ours: str, baseline: str) -> tuple[list[str], list[list[str]]]:
    a, b = LABELS.get(ours, ours), LABELS.get(baseline, baseline)
    header = ["source", "dataset", "step", f"{a} compact tokens", f"{b} compact tokens", "change", "compression",
              f"{a} s", f"{b} s", "planning speedup", "speedup excl. index", f"{a} P95 slot imb.", f"{b} P95 slot imb.",
              f"{a} step imb.", f"{b} step imb.", "note"]
    table = []
    for r in rows:
        change = r["compact_token_change"]
        table.append([
            r["source"], str(r["dataset"]), str(r["step"]), format_value(r["ours_compact_tokens"], ","),
            format_value(r["baseline_compact_tokens"], ","),
            f"{100 * change:+.2f}%" if is_number(change) else str(change),
            (format_value(r["compression"], ".3f", "x") if is_number(r["compression"])
             else str(r["compression"]) + "x" * (r["source"] == "paper")),
            format_value(r["ours_plan_seconds"], ".3g"), format_value(r["baseline_plan_seconds"], ".3g"),
            format_value(r["planning_speedup"], ".2f", "x") if is_number(r["planning_speedup"])
            else str(r["planning_speedup"]) + "x" * (r["source"] == "paper"),
            format_value(r["planning_speedup_without_index"], ".2f", "x"),
            _percent(r["ours_p95_slot_imbalance"]), _percent(r["baseline_p95_slot_imbalance"]),
            _percent(r["ours_step_imbalance"]), _percent(r["baseline_step_imbalance"]),
            r["error"] if len(r["error"]) < 40 else r["error"][:37] + "...",
        ])
    return header, table


def _figure(rows: list[dict[str, Any]], ours: str, baseline: str, footer_lines: list[str]):
    import numpy as np

    paper = paper_figures()
    a, b = LABELS.get(ours, ours), LABELS.get(baseline, baseline)
    steps = [r for r in rows if r["source"] == "ours" and r["step"] != "all"]
    several = len({r["dataset"] for r in steps}) > 1
    labels = [f"{r['dataset']}:{r['step']}" if several else str(r["step"]) for r in steps]
    x = np.arange(len(steps))
    fig = page(f"Planning quality: {a} vs {b}", f"ours per step; paper: {PAPER_SETUP} (shaded range / dashed lines)")
    colors = {"ours": "#3182bd", "baseline": "#e6550d"}

    def bars(ax, key, title, band, digits, bottom=0.0, markers=None):
        unit = "x"
        values = [r[key] for r in steps]
        for i, value in enumerate(values):
            if is_number(value):
                ax.bar(x[i], value - bottom, 0.6, bottom=bottom, color="#3182bd")
                ax.text(x[i], max(value, bottom), f"{value:.{digits}f}{unit}", ha="center", va="bottom", fontsize=7)
            else:
                ax.text(x[i], bottom, str(value), rotation=90, ha="center", va="bottom", fontsize=7,
                        color="firebrick")
        measured = [v for v in values if is_number(v)]
        if markers is not None:
            marker_key, marker_label = markers
            points = [(x[i], r[marker_key]) for i, r in enumerate(steps) if is_number(r[marker_key])]
            if points:
                ax.plot(*zip(*points), "D", color="black", markersize=4, linestyle="none", label=marker_label)
                for px, py in points:
                    ax.text(px + 0.3, py, f"{py:.{digits - 1}f}", ha="left", va="center", fontsize=6)
                measured += [py for _, py in points]
        low = min([bottom, band[0]] + measured)
        high = max([band[1]] + measured)
        ax.set_ylim(low - 0.02 * (high - low) if bottom else 0.0, high + 0.12 * (high - low))
        if band:
            ax.axhspan(*band, color="0.6", alpha=0.3, label=f"paper {band[0]}-{band[1]}{unit}")
            ax.legend(loc="upper right")
        ax.axhline(1.0, color="0.3", linewidth=0.8, linestyle="--")
        ax.set_title(title)
        ax.set_xticks(x, labels, rotation=45 if several else 0)
        ax.set_xlabel("step")
        ax.grid(axis="y", alpha=0.3)

    def pairs(ax, key, title, paper_values):
        for side, offset in (("ours", -0.2), ("baseline", 0.2)):
            values = [r[f"{side}_{key}"] for r in steps]
            heights = [100 * v if is_number(v) else 0.0 for v in values]
            ax.bar(x + offset, heights, 0.4, color=colors[side], label=a if side == "ours" else b)
            for i, value in enumerate(values):
                if not is_number(value):
                    ax.text(x[i] + offset, 0, str(value), rotation=90, ha="center", va="bottom", fontsize=7,
                            color="firebrick")
        for side, value in zip(("ours", "baseline"), paper_values):
            ax.axhline(100 * value, color=colors[side], linestyle="--", linewidth=1,
                       label=f"paper {a if side == 'ours' else b} {100 * value:.2f}%")
        measured = [100 * r[f"{side}_{key}"] for r in steps for side in ("ours", "baseline")
                    if is_number(r[f"{side}_{key}"])]
        ax.set_ylim(0, 1.45 * max(measured + [100 * v for v in paper_values]))
        ax.set_title(title)
        ax.set_ylabel("%")
        ax.set_xticks(x, labels, rotation=45 if several else 0)
        ax.set_xlabel("step")
        ax.legend(loc="upper center", ncol=2, fontsize=7)
        ax.grid(axis="y", alpha=0.3)

    grid = fig.add_gridspec(2, 2, left=0.07, right=0.97, top=0.86, bottom=0.16, hspace=0.45, wspace=0.18)
    bars(fig.add_subplot(grid[0, 0]), "compression", f"compression: {b} compact tokens / {a}", paper["compression"], 3,
         bottom=1.0)
    bars(fig.add_subplot(grid[0, 1]), "planning_speedup", f"planning speedup: {b} seconds / {a}", paper["speedup"], 2,
         markers=("planning_speedup_without_index", "prefix index excluded (built once, shared)"))
    pairs(fig.add_subplot(grid[1, 0]), "p95_slot_imbalance", "P95 slot imbalance", paper["p95_slot_imbalance"])
    pairs(fig.add_subplot(grid[1, 1]), "step_imbalance", "step imbalance", paper["max_step_imbalance"])
    footer(fig, footer_lines)
    return fig


def write_planning_report(record_paths: list[str | Path], pdf: str | Path, csv: str | Path, ours: str = "harts",
                          baseline: str = "treetrain-ortools") -> list[dict[str, Any]]:
    """Write the PDF and CSV; return the CSV rows."""
    records = load_records(record_paths, "planning")
    if not records:
        raise ValueError("planning report: no records given")
    rows = planning_rows(records, ours, baseline)
    write_csv(csv, PLANNING_COLUMNS, rows)
    lines = provenance_lines(records)
    header, table = display_table(rows, ours, baseline)
    capacity = sorted({str(r["config"].get("capacity")) for r in records})
    dp = sorted({str(r["config"].get("dp")) for r in records})
    notes = [
        f"T = {', '.join(capacity)}, D = {', '.join(dp)}. Seconds: each planner's wall time on this machine, its "
        "prefix index included; the OR-Tools planner runs CP-SAT with its time limit per solve.",
        "Slot imbalance = max/mean - 1 of a slot's microbatch works; step imbalance = max/mean - 1 of the replicas' "
        "cumulative work. Records: " + ", ".join(str(p) for p in record_paths),
    ]
    from harts.bench.planning import solve_note

    notes += solve_note(records).splitlines()
    figures = [_figure(rows, ours, baseline, lines)]
    figures += table_pages("Planning quality per step", wrap_header(header, 12), table, notes, lines)
    save_pdf(figures, pdf)
    return rows


def planning_markdown(record_paths: list[str | Path], ours: str = "harts", baseline: str = "treetrain-ortools") -> str:
    """The table, and under it the OR-Tools planner's reading and CP-SAT solves."""
    from harts.bench.planning import solve_note

    records = load_records(record_paths, "planning")
    header, table = display_table(planning_rows(records, ours, baseline), ours, baseline)
    note = solve_note(records)
    return markdown_table(header, table) + ("\n\n" + note.replace("\n", "\n\n") if note else "")
