"""`harts plan kda PATH --chunk B [--json] [--no-replay]`: the linear-attention call plan of a step.

Treats all the step's trajectories as one microbatch: builds their segment tree and plans the
fewest KDA calls (harts.planning.kda_calls). Prints `SUMMARY_KEYS` (JSON with --json, else a
table with a line per call). No torch import.
"""

from __future__ import annotations

import argparse
import json

from harts.args import positive_int

SUMMARY_KEYS = ("calls", "sequences", "replay_tokens", "compact_tokens", "semantic_tokens")


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("kda", help="plan the linear-attention calls of a step taken as one microbatch")
    parser.add_argument("path", help="a step: .jsonl, .jsonl.gz, .npz or a directory of them")
    parser.add_argument("--chunk", type=positive_int, required=True,
                        help="chunk size B of the chunked kernel (64 in fla)")
    parser.add_argument("--no-replay", action="store_true",
                        help="the ablation: side branches start at the fork from the exact state, no replay")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from harts.planning.kda_calls import plan_kda_calls
    from harts.trees.io import read_step
    from harts.trees.trie import PrefixIndex

    step = read_step(args.path)
    tree = PrefixIndex.from_step(step).segment_tree()
    schedule = plan_kda_calls(tree, args.chunk, replay=not args.no_replay)
    summary = {
        "calls": schedule.num_calls,
        "sequences": schedule.num_sequences,
        "replay_tokens": schedule.replay_tokens,
        "compact_tokens": tree.num_compact_tokens,
        "semantic_tokens": tree.num_semantic_tokens,
    }
    if args.json:
        print(json.dumps(summary))
        return 0
    for key in SUMMARY_KEYS:
        print(f"{key:<16} {summary[key]:,}")
    print(f"{'call':>4} {'sequences':>10} {'rows':>12} {'replay':>10} {'boundaries':>11} {'max handoff':>12}")
    for r, call in enumerate(schedule.calls):
        print(
            f"{r:>4} {call.num_sequences:>10,} {call.num_rows:>12,} {int(call.is_replay.sum()):>10,} "
            f"{len(call.boundary_offsets):>11,} {int(call.handoff_depth.max()):>12}"
        )
    return 0
