"""`harts bench planning`: planning quality and time per step, HARTS vs the OR-Tools planner (DESIGN §2).

For each step (generated from `--trees CONFIG` with `--seed`, or read from `--data DIR`, file
`step_NNN.*`) and each planner of `--planners`: plan `--repeats` times, the planners interleaved
(wall time measured by the planner, its prefix index included; the median is reported, every
repeat kept in `plan_seconds_each`), and once more per repeat given the step's prefix index,
built once per step outside the planners as the runtime shares it (`plan_seconds_without_index`,
median; every repeat in `plan_seconds_without_index_each`); validate every plan (coverage,
capacity, K mod D, works recomputed from the trie) and compute DESIGN §2's metrics of the first.
The records also hold the process CPU time of the planning call (all threads, so CP-SAT's
workers count), which shows how much of a wall time was lost to other load on the machine,
`index_seconds`, the time to build the step's prefix index alone (part of every planner's time),
and `identical_plans` (whether every repeat, with and without the index, returned the same plan).
CP-SAT is imported before any timing. One record per (step, planner), written with
`harts.tracking.records`; a planner that fails or whose plan does not validate gives a record
with an `error` field.

The table compares the first planner with the second in the paper's form: per step and over
all steps, compact tokens, compression (second / first), planning seconds and speedup
(second / first), both with the prefix index inside each planner's time and excluding it
("excl. index": `plan_seconds_without_index`), P95 slot imbalance and step imbalance; the
paper's figures sit in the last row. Over all steps: Σ compact tokens (and the change), Σ
seconds, the range of per-step compression and speedups, the P95 over the slots of every step
(nearest rank) and the largest step imbalance.
The table is printed and written beside the records as `.md` and `.csv`; the note under it names
the machine, the index build time, on how many steps HARTS's W equals the lower bound of
`harts.planning.bounds` (proven optimal), and the OR-Tools planner's reading and CP-SAT solves
(`solve_note`: how many proven optimal, how many stopped at the time limit).

W&B (harts.tracking.wandb_log, `--wandb-*`): one run per record, logged as soon as its step is
planned (every repeat a history row: plan seconds with and without the index, CPU seconds).

The OR-Tools planner's options (`--time-limit`, `--replica-assignment`, `--slot-order`, see
harts.planning.treetrain; defaults: the paper's description) go to it alone, are recorded in the
config's `options`, and the resolved reading, limit and per-solve statuses in the results' `details`;
without that planner in `--planners` they have no effect, and a note on stderr says so.
"""

from __future__ import annotations

import argparse
import csv
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from harts.args import index_list, name_list, non_negative_int, positive_int, records_file
from harts.extras import require
from harts.files import atomic_open, write_text
from harts.tracking import wandb_log

logger = logging.getLogger(__name__)

# DESIGN §2: the paper's ten steps, HARTS vs the OR-Tools planner.
PAPER = {
    "compact_tokens": (77_581_958, 80_213_867),
    "compression": (1.007, 1.079),
    "speedup": (7.24, 9.73),
    "p95_slot_imbalance": (0.0214, 0.3464),
    "max_step_imbalance": (0.0111, 0.0568),
}
_LABELS = {"harts": "HARTS", "treetrain-ortools": "OR-Tools", "greedy-trie": "greedy-trie",
           "per-trajectory": "per-trajectory"}


def register(commands: argparse._SubParsersAction) -> None:
    from harts.planning.microbatch import PLANNER_NAMES
    from harts.planning.treetrain import add_treetrain_options

    parser = commands.add_parser("planning", help="planning quality and time: HARTS vs the OR-Tools planner")
    parser.add_argument("--trees", required=True, help="trees config NAME or YAML path (the steps' shape and count)")
    parser.add_argument("--data", help="read steps step_NNN.* from this directory instead of generating them")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--steps", type=index_list, default=None, help="comma-separated step indices (default: all)")
    parser.add_argument("--capacity", type=positive_int, default=None, help="T (default: the config's max_tokens)")
    parser.add_argument("--dp", type=positive_int, default=8)
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="plan each step this many times per planner (interleaved); seconds are medians")
    parser.add_argument("--planners", type=name_list(PLANNER_NAMES, "planner"),
                        default=["harts", "treetrain-ortools"],
                        help=f"comma-separated, the first is compared with the others ({', '.join(PLANNER_NAMES)})")
    add_treetrain_options(parser)
    parser.add_argument("--out", type=records_file, default="reports/raw/planning/planning.json",
                        help="records (.json or .jsonl); the table goes beside it as .md and .csv")
    wandb_log.add_arguments(parser)
    parser.set_defaults(run=run, files=lambda a: (
        [a.out, *(Path(a.out).with_suffix(suffix) for suffix in (".md", ".csv"))], [a.trees, a.data]))


