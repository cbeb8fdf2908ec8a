"""`harts bench kda-calls`: wall time of the linear-attention call planner on a large random tree.

`random_segment_tree(num_segments, max_length, seed)` builds a segment tree of exactly
`num_segments` segments directly in preorder, without tokens. Shape: a random walk over depth in
preorder — each next segment is a child of the previous one with probability 1/2, else a child of
an ancestor at a uniformly chosen depth 0..d−1 of the current depth d. At 1M segments: mean depth
3.0, maximum 25, maximum fork depth 11; half the segments are leaves, 35% single-child (a
trajectory ends there, as in a real trie), 15% forks; a fork other than the root has 2.6 children
on average, the root about a quarter of all segments (like tasks under a shared system prompt).
Segment lengths are uniform on 1..max_length (default B), so forks fall at every chunk phase. The
generator is tested against the trie built from the same tree's tokens.

Records, per mode (replay and the no-replay ablation), the median and all repeats of (a) planning
only: T_pre/T_in bottom-up and the minimum call count (`min_calls`), and (b) planning plus
materialising the schedule arrays (`plan_kda_calls`). Before timing, a small tree from the same
generator is checked with `validate_schedule` and against the naive planner, and every large
schedule's call count, replay total and row coverage are checked; a failure is a record with an
`error` field and no timings.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from harts.args import non_negative_int, positive_int, records_file
from harts.tracking import wandb_log

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from harts.trees.trie import SegmentTree


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("kda-calls", help="time the KDA call planner on a large random segment tree")
    parser.add_argument("--segments", type=positive_int, default=1_000_000)
    parser.add_argument("--chunk", type=positive_int, default=64, help="chunk size B")
    parser.add_argument("--max-length", type=positive_int, default=None,
                        help="segment lengths are uniform on 1..this (default B)")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--out", type=records_file, default="reports/raw/planning/kda_calls.json")
    wandb_log.add_arguments(parser)
    parser.set_defaults(run=run, files=lambda a: ([a.out], []))


def random_segment_tree(num_segments: int, max_length: int, seed: int) -> SegmentTree:
    """A random tree of `num_segments` segments in preorder (shape in the module docstring)."""
    import numpy as np

    from harts.trees.trie import SegmentTree

    if num_segments < 1 or max_length < 1:
        raise ValueError(f"need num_segments >= 1 and max_length >= 1, got {num_segments} and {max_length}")
    rng = np.random.default_rng(seed)
    deeper = (rng.random(num_segments) < 0.5).tolist()
    back = rng.random(num_segments).tolist()
    depth_list = [0] * num_segments
    d = 0
    for i in range(1, num_segments):
        d = d + 1 if deeper[i] else 1 + int(back[i] * d)
        depth_list[i] = d
    depth = np.asarray(depth_list, dtype=np.int64)
    lengths = rng.integers(1, max_length + 1, num_segments)

    # In preorder a segment's parent is the last segment before it one level up, and its
    # subtree ends at the next segment at its level or above.
    ids = np.arange(num_segments, dtype=np.int64)
    parent = np.full(num_segments, -1, dtype=np.int64)
    start = np.zeros(num_segments, dtype=np.int64)
    subtree_end = np.full(num_segments, num_segments, dtype=np.int64)
    by_level = [ids[depth == level] for level in range(int(depth.max()) + 1)]
    for level in range(1, len(by_level)):
        above = by_level[level - 1]
        nodes = by_level[level]
        parent[nodes] = above[np.searchsorted(above, nodes) - 1]
        start[nodes] = start[parent[nodes]] + lengths[parent[nodes]]
    for level, nodes in enumerate(by_level):
        stops = np.flatnonzero(depth <= level)
        after = np.searchsorted(stops, nodes, side="right")
        subtree_end[nodes] = np.where(after < len(stops), stops[np.minimum(after, len(stops) - 1)], num_segments)
    compact_start = np.zeros(num_segments, dtype=np.int64)
    np.cumsum(lengths[:-1], out=compact_start[1:])
    num_children = np.bincount(parent[1:], minlength=num_segments).astype(np.int64)
    end_segment = np.flatnonzero(num_children <= 1)
    num_members = len(end_segment)
    return SegmentTree(
        members=np.arange(num_members, dtype=np.int64),
        member_lengths=start[end_segment] + lengths[end_segment],
        sorted_position=np.arange(num_members, dtype=np.int64),
        parent=parent,
        start=start,
        end=start + lengths,
        compact_start=compact_start,
        subtree_end=subtree_end,
        num_children=num_children,
        end_segment=end_segment,
    )


def _check(chunk: int, seed: int, replay: bool) -> None:
    """Validate the fast planner on a small tree of the same shape; raise AssertionError if wrong."""
    import numpy as np

    from harts.planning.kda_calls import compact_parent_row, naive_plan_kda_calls, plan_kda_calls
    from harts.planning.kda_schedule import validate_schedule

    tree = random_segment_tree(3000, 2 * chunk, seed + 1)
    schedule = plan_kda_calls(tree, chunk, replay=replay)
    validate_schedule(schedule, tree.compact_positions(), compact_parent_row(tree))
    reference = naive_plan_kda_calls(tree, chunk, replay=replay)
    assert schedule.num_calls == reference.num_calls
    for call, expected in zip(schedule.calls, reference.calls):
        assert np.array_equal(call.rows, expected.rows) and np.array_equal(call.is_replay, expected.is_replay)
        assert np.array_equal(call.initial_source, expected.initial_source)


def _time_mode(tree: SegmentTree, chunk: int, replay: bool, repeats: int) -> dict:
    import numpy as np
    from tqdm import tqdm

    from harts.planning.kda_calls import forced_replay, min_calls, plan_kda_calls

    plan_seconds, schedule_seconds = [], []
    mode = "replay" if replay else "no-replay"
    for _ in tqdm(range(repeats), desc=f"kda-calls {mode}", unit="repeat", file=sys.stderr, disable=None):
        begin = time.perf_counter()
        num_calls = min_calls(tree, chunk, replay=replay)
        plan_seconds.append(time.perf_counter() - begin)
        begin = time.perf_counter()
        schedule = plan_kda_calls(tree, chunk, replay=replay)
        schedule_seconds.append(time.perf_counter() - begin)
        computed = np.concatenate([call.rows[~call.is_replay] for call in schedule.calls])
        assert schedule.num_calls == num_calls
        assert schedule.replay_tokens == (forced_replay(tree, chunk) if replay else 0)
        assert len(computed) == tree.num_compact_tokens and (np.bincount(computed) == 1).all()
        summary = {
            "calls": schedule.num_calls,
            "sequences": schedule.num_sequences,
            "replay_tokens": schedule.replay_tokens,
            "packed_rows": sum(call.num_rows for call in schedule.calls),
        }
        del schedule, computed
    return {
        "plan_seconds_median": statistics.median(plan_seconds),
        "plan_seconds": plan_seconds,
        "plan_and_schedule_seconds_median": statistics.median(schedule_seconds),
        "plan_and_schedule_seconds": schedule_seconds,
        **summary,
    }


def run(args: argparse.Namespace) -> int:
    from harts.tracking.records import make_record, write_records
    from harts.tracking.wandb_log import log_records, options

    logger.info(f"generating a random tree of {args.segments:,} segments ...")
    max_length = args.max_length or args.chunk
    tree = random_segment_tree(args.segments, max_length, args.seed)
    config = {
        "segments": args.segments, "chunk_size": args.chunk, "max_length": max_length, "seed": args.seed,
        "repeats": args.repeats,
        "shape": "preorder depth random walk: child of the previous segment w.p. 1/2, else of a uniform "
                 "ancestor depth; lengths uniform 1..max_length; trajectory ends at leaves and single-child segments",
    }
    shape = {
        "segments": tree.num_segments,
        "compact_tokens": tree.num_compact_tokens,
        "leaves": int((tree.num_children == 0).sum()),
        "forks": int((tree.num_children >= 2).sum()),
        "max_depth": int(tree.depth().max()),
        "max_fork_depth": int(tree.fork_depth().max()),
    }
    records = []
    for replay in (True, False):
        mode_config = {**config, "replay": replay}
        try:
            _check(args.chunk, args.seed, replay)
            results = {**shape, **_time_mode(tree, args.chunk, replay, args.repeats)}
        except AssertionError as error:
            records.append(make_record("kda-calls", mode_config, error=f"correctness check failed: {error!r}"))
            logger.info(f"{'replay' if replay else 'no-replay'}: correctness check failed, no timing")
            continue
        records.append(make_record("kda-calls", mode_config, results))
        print(
            f"{'replay' if replay else 'no-replay'}: {shape['segments']:,} segments, C = {shape['compact_tokens']:,}: "
            f"{results['calls']} calls, {results['sequences']:,} sequences, {results['replay_tokens']:,} replay rows; "
            f"plan {results['plan_seconds_median']:.3f} s, plan + schedule "
            f"{results['plan_and_schedule_seconds_median']:.3f} s (median of {args.repeats})"
        )
    write_records(records, Path(args.out))
    print(f"wrote {args.out} ({records[0]['environment']['hardware']['cpu']})")
    log_records(records, options(args))
    return 0 if all("error" not in r for r in records) else 1
