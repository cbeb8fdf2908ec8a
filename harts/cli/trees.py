"""`harts trees synth|stats|validate|ingest`: make, inspect and check steps (no torch)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from harts.args import index_list, non_negative_int, positive_int
from harts.files import write_text


def register(commands: argparse._SubParsersAction) -> None:
    trees = commands.add_parser("trees", help="generate, ingest, validate and inspect rollout-tree steps")
    sub = trees.add_subparsers(dest="trees_command", required=True, metavar="SUBCOMMAND")

    synth = sub.add_parser("synth", help="generate synthetic SWE-bench-shaped steps")
    synth.add_argument("--config", required=True, help="trees config NAME (configs/trees) or a YAML path")
    synth.add_argument("--seed", type=non_negative_int, default=0)
    synth.add_argument("--steps", type=index_list, default=None, help="comma-separated step indices (default: all)")
    synth.add_argument("--out", required=True, help="output directory (one file per step)")
    synth.add_argument("--format", choices=("npz", "jsonl", "jsonl.gz"), default="npz")
    synth.set_defaults(run=run_synth, files=lambda a: ([Path(a.out) / "synth.json"], [a.config]))

    stats = sub.add_parser("stats", help="print a step's statistics")
    stats.add_argument("path", help="a step: .jsonl, .jsonl.gz, .npz or a directory of them")
    stats.add_argument("--json", action="store_true", help="print one JSON object")
    stats.add_argument("--vocab-size", type=positive_int, default=None)
    stats.set_defaults(run=run_stats)

    validate = sub.add_parser("validate", help="check a step; exit non-zero on the first problem")
    validate.add_argument("path")
    validate.add_argument("--vocab-size", type=positive_int, default=None)
    validate.set_defaults(run=run_validate)

    ingest = sub.add_parser("ingest", help="turn chat-format agent logs into trajectories")
    ingest.add_argument("--format", choices=("messages",), required=True)
    ingest.add_argument("--tokenizer", required=True, help="'byte' or a tokenizer.json file")
    ingest.add_argument("input", help="a .traj/.json/.jsonl(.gz) file or a directory of them")
    ingest.add_argument("output", help="output step: .jsonl, .jsonl.gz or .npz")
    ingest.set_defaults(run=run_ingest, files=lambda a: ([a.output], [a.input]))


def run_synth(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from harts.config import config_to_dict, load_config, shipped_config_path
    from harts.trees.io import write_step
    from harts.trees.synth import SynthConfig, generate_step

    config = load_config(shipped_config_path(args.config, "trees"), SynthConfig)
    steps = args.steps if args.steps is not None else list(range(config.num_steps))
    beyond = [s for s in steps if s >= config.num_steps]
    if beyond:
        raise ValueError(f"{args.config}: step {beyond[0]} is beyond num_steps = {config.num_steps}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for index in tqdm(steps, desc="synth", unit="step", file=sys.stderr, disable=None):
        step = generate_step(config, args.seed, index)
        name = f"step_{index:03d}.{args.format}"
        write_step(step, out / name)
        written.append({
            "index": index, "file": name, "trajectories": step.num_trajectories,
            "semantic_tokens": step.num_semantic_tokens,
        })
    manifest = {"config_file": str(args.config), "config": config_to_dict(config), "seed": args.seed, "steps": written}
    write_text(out / "synth.json", json.dumps(manifest, indent=2) + "\n")
    print(f"wrote {len(written)} step(s) to {out}")
    return 0


def run_stats(args: argparse.Namespace) -> int:
    from harts.trees.io import read_step
    from harts.trees.stats import format_stats, step_stats

    stats = step_stats(read_step(args.path, vocab_size=args.vocab_size))
    print(json.dumps(stats) if args.json else format_stats(stats))
    return 0


def run_validate(args: argparse.Namespace) -> int:
    from harts.trees.io import read_step

    step = read_step(args.path, vocab_size=args.vocab_size)
    print(f"ok: {args.path}: {step.num_trajectories:,} trajectories, {step.num_semantic_tokens:,} tokens")
    return 0


def run_ingest(args: argparse.Namespace) -> int:
    from harts.trees.ingest import ingest_messages, load_tokenizer
    from harts.trees.io import write_step
    from harts.trees.trie import PrefixIndex

    tokenizer = load_tokenizer(args.tokenizer)
    step = ingest_messages(args.input, tokenizer)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_step(step, output)
    compact = PrefixIndex.from_step(step).segment_tree().num_compact_tokens
    print(
        f"wrote {output}: {step.num_trajectories} trajectories, {step.num_semantic_tokens:,} tokens, "
        f"{compact:,} compact (S/C = {step.num_semantic_tokens / compact:.3f}), vocabulary {tokenizer.vocab_size}"
    )
    return 0