def _load_step(args: argparse.Namespace, synth: Any, index: int):
    from harts.trees.io import JSONL_SUFFIXES, NPZ_SUFFIX, read_step
    from harts.trees.synth import generate_step

    if args.data is None:
        return generate_step(synth, args.seed, index)
    names = [f"step_{index:03d}{suffix}" for suffix in (NPZ_SUFFIX, *JSONL_SUFFIXES)]
    matches = [Path(args.data) / name for name in names if (Path(args.data) / name).exists()]
    if not matches:
        raise ValueError(f"{args.data}: no file {' or '.join(names)} (generate it with harts trees synth)")
    if len(matches) > 1:
        raise ValueError(f"{args.data}: step {index} is given twice ({matches[0].name}, {matches[1].name})")
    return read_step(matches[0])


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from harts.config import config_to_dict, load_config, shipped_config_path
    from harts.planning.microbatch import plan, plan_metrics, validate
    from harts.planning.treetrain import treetrain_options as planner_options
    from harts.tracking.records import make_record, write_records
    from harts.trees.synth import SynthConfig
    from harts.trees.trie import PrefixIndex

    synth = load_config(shipped_config_path(args.trees, "trees"), SynthConfig)
    steps = args.steps if args.steps is not None else list(range(synth.num_steps))
    if args.steps is not None and args.data is None and max(steps) >= synth.num_steps:
        raise ValueError(f"{args.trees}: step {max(steps)} is beyond num_steps = {synth.num_steps}")
    capacity = args.capacity if args.capacity is not None else synth.max_tokens
    # The pipeline passes --time-limit whatever its planners are: without treetrain-ortools the
    # options have no effect, which is said rather than refused.
    treetrain_options = planner_options(args, ["treetrain-ortools"])
    if treetrain_options and "treetrain-ortools" not in args.planners:
        logger.info(f"note: treetrain-ortools options {treetrain_options} have no effect: --planners does not list it")

    if "treetrain-ortools" in args.planners:
        # Import CP-SAT before timing: its import would otherwise count in the first step's plan.
        require("ortools.sat.python.cp_model", "the treetrain-ortools planner")

    records = []
    # One W&B run per record (step and planner), logged as soon as its step is planned.
    tracker = wandb_log.BenchLogger(wandb_log.options(args))
    progress = tqdm(total=len(steps) * len(args.planners) * args.repeats, desc="bench planning", unit="plan",
                    file=sys.stderr, disable=None)
    for step_index in steps:
        step = _load_step(args, synth, step_index)
        index_times = []
        for _ in range(args.repeats):
            index_started = time.perf_counter()
            index = PrefixIndex.from_step(step)
            index_times.append(time.perf_counter() - index_started)
        lower_bound = index.segment_tree().num_compact_tokens
        options = {name: treetrain_options if name == "treetrain-ortools" else {} for name in args.planners}
        # Repeats interleave the planners, so that a slow spell of the machine hits both.
        # Per planner and repeat: (plan, its CPU seconds, the plan made given the prebuilt index).
        runs: dict[str, list] = {name: [] for name in args.planners}
        errors: dict[str, str] = {}
        for _ in range(args.repeats):
            for name in args.planners:
                progress.set_postfix_str(f"step {step_index} {name}")
                progress.update()
                if name in errors:
                    continue
                try:
                    cpu_started = time.process_time()
                    result = plan(step, capacity, args.dp, name, **options[name])
                    cpu_seconds = time.process_time() - cpu_started
                    validate(result, step, index)
                    given_index = plan(step, capacity, args.dp, name, index=index, **options[name])
                    validate(given_index, step, index)
                except ValueError as error:
                    errors[name] = str(error)
                    continue
                runs[name].append((result, cpu_seconds, given_index))
        for name in args.planners:
            config = {
                "trees": str(args.trees), "synth": config_to_dict(synth), "data": args.data, "seed": args.seed,
                "step": step_index, "capacity": capacity, "dp": args.dp, "planner": name, "options": options[name],
                "repeats": args.repeats,
            }
            tracker.start("planning", config)
            if name in errors:
                records.append(make_record("planning", config, error=errors[name]))
                tracker.finish(records[-1])
                continue
            for repeat, (timed, cpu_seconds, alone) in enumerate(runs[name]):
                tracker.log({"repeat": repeat + 1, "plan_seconds": timed.plan_seconds, "plan_cpu_seconds": cpu_seconds,
                             "plan_seconds_without_index": alone.plan_seconds})
            result = runs[name][0][0]
            metrics = plan_metrics(result, lower_bound, step.num_semantic_tokens)
            results = {
                "trajectories": step.num_trajectories,
                "semantic_tokens": step.num_semantic_tokens,
                "compact_tokens": metrics.compact_tokens,
                "lower_bound_compact_tokens": metrics.lower_bound_compact_tokens,
                "microbatches": metrics.num_microbatches,
                "plan_seconds": statistics.median(r.plan_seconds for r, _, _ in runs[name]),
                "plan_seconds_each": [r.plan_seconds for r, _, _ in runs[name]],
                "plan_cpu_seconds": statistics.median(cpu for _, cpu, _ in runs[name]),
                "index_seconds": statistics.median(index_times),
                "plan_seconds_without_index": statistics.median(alone.plan_seconds for _, _, alone in runs[name]),
                "plan_seconds_without_index_each": [alone.plan_seconds for _, _, alone in runs[name]],
                "p95_slot_imbalance": metrics.p95_slot_imbalance,
                "max_slot_imbalance": metrics.max_slot_imbalance,
                "step_imbalance": metrics.step_imbalance,
                "critical_path": metrics.critical_path,
                "max_replica_work": metrics.max_replica_work,
                "slot_imbalance": metrics.slot_imbalance,
                "details": result.details,
                # CP-SAT stopped by its time limit may return another plan on a repeat; the plans made
                # given the index count too (their times are the "excl. index" ones).
                "identical_plans": all(other.microbatches == result.microbatches
                                       for r, _, alone in runs[name] for other in (r, alone)),
            }
            records.append(make_record("planning", config, results))
            tracker.finish(records[-1])
    progress.close()
    tracker.close()

    out = Path(args.out)
    write_records(records, out)
    header, rows = planning_table(records, args.planners)
    markdown = _markdown(header, rows)
    hardware = records[0]["environment"]["hardware"] if records else {}
    note = (f"T = {capacity:,}, D = {args.dp}; {hardware.get('cpu', '?')}, {hardware.get('cpu_count', '?')} CPUs; "
            f"seed {args.seed}; {args.trees}")
    note += _timing_note(records)
    solves = solve_note(records)
    note += "\n" + solves if solves else ""
    write_text(out.with_suffix(".md"), markdown + "\n\n" + note + "\n")
    with atomic_open(out.with_suffix(".csv"), newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    print(markdown)
    print(note)
    print(f"wrote {out} and its .md/.csv table")
    failed = [r for r in records if "error" in r]
    for record in failed:
        logger.error(f"step {record['config']['step']} {record['config']['planner']}: {record['error']}")
    return 1 if failed else 0


def planning_table(records: list[dict[str, Any]], planners: list[str]) -> tuple[list[str], list[list[str]]]:
    """Header and rows comparing planners[0] ("ours") with planners[1] (or a one-planner table)."""
    import numpy as np

    from harts.planning.microbatch import nearest_rank

    ours = planners[0]
    other = planners[1] if len(planners) > 1 else None
    by_key = {(r["config"]["step"], r["config"]["planner"]): r for r in records}
    steps = sorted({r["config"]["step"] for r in records})
    a, b = _LABELS[ours], _LABELS[other] if other else None
    header = ["step", f"{a} tokens"]
    if other:
        header += [f"{b} tokens", "compression"]
    header += [f"{a} s"]
    if other:
        header += [f"{b} s", "speedup"]
    header += [f"{a} s excl. index"]
    if other:
        header += [f"{b} s excl. index", "speedup excl. index"]
    header += [f"{a} P95 slot imb."] + ([f"{b} P95 slot imb."] if other else [])
    header += [f"{a} step imb."] + ([f"{b} step imb."] if other else [])

    def cell(record: dict[str, Any] | None, key: str, fmt: str) -> str:
        if record is None:
            return "missing"
        if "error" in record:
            return "error"
        return format(record["results"][key], fmt)

    rows = []
    totals = {ours: [], other: []}
    compression, speedup, speedup_alone = [], [], []
    slots = {ours: [], other: []}
    step_imb = {ours: [], other: []}
    seconds = {ours: [], other: []}
    seconds_alone = {ours: [], other: []}
    for s in steps:
        mine, theirs = by_key.get((s, ours)), by_key.get((s, other)) if other else None
        row = [str(s), cell(mine, "compact_tokens", ",")]
        both = mine and theirs and "error" not in mine and "error" not in theirs
        if other:
            ratio = theirs["results"]["compact_tokens"] / mine["results"]["compact_tokens"] if both else None
            row += [cell(theirs, "compact_tokens", ","), f"{ratio:.3f}x" if ratio else "-"]
        row += [cell(mine, "plan_seconds", ".2f")]
        if other:
            fast = theirs["results"]["plan_seconds"] / mine["results"]["plan_seconds"] if both else None
            row += [cell(theirs, "plan_seconds", ".2f"), f"{fast:.1f}x" if fast else "-"]
            if both:
                compression.append(ratio)
                speedup.append(fast)
        row += [cell(mine, "plan_seconds_without_index", ".3f")]
        if other:
            alone = (theirs["results"]["plan_seconds_without_index"] / mine["results"]["plan_seconds_without_index"]
                     if both else None)
            row += [cell(theirs, "plan_seconds_without_index", ".3f"), f"{alone:.1f}x" if alone else "-"]
            if both:
                speedup_alone.append(alone)
        for key in ("p95_slot_imbalance", "step_imbalance"):
            row += [_percent(mine, key)] + ([_percent(theirs, key)] if other else [])
        rows.append(row)
        for name, record in ((ours, mine), (other, theirs)):
            if record is not None and "error" not in record:
                totals[name].append(record["results"]["compact_tokens"])
                slots[name].extend(record["results"]["slot_imbalance"])
                step_imb[name].append(record["results"]["step_imbalance"])
                seconds[name].append(record["results"]["plan_seconds"])
                seconds_alone[name].append(record["results"]["plan_seconds_without_index"])

    def over(name: str | None) -> dict[str, str]:
        return {
            "tokens": f"{sum(totals[name]):,}" if totals[name] else "-",
            "p95": f"{100 * nearest_rank(np.asarray(slots[name]), 95):.2f}%" if slots[name] else "-",
            "step": f"{100 * max(step_imb[name]):.2f}%" if step_imb[name] else "-",
            "seconds": f"{sum(seconds[name]):.1f}" if seconds[name] else "-",
            "seconds_alone": f"{sum(seconds_alone[name]):.2f}" if seconds_alone[name] else "-",
        }

    mine_all, theirs_all = over(ours), over(other) if other else None
    row = ["all", mine_all["tokens"]]
    if other:
        change = (f" ({100 * (sum(totals[ours]) / sum(totals[other]) - 1):+.2f}%)"
                  if totals[ours] and totals[other] else "")
        row += [theirs_all["tokens"], _range(compression, "x", 3)]
        row[1] += change
    row += [mine_all["seconds"]]
    if other:
        row += [theirs_all["seconds"], _range(speedup, "x", 1)]
    row += [mine_all["seconds_alone"]]
    if other:
        row += [theirs_all["seconds_alone"], _range(speedup_alone, "x", 1)]
    row += [mine_all["p95"]] + ([theirs_all["p95"]] if other else [])
    row += [mine_all["step"]] + ([theirs_all["step"]] if other else [])
    rows.append(row)
    if other == "treetrain-ortools" and ours == "harts":
        ours_tokens, theirs_tokens = PAPER["compact_tokens"]
        rows.append([
            "paper", f"{ours_tokens:,} ({100 * (ours_tokens / theirs_tokens - 1):+.2f}%)", f"{theirs_tokens:,}",
            _range(list(PAPER["compression"]), "x", 3), "-", "-", _range(list(PAPER["speedup"]), "x", 2), "-", "-", "-",
            *(f"{100 * v:.2f}%" for v in PAPER["p95_slot_imbalance"]),
            *(f"{100 * v:.2f}%" for v in PAPER["max_step_imbalance"]),
        ])
    return header, rows


def _timing_note(records: list[dict[str, Any]]) -> str:
    """What every planner's seconds include, and on how many steps HARTS's W is proven optimal."""
    done = [r for r in records if "error" not in r]
    index = [r["results"]["index_seconds"] for r in done]
    note = ""
    if index:
        note += (f"\nEvery planner's seconds include building the step's prefix index "
                 f"({min(index):.2f}–{max(index):.2f} s per step when timed alone).")
        alone: dict[str, list[float]] = {}
        for r in done:
            alone.setdefault(r["config"]["planner"], []).append(r["results"]["plan_seconds_without_index"])
        note += (" The excl. index seconds time each planner given that index, built once per step outside "
                 "the planners (the runtime shares it): " + "; ".join(
                     f"{name} {1e3 * min(v):.1f}–{1e3 * max(v):.1f} ms" for name, v in alone.items()) + ".")
    gaps = [r["results"]["details"]["work_gap_to_bound"] for r in done if r["config"]["planner"] == "harts"]
    if gaps:
        note += (f"\nHARTS's compact tokens equal the lower bound of harts.planning.bounds (W proven optimal) "
                 f"on {sum(g == 0 for g in gaps)} of {len(gaps)} steps.")
    return note


def solve_note(records: list[dict[str, Any]]) -> str:
    """One line per reading (replica assignment, slot order, time limit) of the OR-Tools planner's
    records: its CP-SAT solves, how many were proven optimal and how many stopped at the time limit.
    Empty without such records; records from before the statuses were kept are counted as such."""
    groups: dict[tuple[Any, Any, Any], list[dict[str, Any]]] = {}
    for record in records:
        if record["config"].get("planner") == "treetrain-ortools" and "error" not in record:
            details = record["results"].get("details", {})
            key = (details.get("replica_assignment"), details.get("slot_order"), details.get("time_limit_s"))
            groups.setdefault(key, []).append(details)
    lines = []
    for (assignment, order, limit), group in groups.items():
        reading = f"replicas by {assignment}, slots in {order} order" if assignment else "reading not recorded"
        limit_text = (f"CP-SAT limit {limit:g} s per solve" if isinstance(limit, (int, float))
                      else "CP-SAT limit not recorded")
        summaries = [d["solve_summary"] for d in group if "solve_summary" in d]
        line = f"OR-Tools ({reading}, {limit_text}): "
        if summaries:
            solves, optimal, stopped = (sum(s[key] for s in summaries)
                                        for key in ("solves", "optimal", "stopped_by_limit"))
            line += (f"{solves} solves on {len(summaries)} step{'s' * (len(summaries) != 1)}, {optimal} proven "
                     f"optimal, {stopped} stopped at the limit")
            if solves - optimal - stopped:
                line += f", {solves - optimal - stopped} other"
        if len(summaries) < len(group):
            missing = len(group) - len(summaries)
            line += ("; " if summaries else "") + f"solve statuses not recorded on {missing} step(s)"
        lines.append(line + ".")
    return "\n".join(lines)


def _percent(record: dict[str, Any] | None, key: str) -> str:
    if record is None or "error" in record:
        return "error" if record else "missing"
    return f"{100 * record['results'][key]:.2f}%"


def _range(values: list[float], unit: str, digits: int) -> str:
    if not values:
        return "-"
    return f"{min(values):.{digits}f}–{max(values):.{digits}f}{unit}"


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
