"""`harts plan microbatches PATH --capacity T --dp D --planner NAME [--out plan.json] [--json]`.

Plans a step's microbatches (harts.planning.microbatch), validates the plan (coverage, capacity,
K mod D, works recomputed from the trie) and prints DESIGN §2's metrics: with `--json` one
object with the keys of `PlanMetrics.summary` (imbalances as fractions, 0.0214 = 2.14%), else a
table. `--out` writes the plan as JSON. No torch import.

The options of the treetrain-ortools planner (`add_treetrain_options` / `treetrain_options` of
harts.planning.treetrain: CP-SAT time limit, replica assignment, slot order), shared with `harts bench
planning`, given with another `--planner` are an error here, not ignored.
"""

from __future__ import annotations

import argparse
import json

from harts.args import positive_int
from harts.planning.microbatch import PLANNER_NAMES
from harts.planning.treetrain import add_treetrain_options, treetrain_options


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("microbatches", help="plan a step's microbatches and print the plan's metrics")
    parser.add_argument("path", help="a step: .jsonl, .jsonl.gz, .npz or a directory of them")
    parser.add_argument("--capacity", type=positive_int, required=True, help="T: compact tokens per microbatch")
    parser.add_argument("--dp", type=positive_int, required=True, help="D: data-parallel replicas")
    parser.add_argument("--planner", choices=PLANNER_NAMES, default="harts")
    add_treetrain_options(parser)
    parser.add_argument("--out", help="write the plan as JSON here")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run, files=lambda a: ([a.out], [a.path]))


def run(args: argparse.Namespace) -> int:
    from harts.planning.microbatch import plan, plan_metrics, validate
    from harts.trees.io import read_step
    from harts.trees.trie import PrefixIndex

    options = treetrain_options(args, [args.planner])
    step = read_step(args.path)
    result = plan(step, args.capacity, args.dp, args.planner, **options)
    index = PrefixIndex.from_step(step)
    validate(result, step, index)
    metrics = plan_metrics(result, index.segment_tree().num_compact_tokens, step.num_semantic_tokens)
    if args.out:
        result.write(args.out)
    summary = metrics.summary()
    if args.json:
        print(json.dumps(summary))
        return 0
    rows = [
        ("planner", summary["planner"]),
        ("microbatches", f"{summary['microbatches']:,} ({summary['microbatches'] // args.dp:,} slots of {args.dp})"),
        ("compact tokens", f"{summary['compact_tokens']:,}"),
        ("trie lower bound", f"{summary['lower_bound_compact_tokens']:,}"),
        ("semantic tokens", f"{metrics.semantic_tokens:,}"),
        ("plan seconds", f"{summary['plan_seconds']:.3f}"),
        ("P95 slot imbalance", f"{100 * summary['p95_slot_imbalance']:.2f}%"),
        ("max slot imbalance", f"{100 * metrics.max_slot_imbalance:.2f}%"),
        ("step imbalance", f"{100 * summary['step_imbalance']:.2f}%"),
    ]
    for name, value in rows:
        print(f"{name:<20} {value}")
    if args.out:
        print(f"wrote {args.out}")
    return 0
