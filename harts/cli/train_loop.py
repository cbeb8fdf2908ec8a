"""`harts train`: optimizer steps over a sequence of RL steps, with checkpoints and exact resume.

The configuration is one YAML file (`--config`, read strictly into
harts.training.config.TrainConfig) whose keys the flags below override; without `--config` the
flags alone (at least `--model` and `--trees`) make it, and with `--resume` the checkpoint's
config is the base (or, before the first checkpoint, the config of the log's first start). The run
directory `--out` receives train.jsonl and checkpoints/ (harts.training.checkpoint). `--init-from DIR`
starts from a Hugging Face checkpoint (Kimi-Linear or BailingHybrid, harts.model.hf) whose config.json is the model
config, instead of `--model` and a random initialisation (`harts export` is the way back). `--resume`
continues from the last checkpoint (or from step 0 when there is none) and refuses a config that
differs from it or from the run's first start, and data steps whose content changed unless
`--accept-changed-data`; `--max-steps N` stops after step N with a checkpoint there. Tested in
tests/cli/test_train_loop.py.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from harts.args import LOSS_OPTIONS, LOSS_SECTION_OPTIONS, loss_flag, non_negative_int, positive_int
from harts.config import execution
from harts.tracking import wandb_log

logger = logging.getLogger(__name__)

# (flag, dotted config key, argparse keywords); loss options go to the chosen loss's section.
OVERRIDES = [
    ("--model", "model", {"help": "configs/models NAME or a YAML path"}),
    ("--init-from", "init_from", {"help": "start from this Hugging Face checkpoint (Kimi-Linear or BailingHybrid) "
                                          "instead of a random initialisation; its config.json is the model config "
                                          "(no --model)"}),
    ("--trees", "data.trees", {"help": "a trees config (NAME or YAML), a directory of step_NNN files, or one step"}),
    ("--data-seed", "data.seed", {"type": non_negative_int, "help": "seed of generated steps"}),
    ("--on-policy", "data.on_policy", {"action": argparse.BooleanOptionalAction,
                                       "help": "ignore the steps' old log-probs (ratio 1)"}),
    ("--shuffle", "data.shuffle", {"action": argparse.BooleanOptionalAction,
                                   "help": "visit each epoch's data steps in a random order"}),
    ("--num-steps", "num_steps", {"type": positive_int, "help": "optimizer steps (default: one pass over the data)"}),
    ("--seed", "seed", {"type": non_negative_int, "help": "weight initialisation and RNG seed"}),
    ("--device", "device", {"choices": execution.DEVICES}),
    ("--dtype", "dtype", {"choices": execution.DTYPES,
                          "help": "bf16: bf16 parameters, fp32 master weights, bf16 autocast (default on CUDA)"}),
    ("--loss", "loss.name", {"choices": ("grpo", "ppo")}),
    ("--lr", "optimizer.lr", {"type": float, "help": "peak learning rate"}),
    ("--weight-decay", "optimizer.weight_decay", {"type": float}),
    ("--max-grad-norm", "optimizer.max_grad_norm", {"type": float, "help": "0 = no clipping"}),
    ("--warmup-steps", "schedule.warmup_steps", {"type": non_negative_int}),
    ("--schedule", "schedule.decay", {"choices": ("constant", "cosine"), "help": "decay after the warm-up"}),
    ("--min-lr-ratio", "schedule.min_lr_ratio", {"type": float, "help": "cosine's floor / peak"}),
    ("--checkpoint-every", "checkpoint.every", {"type": non_negative_int,
                                                "help": "save every K steps (0: only the last)"}),
]
LOSS_OVERRIDES = [(loss_flag(field), field, {**keywords, "help": keywords["help"] if len(losses) == 2
                                              else f"GRPO only: {keywords['help']}"})
                  for field, losses, keywords in LOSS_OPTIONS]
"""The loss fields' flags (harts.args.LOSS_OPTIONS), set under the config's loss.name."""
EXECUTION_OVERRIDES = [(option, f"execution.{name}", {**keywords, **(
    {"type": execution.auto_or_blocks_count} if name == "recompute_blocks" else {})})
                       for name in execution.FIELDS if name != "dtype"
                       for option, keywords in [execution.argument(name, default=False, negatable=True)]]
"""Every execution knob's flag (harts.config.execution; --dtype is the run's; --recompute-blocks also takes auto)."""
LOSS_SECTION_OVERRIDES = [(loss_flag(field), f"loss.{field}", keywords) for field, keywords in LOSS_SECTION_OPTIONS]
"""The loss section's own fields' flags (harts.args.LOSS_SECTION_OPTIONS: --pooled-balance-coeff), whatever the loss."""
OVERRIDES += EXECUTION_OVERRIDES + LOSS_SECTION_OVERRIDES


def _destination(flag: str) -> str:
    return "override_" + flag.removeprefix("--").replace("-", "_")


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("train", help="train for N steps with checkpoints and exact resume")
    parser.add_argument("--config", default=None, help="training config YAML (harts.training.config.TrainConfig)")
    parser.add_argument("--out", required=True, help="run directory: train.jsonl and checkpoints/")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out from its last checkpoint (from step 0 if it has none)")
    parser.add_argument("--accept-changed-data", action="store_true",
                        help="with --resume: continue although the data steps' content changed since the checkpoint")
    parser.add_argument("--max-steps", type=positive_int, default=None,
                        help="stop after this step (with a checkpoint), to continue later with --resume")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print a JSON summary")
    parser.add_argument("--wandb", action="store_true",
                        help="log every step to W&B (offline unless WANDB_MODE or WANDB_API_KEY say otherwise; "
                             "implied by any --wandb-* flag)")
    wandb_log.add_arguments(parser)
    parser.add_argument("--preset", choices=tuple(execution.PRESETS), default=None,
                        help="a named setting of several execution knobs (harts.config.execution.PRESETS) over the "
                             "config's; the flags given beside it win")
    for flag, _, keywords in OVERRIDES + LOSS_OVERRIDES:
        if "action" not in keywords and "choices" not in keywords:
            keywords = {"metavar": flag.removeprefix("--").replace("-", "_").upper(), **keywords}
        parser.add_argument(flag, dest=_destination(flag), default=None, **keywords)
    parser.set_defaults(run=run_train,
                        files=lambda a: ([Path(a.out) / "train.jsonl"], [a.config]))


def build_config(args: argparse.Namespace):
    """The TrainConfig of the command: --config (or the checkpoint's with --resume, or nothing) plus flags."""
    from harts.config import load_yaml_mapping
    from harts.training.checkpoint import latest_checkpoint, read_metadata
    from harts.training.config import set_dotted, train_config_from_dict
    from harts.training.loop import LOG_NAME, first_start_record

    log = Path(args.out) / LOG_NAME
    if args.config is not None:
        data, where = load_yaml_mapping(args.config), args.config
    elif args.resume and (checkpoint := latest_checkpoint(args.out)) is not None:
        data, where = read_metadata(checkpoint)[1]["train"], str(checkpoint / "config.json")
    elif args.resume and (first := first_start_record(log)) is not None:
        data, where = first["config"]["train"], f"{log} (the first start record)"
    else:
        data, where = {}, "command line"
    for name, value in execution.PRESETS[args.preset].items() if args.preset else ():
        set_dotted(data, "dtype" if name == "dtype" else f"execution.{name}", value, where)
    for flag, key, _ in OVERRIDES:
        value = getattr(args, _destination(flag))
        if value is not None:
            set_dotted(data, key, value, where)
    section = data.get("loss", {})
    loss = section.get("name", "grpo") if isinstance(section, dict) else "grpo"
    for flag, key, _ in LOSS_OVERRIDES:
        value = getattr(args, _destination(flag))
        if value is None:
            continue
        losses = next(losses for field, losses, _ in LOSS_OPTIONS if field == key)
        if loss not in losses:
            raise ValueError(f"harts train: {flag} applies to the {' and '.join(losses)} loss, not {loss!r}")
        set_dotted(data, f"loss.{loss}.{key}", value, where)
    if where == "command line" and not (("model" in data or "init_from" in data) and "trees" in data.get("data", {})):
        if args.resume:
            raise ValueError(f"harts train --resume: {args.out} holds no run to resume (no checkpoint, no start "
                             f"record in {LOG_NAME}); give --config FILE, or --model and --trees, to start one")
        raise ValueError("harts train: give --config FILE, or --model and --trees (or --init-from DIR and --trees)")
    return train_config_from_dict(data, where)


def run_train(args: argparse.Namespace) -> int:
    from harts.files import check_outputs
    from harts.training.loop import LOG_NAME, train

    config = build_config(args)
    # The data path is known only now (a flag, the config file's, or the checkpoint's on --resume).
    check_outputs("harts train", [Path(args.out) / LOG_NAME], [config.data.trees], read_whole=True)
    if config.init_from is not None and Path(args.out).resolve() == Path(config.init_from).resolve():
        raise ValueError(f"harts train: --out {args.out} is the checkpoint it starts from (--init-from); "
                         "train into another directory")
    if args.accept_changed_data and not args.resume:
        raise ValueError("harts train: --accept-changed-data applies to --resume")
    records = train(config, args.out, resume=args.resume, max_steps=args.max_steps, progress=not args.no_progress,
                    wandb=wandb_log.requested(args), wandb_options=wandb_log.options(args),
                    accept_changed_data=args.accept_changed_data)
    out = Path(args.out)
    summary = {"steps_run": len(records), "last_step": records[-1]["step"] if records else None,
               "last": records[-1] if records else None, "log": str(out / LOG_NAME)}
    if args.json:
        print(json.dumps(summary))
    elif records:
        last = records[-1]
        print(f"steps {records[0]['step']}..{last['step']}: loss {last['loss']:.6f} (policy {last['policy_loss']:.6f}, "
              f"moe {last['moe_loss']:.6f}), grad norm {last['grad_norm']:.4g}, lr {last['lr']:.3g}; "
              f"log {summary['log']}")
    else:
        logger.info(f"nothing to do: the last checkpoint of {out} is the run's last step")
    return 0
