"""`harts model`: a model config's parameter counts, in total and active per token.

`--model` is a shipped model config (configs/models) or a YAML path, or `--hf DIR` a Hugging Face checkpoint
directory (its config.json alone); it prints the counts of harts.model.counts.parameter_counts (with `--json`,
one JSON object). Tested in tests/cli/test_model.py.
"""

from __future__ import annotations

import argparse
import json


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("model", help="a model config's parameter counts (total and active per token)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="configs/models NAME or a YAML path")
    source.add_argument("--hf", metavar="DIR", help="a Hugging Face checkpoint directory (its config.json)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run_model)


def run_model(args: argparse.Namespace) -> int:
    from harts.model.config import load_model_config
    from harts.model.counts import parameter_counts

    if args.hf is not None:
        from harts.model.hf import load_hf_config

        config = load_hf_config(args.hf)
    else:
        config = load_model_config(args.model)
    counts = parameter_counts(config)
    summary = {"model": config.name, "hf_layout": config.hf_layout, "total": counts.total, "active": counts.active,
               "active_non_embedding": counts.active_non_embedding, "embedding": counts.embedding,
               "head": counts.head}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{config.name} ({config.hf_layout}): {counts.total:,} parameters ({counts.total / 1e9:.2f}B), "
              f"{counts.active:,} active per token ({counts.active / 1e9:.2f}B; "
              f"{counts.active_non_embedding / 1e9:.2f}B without the embedding and the head)")
    return 0
