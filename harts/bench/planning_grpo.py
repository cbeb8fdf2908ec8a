"""`harts bench planning-grpo`: the planners' slot tail on GRPO-shaped steps (`harts.trees.synth_grpo`).

Steps: every shape of `--shapes` (`GRPO_SHAPES`) × seed of `--seeds` × step index below `--steps`, at
T = `--capacity` and D = `--dp`. Planners (`--planners`): "harts" (this checkout), "harts-no-tail" (the same with
`HartsConfig.tail` off: the plans of the planner before the slot-tail pass) and "treetrain-ortools" (its options as
in `harts bench planning`); with `--reference REF` also "harts@REF", the HARTS planner of git commit REF of this
checkout: its `harts` package is exported to a temporary folder and run in a worker process (`sys.executable`, the
folder first on its path) that reads each step from a temporary `.npz` and returns the plan and its process CPU
time; the plan is validated here like the others'. So "today's planner" is timed beside the new one in the same run.

Per step, the HARTS planners are run `--repeats` times each, interleaved (reference, harts, harts-no-tail, ...),
each timed by the planner with the step's prefix index built inside (`Plan.plan_seconds`, as `harts bench
planning` reports it), the median kept and every repeat in `plan_seconds_each`, beside the process CPU time of the
call (`plan_cpu_seconds`, median), which other load on the machine inflates less; the OR-Tools planner is run once
(its seconds are its CP-SAT limits). Every plan is validated (coverage, capacity, K mod D, works recomputed from
the trie). One record per (shape, seed, step, planner) with DESIGN §2's metrics, written after every step
(`harts.tracking.records`); a planner that fails gives a record with an `error`.

The table (`grpo_table`, printed and written beside the records as `.md` and `.csv`) has one row per shape and
planner and one per planner over all steps: steps, slots, the nearest-rank P95 and the mean of the per-slot
imbalance over every slot of those steps, the largest and mean step imbalance, Σ compact tokens and their ratio to
the first planner's, and the mean and nearest-rank P95 over steps of the plan seconds and CPU seconds, each also
as a ratio to the first planner's (ratios of the sums for tokens, of the means for times).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from harts.args import index_list, name_list, positive_int, records_file
from harts.extras import require
from harts.files import atomic_open, write_text

logger = logging.getLogger(__name__)

PLANNERS = ("harts", "harts-no-tail", "treetrain-ortools")
"""Planners this bench runs in-process; `--reference` adds harts@REF."""

# The worker of `--reference`: run with the reference's `harts` first on the path, one JSON request per line.
_WORKER = r"""
import json, sys, time
import harts
from harts.planning.microbatch import plan
from harts.trees.io import read_step
print(json.dumps({"harts": harts.__file__}), flush=True)
for line in sys.stdin:
    request = json.loads(line)
    step = read_step(request["path"])
    cpu = time.process_time()
    result = plan(step, request["capacity"], request["dp"], "harts")
    cpu = time.process_time() - cpu
    print(json.dumps({"plan": result.to_dict(), "cpu_seconds": cpu}), flush=True)
