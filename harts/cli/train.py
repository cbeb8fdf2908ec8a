"""`harts train-step` and `harts verify`: one step of the model in either execution, or both.

Microbatches come from a planner (`--planner`, default: `harts` for the compact execution and
for `verify`, `per-trajectory` for the baseline) at capacity `--capacity`; `verify` runs both
executions on the same microbatches, so every quantity must agree (issue 5's equivalence).
The loss's hyper-parameters come from `--loss-config` (a YAML of `GRPOConfig` or `PPOConfig`
fields, per `--loss`, loaded strictly) and one flag per field (`harts.args.LOSS_OPTIONS`:
`--clip-ratio-low`, `--dual-clip-ratio`, `--aggregation`, `--entropy-coef`, GRPO's `--kl-coef`,
`--kl-estimator`, `--surrogate`, ...), which override the file; `--pooled-balance-coeff` (harts.args.
LOSS_SECTION_OPTIONS, whatever the loss) adds transformers' pooled load-balancing loss, refused by name for a model
that cannot give it. The resolved config is printed with the results (`loss_config`). Tested in
tests/cli/test_train.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from harts.args import (
    LOSS_AGGREGATIONS,
    LOSS_OPTIONS,
    LOSS_SECTION_OPTIONS,
    loss_flag,
    non_negative_int,
    print_error,
)
from harts.config import execution


AGGREGATIONS = LOSS_AGGREGATIONS
"""harts.objective.losses.AGGREGATIONS, repeated so that building the parser imports no torch."""


def register(commands: argparse._SubParsersAction) -> None:
    train = commands.add_parser("train-step", help="forward + backward of one step (loss, rows, seconds)")
    _common(train)
    execution.add_arguments(train, exclude=("memory_margin",), execution=dict(required=True, default=None))
    train.set_defaults(run=run_train_step)

    verify = commands.add_parser("verify", help="compare the compact execution with the baseline")
    _common(verify)
    execution.add_arguments(verify, exclude=("execution", "memory_margin"), planner=dict(
        default="harts", help="The microbatch planner, shared by both executions (default: harts)."))
    verify.add_argument("--no-replay", action="store_true", help="compact side runs the no-replay ablation")
    verify.set_defaults(run=run_verify)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="configs/models NAME or a YAML path")
    parser.add_argument("--trees", required=True, help="a step: .jsonl(.gz), .npz or a directory")
    parser.add_argument("--device", choices=execution.DEVICES, default="cpu")
    parser.add_argument("--loss", choices=("grpo", "ppo"), default="grpo")
    loss = parser.add_argument_group("loss hyper-parameters (flags override --loss-config)")
    loss.add_argument("--loss-config", metavar="PATH",
                      help="YAML mapping of GRPOConfig or PPOConfig fields (per --loss); unknown keys are errors")
    for field, losses, keywords in LOSS_OPTIONS:
        help_text = keywords["help"] if len(losses) == 2 else f"GRPO only: {keywords['help']}"
        loss.add_argument(loss_flag(field), dest=field, **{**keywords, "help": help_text})
    for field, keywords in LOSS_SECTION_OPTIONS:
        loss.add_argument(loss_flag(field), dest=field, **keywords)
    parser.add_argument("--seed", type=non_negative_int, default=0, help="weight initialisation seed")
    parser.add_argument("--on-policy", action="store_true",
                        help="ignore the step's old log-probs (ratio 1, as in the first epoch on fresh rollouts)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--parallel", default=None, metavar="NAME",
                        help="configs/parallel NAME or a YAML path: run on its ranks (DP/TP/SP/PP/EP), spawned here or "
                             "started by torchrun")


def _setup(args: argparse.Namespace, config):
    """The model (of `config`'s baseline GDN kernel checked first), the step and its prefix index."""
    import torch

    from harts.model.config import load_model_config_with
    from harts.model.model import HybridModel
    from harts.objective.step import check_baseline_gdn_kernel
    from harts.trees.io import read_step
    from harts.trees.trie import PrefixIndex

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    model_config = load_model_config_with(args.model, args.experts_backend)
    check_baseline_gdn_kernel(model_config, config, args.device, name=execution.flag("gdn_kernel"))
    _check_pooled_balance(args, model_config, config)
    step = read_step(args.trees, vocab_size=model_config.vocab_size)
    if args.on_policy:
        step = replace(step, old_logprobs=None)
    index = PrefixIndex.from_step(step)
    with torch.device(args.device):
        model = HybridModel(model_config)
    model.init_weights(args.seed)
    return model, step, index


def _loss_config(args: argparse.Namespace):
    """The GRPOConfig or PPOConfig of `--loss`: `--loss-config`'s fields, then the flags given."""
    from harts.config import load_config
    from harts.objective.losses import GRPOConfig, PPOConfig

    flags = {field: getattr(args, field) for field, _, _ in LOSS_OPTIONS if getattr(args, field) is not None}
    for field, losses, _ in LOSS_OPTIONS:
        if field in flags and args.loss not in losses:
            raise ValueError(f"{loss_flag(field)} applies to --loss {' and '.join(losses)} only (this is --loss "
                             f"{args.loss})")
    cls = GRPOConfig if args.loss == "grpo" else PPOConfig
    if args.loss_config is not None:
        return load_config(args.loss_config, cls, **flags)
    try:
        return cls(**flags)
    except ValueError as error:
        raise ValueError(f"loss options: {error}") from None


def _step_config(args: argparse.Namespace, execution_name: str, **extra):
    """The StepConfig of the flags (checked before any model is built) for `execution_name`."""
    from harts.objective.step import step_config

    knobs = execution.ExecutionConfig(**execution.from_arguments(args))
    section = {field: getattr(args, field) for field, _ in LOSS_SECTION_OPTIONS if getattr(args, field) is not None}
    return step_config(knobs, args.device, execution=execution_name, loss=args.loss,
                       **{args.loss: _loss_config(args)}, **section, **extra)


def _check_pooled_balance(args: argparse.Namespace, model_config, config) -> None:
    """`--pooled-balance-coeff` > 0 on a model that cannot give the loss: a ValueError naming the flag, before the
    model is built."""
    from harts.objective.step import check_pooled_balance, runs_mtp

    check_pooled_balance(model_config, config, args.command, mtp=runs_mtp(model_config, config),
                         name=loss_flag("pooled_balance_coeff"))


def _loss_summary(config) -> dict:
    """The resolved loss of a StepConfig, for the printed results."""
    from harts.config import config_to_dict

    return {"loss": config.loss, **config_to_dict(config.grpo if config.loss == "grpo" else config.ppo),
            **{field: getattr(config, field) for field, _ in LOSS_SECTION_OPTIONS}}


def run_train_step(args: argparse.Namespace) -> int:
    from harts.engine import Engine
    from harts.objective.step import pooled_balance_record
    from harts.parallel.launch import check_torchrun

    if args.parallel:
        return _run_parallel(args, verify=False)
    check_torchrun(None)
    config = _step_config(args, args.execution)
    model, step, index = _setup(args, config)
    engine = Engine(model, config)
    planned = engine.plan(step, index=index)
    result = engine.run(step, planned)
    summary = {
        "execution": args.execution,
        "planner": config.planner,
        "loss_config": _loss_summary(config),
        "microbatches": planned.num_microbatches,
        "loss": result.loss,
        "policy_loss": result.policy_loss,
        "moe_loss": result.moe_loss,
        **pooled_balance_record(result),
        "semantic_tokens": result.num_semantic_tokens,
        "rows": result.num_rows,
        **result.mtp_record(),
        "plan_seconds": planned.plan.plan_seconds,
        "seconds": result.seconds,
    }
    _check_finite(summary, step, "train-step")
    if args.json:
        print(json.dumps(summary))
    else:
        seconds = result.seconds
        mtp = "" if result.mtp_loss is None else f", mtp {result.mtp_loss:.6f}"
        print(
            f"{args.execution}: loss {result.loss:.6f} (policy {result.policy_loss:.6f}, moe {result.moe_loss:.6f}"
            f"{mtp}), {result.num_rows:,} rows for {result.num_semantic_tokens:,} semantic tokens in "
            f"{summary['microbatches']} microbatch(es); layout {seconds['layout']:.2f} s, forward "
            f"{seconds['forward']:.2f} s, backward {seconds['backward']:.2f} s"
        )
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from harts.engine import plan_step
    from harts.objective.verify import compare_executions
    from harts.parallel.launch import check_torchrun

    if args.parallel:
        return _run_parallel(args, verify=True)
    check_torchrun(None)
    reference, candidate = _step_config(args, "baseline"), _step_config(args, "compact", replay=not args.no_replay)
    model, step, index = _setup(args, reference)
    planned = plan_step(step, reference, index=index)
    report = compare_executions(model, step, planned.microbatches, reference, candidate, index=index)
    report["compact_tokens"] = index.segment_tree().num_compact_tokens
    report["loss_config"] = _loss_summary(reference)
    _check_finite(report, step, "verify")
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:<24} {value}", file=sys.stdout)
    return 0


