"""`harts model`: a model config's parameter counts, in total and active per token.

`--model` is a shipped model config (configs/models) or a YAML path, or `--hf DIR` a Hugging Face checkpoint
directory (its config.json alone); it prints the counts of harts.model.counts.parameter_counts (with `--json`,
one JSON object), and for a model with MTP layers the counts without them too, as model cards count (Ling-3.0-tiny's
7.9B leaves its MTP layer out). Tested in tests/cli/test_model.py.
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
               "head": counts.head, "mtp": counts.mtp, "mtp_active": counts.mtp_active}
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"{config.name} ({config.hf_layout}): {counts.total:,} parameters ({counts.total / 1e9:.2f}B), "
          f"{counts.active:,} active per token ({counts.active / 1e9:.2f}B; "
          f"{counts.active_non_embedding / 1e9:.2f}B without the embedding and the head)")
    if config.mtp is not None:
        decoder = counts.without_mtp
        layers = f"{config.mtp.num_layers} MTP layer{'s' if config.mtp.num_layers > 1 else ''}"
        print(f"without its {layers} ({counts.mtp:,} parameters, {counts.mtp_active:,} active), as model cards "
              f"count: {decoder.total:,} parameters ({decoder.total / 1e9:.2f}B), {decoder.active:,} active per "
              f"token ({decoder.active / 1e9:.2f}B)")
    return 0