"""


def register(commands: argparse._SubParsersAction) -> None:
    from harts.planning.treetrain import add_treetrain_options
    from harts.trees.synth_grpo import GRPO_SHAPES

    parser = commands.add_parser("planning-grpo", help="the planners' slot imbalance tail on GRPO-shaped steps")
    parser.add_argument("--shapes", type=name_list(tuple(GRPO_SHAPES)), default=list(GRPO_SHAPES),
                        help=f"comma-separated GRPO shapes ({', '.join(GRPO_SHAPES)}; default all)")
    parser.add_argument("--seeds", type=index_list, default=[100, 101, 102, 103],
                        help="comma-separated seeds (default 100-103, held out: the tail pass was tuned on 0-1)")
    parser.add_argument("--steps", type=positive_int, default=17, help="steps per shape and seed (default 17)")
    parser.add_argument("--groups", type=positive_int, default=None, help="groups per step (default: the shape's)")
    parser.add_argument("--capacity", type=positive_int, default=8192, help="T (default 8,192)")
    parser.add_argument("--dp", type=positive_int, default=4, help="D (default 4)")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="runs of each HARTS planner per step, interleaved; seconds are medians")
    parser.add_argument("--planners", type=name_list(PLANNERS), default=list(PLANNERS),
                        help=f"comma-separated, the first is the table's reference for ratios ({', '.join(PLANNERS)})")
    parser.add_argument("--reference", default=None,
                        help="also plan with the HARTS planner of this git commit (first in the table)")
    add_treetrain_options(parser)
    parser.add_argument("--out", type=records_file, default="reports/raw/planning/planning-grpo.json",
                        help="records (.json or .jsonl); the table goes beside it as .md and .csv")
    parser.set_defaults(run=run, files=lambda a: (
        [a.out, *(Path(a.out).with_suffix(suffix) for suffix in (".md", ".csv"))], []))


class ReferencePlanner:
    """The HARTS planner of git commit `ref` of this checkout, in a worker process (module docstring)."""

    def __init__(self, ref: str, folder: Path) -> None:
        root = Path(__file__).resolve().parents[2]
        source = folder / "source"
        source.mkdir()
        try:
            archive = subprocess.run(["git", "-C", str(root), "archive", ref, "harts"], capture_output=True,
                                     check=True, timeout=120).stdout
            subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as error:
            detail = getattr(error, "stderr", b"") or b""
            raise ValueError(f"--reference {ref}: cannot export harts/ of that commit from {root} "
                             f"({detail.decode(errors='replace').strip() or error})") from None
        self.name = f"harts@{ref}"
        self.step_path = folder / "step.npz"
        self.process = subprocess.Popen([sys.executable, "-c", _WORKER], cwd=source, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        started = json.loads(self._read())
        if not str(started["harts"]).startswith(str(source)):
            raise ValueError(f"--reference {ref}: the worker imported {started['harts']}, not the exported commit")

    def _read(self) -> str:
        line = self.process.stdout.readline()
        if not line:
            raise ValueError(f"{self.name}: the worker process stopped (exit status {self.process.wait()})")
        return line

    def load(self, step) -> None:
        from harts.trees.io import write_step

        write_step(step, self.step_path)

    def plan(self, capacity: int, dp: int):
        from harts.planning.plans import Plan

        self.process.stdin.write(json.dumps({"path": str(self.step_path), "capacity": capacity, "dp": dp}) + "\n")
        self.process.stdin.flush()
        reply = json.loads(self._read())
        return Plan.from_dict(reply["plan"], self.name), reply["cpu_seconds"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def run(args: argparse.Namespace) -> int:
    from harts.config import config_to_dict
    from harts.planning.microbatch import plan, plan_metrics, validate
    from harts.planning.treetrain import treetrain_options as planner_options
    from harts.tracking.records import make_record, write_records
    from harts.trees.synth_grpo import GRPO_SHAPES, generate_grpo_step
    from harts.trees.trie import PrefixIndex

    options = planner_options(args, args.planners)
    shapes = {name: GRPO_SHAPES[name] if args.groups is None else replace(GRPO_SHAPES[name], num_groups=args.groups)
              for name in args.shapes}
    if "treetrain-ortools" in args.planners:
        # Import CP-SAT before timing: its import would otherwise count in the first step's plan.
        require("ortools.sat.python.cp_model", "the treetrain-ortools planner")
    out = Path(args.out)
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="harts-planning-grpo-") as folder:
        reference = ReferencePlanner(args.reference, Path(folder)) if args.reference else None
        names = ([reference.name] if reference else []) + args.planners
        try:
            for shape in args.shapes:
                for seed in args.seeds:
                    for step_index in range(args.steps):
                        step = generate_grpo_step(shapes[shape], seed, step_index)
                        index = PrefixIndex.from_step(step)
                        if reference:
                            reference.load(step)
                        runs: dict[str, list] = {name: [] for name in names}
                        errors: dict[str, str] = {}
                        for repeat in range(args.repeats):
                            for name in names:
                                if name in errors or (name == "treetrain-ortools" and repeat):
                                    continue
                                try:
                                    if reference and name == reference.name:
                                        result, cpu_seconds = reference.plan(args.capacity, args.dp)
                                    else:
                                        cpu_started = time.process_time()
                                        result = plan(step, args.capacity, args.dp, _planner(name),
                                                      **_options(name, options))
                                        cpu_seconds = time.process_time() - cpu_started
                                    validate(result, step, index)
                                except ValueError as error:
                                    errors[name] = str(error)
                                    continue
                                runs[name].append((result, cpu_seconds))
                        lower_bound = index.segment_tree().num_compact_tokens
                        for name in names:
                            config = {"shape": shape, "grpo": config_to_dict(shapes[shape]), "seed": seed,
                                      "step": step_index, "capacity": args.capacity, "dp": args.dp, "planner": name,
                                      "options": _options(name, options), "repeats": len(runs[name]) or 1}
                            if name in errors:
                                records.append(make_record("planning-grpo", config, error=errors[name]))
                                continue
                            records.append(make_record("planning-grpo", config,
                                                       _results(step, runs[name], lower_bound, plan_metrics)))
                        write_records(records, out)
                        logger.info(f"{shape} seed {seed} step {step_index}: " + ", ".join(
                            f"{name} {_step_summary(r)}" for name, r in zip(names, records[-len(names):])))
        finally:
            if reference:
                reference.close()
    header, rows = grpo_table(records, names)
    markdown = _markdown(header, rows)
    hardware = records[0]["environment"]["hardware"] if records else {}
    note = (f"T = {args.capacity:,}, D = {args.dp}; shapes {', '.join(args.shapes)}; seeds "
            f"{', '.join(map(str, args.seeds))}; {args.steps} steps each; {hardware.get('cpu', '?')}, "
            f"{hardware.get('cpu_count', '?')} CPUs; HARTS planners {args.repeats} runs per step (median), "
            f"OR-Tools one{'; ' + json.dumps(options) if options else ''}.")
    same = same_plans_note(records, names)
    note += "\n" + same if same else ""
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
        config = record["config"]
        logger.error(f"{config['shape']} seed {config['seed']} step {config['step']} {config['planner']}: "
                     f"{record['error']}")
    return 1 if failed else 0


def _planner(name: str) -> str:
    return "harts" if name == "harts-no-tail" else name


def _options(name: str, treetrain: dict[str, object]) -> dict[str, object]:
    if name == "harts-no-tail":
        return {"tail": False}
    return dict(treetrain) if name == "treetrain-ortools" else {}


def _results(step, runs: list, lower_bound: int, plan_metrics) -> dict[str, Any]:
    first = runs[0][0]
    metrics = plan_metrics(first, lower_bound, step.num_semantic_tokens)
    return {
        "trajectories": step.num_trajectories,
        "semantic_tokens": step.num_semantic_tokens,
        "lower_bound_compact_tokens": lower_bound,
        "compact_tokens": metrics.compact_tokens,
        "microbatches": metrics.num_microbatches,
        "plan_seconds": statistics.median(r.plan_seconds for r, _ in runs),
        "plan_seconds_each": [r.plan_seconds for r, _ in runs],
        "plan_cpu_seconds": statistics.median(cpu for _, cpu in runs),
        "plan_cpu_seconds_each": [cpu for _, cpu in runs],
        "slot_imbalance": metrics.slot_imbalance,
        "p95_slot_imbalance": metrics.p95_slot_imbalance,
        "max_slot_imbalance": metrics.max_slot_imbalance,
        "step_imbalance": metrics.step_imbalance,
        "critical_path": metrics.critical_path,
        "max_replica_work": metrics.max_replica_work,
        "details": first.details,
        "identical_plans": all(r.microbatches == first.microbatches for r, _ in runs),
        "plan_digest": plan_digest(first),
    }


def plan_digest(result) -> str:
    """sha1 of the plan's microbatches (members, in plan order): equal digests are equal plans."""
    return hashlib.sha1(json.dumps([list(mb.trajectory_ids) for mb in result.microbatches]).encode()).hexdigest()