def _check_finite(summary: dict, step, command: str) -> None:
    """ValueError naming the non-finite results: a NaN or infinite loss is a failed step (and JSON has no
    NaN), most often from old log-probs so low that the policy ratio exp(λ − λ_old) overflows."""
    from harts.args import non_finite_fields

    fields = non_finite_fields(summary)
    if not fields:
        return
    hint = ""
    if step.old_logprobs is not None and len(step.old_logprobs):
        hint = (f"; the step's old_logprobs go down to {float(step.old_logprobs.min()):.6g}, so the ratio "
                "exp(logprob - old_logprob) can overflow: check them, or pass --on-policy")
    raise ValueError(f"{command}: results are not finite ({', '.join(fields)}){hint}")


def _run_parallel(args: argparse.Namespace, *, verify: bool) -> int:
    """`--parallel NAME`: the step on the ranks of a parallel config (harts.parallel); verify compares
    both executions there with the single-process baseline. Rank 0's result is printed (under
    torchrun every rank runs this, and the others print nothing)."""
    import torch

    from harts.engine import parallel_train_step, plan_step
    from harts.model.config import load_model_config_with
    from harts.objective.step import check_baseline_gdn_kernel, pooled_balance_record
    from harts.parallel.config import load_parallel_config
    from harts.parallel.launch import RankFailed, check_torchrun, launch
    from harts.parallel.verify import verify_on_rank
    from harts.trees.io import read_step
    from harts.trees.trie import PrefixIndex

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    parallel = load_parallel_config(args.parallel)
    check_torchrun(parallel)
    planning = _step_config(args, "baseline" if verify else args.execution)
    loss_config = _loss_summary(planning)
    config = load_model_config_with(args.model, args.experts_backend)
    parallel.check_model(config)
    check_baseline_gdn_kernel(config, planning, args.device, name=execution.flag("gdn_kernel"))
    _check_pooled_balance(args, config, planning)
    step = read_step(args.trees, vocab_size=config.vocab_size)
    if args.on_policy:
        step = replace(step, old_logprobs=None)
    index = PrefixIndex.from_step(step)
    planned = plan_step(step, planning, index=index, dp=parallel.dp)
    common = (config, args.seed, step, planned.microbatches)
    head = {"parallel": parallel.name, "world_size": parallel.world_size, "planner": planning.planner,
            "microbatches": len(planned.microbatches), "loss_config": loss_config}
    try:
        if verify:
            candidates = [_step_config(args, "baseline"), _step_config(args, "compact", replay=not args.no_replay)]
            result = launch(verify_on_rank, parallel, *common, candidates, device=args.device)
        else:
            result = launch(parallel_train_step, parallel, *common, _step_config(args, args.execution),
                            device=args.device)
    except RankFailed as error:
        print_error(str(error))
        return 1
    if result is None:
        return 0
    if verify:
        summary = {**head, "compact_tokens": index.segment_tree().num_compact_tokens,
                   **{report["execution"]: report for report in result}}
    else:
        summary = {**head, "execution": args.execution, "loss": result.loss, "policy_loss": result.policy_loss,
                   "moe_loss": result.moe_loss, **pooled_balance_record(result),
                   "semantic_tokens": result.num_semantic_tokens, "rows": result.num_rows,
                   "plan_seconds": planned.plan.plan_seconds, "seconds": result.seconds}
    _check_finite(summary, step, "verify" if verify else "train-step")
    if args.json:
        print(json.dumps(summary))
    else:
        for key, value in summary.items():
            if isinstance(value, dict):
                print(f"{key}:")
                for inner, number in value.items():
                    print(f"  {inner:<30} {number}")
            else:
                print(f"{key:<32} {value}")
    return 0
