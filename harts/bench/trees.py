"""`harts bench trees`: time and memory of building a step's prefix structures.

Builds, for one step, everything `harts.trees` derives from the tokens: the lexicographic order,
the adjacent-LCP array with its sparse table, the segment tree, the compact map m (int64 [S])
and the multiplicity q. Records the median wall time over `--repeats` builds and the peak
memory allocated during one build (tracemalloc, which sees numpy's buffers), as a multiple of
the token array's size. The step is generated from a trees config or read from a file.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import tracemalloc
from pathlib import Path

from harts.args import non_negative_int, positive_int, records_file
from harts.tracking import wandb_log

logger = logging.getLogger(__name__)


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("trees", help="time and memory of building a step's trie and compact map")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trees", help="trees config NAME or YAML path (generate the step)")
    source.add_argument("--data", help="a step file or directory")
    parser.add_argument("--step", type=non_negative_int, default=0, help="step index to generate (with --trees)")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--out", type=records_file, default="reports/raw/trees/build.json")
    wandb_log.add_arguments(parser)
    parser.set_defaults(run=run, files=lambda a: ([a.out], [a.trees, a.data]))


def build(step):
    from harts.trees.trie import PrefixIndex

    index = PrefixIndex.from_step(step)
    tree = index.segment_tree()
    compact_map = tree.compact_map()
    multiplicity = tree.multiplicity()
    return tree, compact_map, multiplicity


def run(args: argparse.Namespace) -> int:
    from harts.config import config_to_dict, load_config, shipped_config_path
    from harts.tracking.records import make_record, write_records
    from harts.tracking.wandb_log import log_records, options
    from harts.trees.io import read_step
    from harts.trees.synth import SynthConfig, generate_step

    if args.trees:
        synth = load_config(shipped_config_path(args.trees, "trees"), SynthConfig)
        logger.info(f"generating step {args.step} of {args.trees} ...")
        step = generate_step(synth, args.seed, args.step)
        config = {"trees": args.trees, "synth": config_to_dict(synth), "seed": args.seed, "step": args.step}
    else:
        step = read_step(args.data)
        config = {"data": str(args.data)}
    config["repeats"] = args.repeats

    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        tree, compact_map, multiplicity = build(step)
        times.append(time.perf_counter() - start)
        del compact_map, multiplicity
    tracemalloc.start()
    tracemalloc.reset_peak()
    tree, compact_map, multiplicity = build(step)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert int(multiplicity.sum()) == step.num_semantic_tokens

    results = {
        "trajectories": step.num_trajectories,
        "semantic_tokens": step.num_semantic_tokens,
        "compact_tokens": tree.num_compact_tokens,
        "segments": tree.num_segments,
        "build_seconds_median": statistics.median(times),
        "build_seconds": times,
        "token_array_bytes": int(step.tokens.nbytes),
        "peak_build_bytes": int(peak),
        "peak_over_token_array": peak / step.tokens.nbytes,
    }
    record = make_record("trees-build", config, results)
    write_records([record], Path(args.out))
    print(
        f"{step.num_trajectories:,} trajectories, S = {step.num_semantic_tokens:,}, C = {tree.num_compact_tokens:,}: "
        f"build {results['build_seconds_median']:.2f} s (median of {args.repeats}), peak "
        f"{peak / 2**20:,.0f} MiB = {results['peak_over_token_array']:.2f}x the token array "
        f"({step.tokens.nbytes / 2**20:,.0f} MiB) on {record['environment']['hardware']['cpu']}; wrote {args.out}"
    )
    log_records([record], options(args))
    return 0