def same_plans_note(records: list[dict[str, Any]], planners: list[str]) -> str:
    """On how many steps each planner's plan equals the first planner's (their `plan_digest`)."""
    digests: dict[str, dict[tuple, str]] = {}
    for r in records:
        if "error" not in r:
            digests.setdefault(r["config"]["planner"], {})[_step_key(r)] = r["results"]["plan_digest"]
    first = digests.get(planners[0], {})
    parts = []
    for name in planners[1:]:
        common = set(first) & set(digests.get(name, {}))
        same = sum(first[key] == digests[name][key] for key in common)
        parts.append(f"{name} {same} of {len(common)}")
    return f"Steps whose plan equals {planners[0]}'s: " + "; ".join(parts) + "." if parts else ""


def _step_summary(record: dict[str, Any]) -> str:
    if "error" in record:
        return "error"
    results = record["results"]
    return f"max slot {100 * results['max_slot_imbalance']:.2f}% {results['plan_seconds']:.2f} s"


def grpo_table(records: list[dict[str, Any]], planners: list[str]) -> tuple[list[str], list[list[str]]]:
    """Header and rows: per shape and planner, then per planner over all shapes (module docstring); ratios are
    to planners[0] on the same steps."""
    import numpy as np

    from harts.planning.microbatch import nearest_rank

    done = [r for r in records if "error" not in r]
    shapes = list(dict.fromkeys(r["config"]["shape"] for r in done))
    header = ["shape", "planner", "steps", "slots", "P95 slot imb.", "mean slot imb.", "max step imb.",
              "mean step imb.", "compact tokens", "tokens vs first", "mean s", "P95 s", "mean s vs first",
              "mean CPU s", "P95 CPU s", "mean CPU s vs first"]
    rows = []
    for shape in [*shapes, "all"]:
        chosen = [r for r in done if shape in ("all", r["config"]["shape"])]
        steps = {name: {_step_key(r): r["results"] for r in chosen if r["config"]["planner"] == name}
                 for name in planners}
        # Every planner over the steps all of them planned, so that the ratios compare like with like.
        common = set.intersection(*(set(by_step) for by_step in steps.values())) if steps else set()
        first = [steps[planners[0]][key] for key in sorted(common)]
        for name in planners:
            mine = [steps[name][key] for key in sorted(common)]
            if not mine:
                continue
            slots = np.concatenate([m["slot_imbalance"] for m in mine])
            step_imbalance = np.asarray([m["step_imbalance"] for m in mine])
            tokens = sum(m["compact_tokens"] for m in mine)
            seconds = np.asarray([m["plan_seconds"] for m in mine])
            cpu = np.asarray([m["plan_cpu_seconds"] for m in mine])
            first_tokens = sum(m["compact_tokens"] for m in first)
            first_seconds = np.mean([m["plan_seconds"] for m in first])
            first_cpu = np.mean([m["plan_cpu_seconds"] for m in first])
            rows.append([
                shape, name, str(len(mine)), str(len(slots)),
                f"{100 * nearest_rank(slots, 95):.2f}%", f"{100 * slots.mean():.2f}%",
                f"{100 * step_imbalance.max():.2f}%", f"{100 * step_imbalance.mean():.3f}%",
                f"{tokens:,}", f"{tokens / first_tokens:.4f}", f"{seconds.mean():.3f}",
                f"{nearest_rank(seconds, 95):.3f}", f"{seconds.mean() / first_seconds:.3f}", f"{cpu.mean():.3f}",
                f"{nearest_rank(cpu, 95):.3f}", f"{cpu.mean() / first_cpu:.3f}",
            ])
    return header, rows


def _step_key(record: dict[str, Any]) -> tuple[str, int, int]:
    config = record["config"]
    return config["shape"], config["seed"], config["step"]


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
