"""`harts export`: a `harts train` checkpoint as a Hugging Face checkpoint that transformers, vLLM and SGLang run.

`--run` is a run directory (its last checkpoint) or one checkpoint directory; `--out` a new directory that
receives config.json and the safetensors (the Hub layout the model config's hf_layout names: Kimi-Linear
or BailingHybrid, harts.model.hf), shards of at most
`--max-shard-bytes` and their index when the tensors need more than one; `--dtype` fp32 or bf16 (default: the
run's). harts.training.export does the work; each file is written atomically and config.json last, and an output
that is the run, the checkpoint, or a directory that already holds a checkpoint is refused. Tested in
tests/cli/test_export.py.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from harts.args import positive_int

DEFAULT_MAX_SHARD_BYTES = 5_000_000_000
"""harts.model.hf.DEFAULT_MAX_SHARD_BYTES, repeated so that building the parser imports no torch."""


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "export", help="a harts train checkpoint as a Hugging Face (Kimi-Linear or BailingHybrid) checkpoint")
    parser.add_argument("--run", dest="source", required=True, metavar="RUN_OR_CHECKPOINT",
                        help="a harts train run directory (its last checkpoint) or a checkpoint directory")
    parser.add_argument("--out", required=True, help="a new directory for config.json and the safetensors")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                        help="the tensors' dtype (default: the run's; the decay and router tensors stay fp32)")
    parser.add_argument("--max-shard-bytes", type=positive_int, default=DEFAULT_MAX_SHARD_BYTES,
                        help="the largest shard (default 5 GB; one model.safetensors when everything fits)")
    parser.add_argument("--json", action="store_true", help="print a JSON summary")
    parser.set_defaults(run=run_export, files=lambda a: ([a.out], [a.source]))


def run_export(args: argparse.Namespace) -> int:
    from harts.files import check_outputs
    from harts.training.export import export_checkpoint, find_checkpoint

    check_outputs("harts export", [args.out], [find_checkpoint(args.source)])
    checkpoint, files = export_checkpoint(args.source, args.out, dtype=args.dtype,
                                          max_shard_bytes=args.max_shard_bytes)
    summary = {"checkpoint": str(checkpoint), "out": str(args.out), "files": [Path(f).name for f in files],
               "bytes": sum(Path(f).stat().st_size for f in files)}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{checkpoint} -> {args.out}: {len(files)} files, {summary['bytes']:,} bytes")
    return 0
