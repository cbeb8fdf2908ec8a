"""The `harts bench speedup` run (`run`): the model built once, then every step of the trees with the run's own
settings and each `--variant`'s (`run_variants`, all checked before any model is built) measured in one process
(`measure.measure_step`) or on the ranks of `--parallel` (`parallel.measure_parallel_step`), one record per step
and variant, written after every case. A variant whose baseline would run as an earlier case's of the step takes
that case's baseline (`reuse.BaselineReuse`; not with `--no-reuse-baseline`) and measures the compact execution
alone. A failed case (an error, out of memory, SIGTERM) is an error row and the run goes on (SIGTERM ends it, every
record written; so does any failure under torchrun, whose ranks are then out of step); torchrun ranks other than 0
follow rank 0 quietly. Each record is one W&B run, opened before its step is
measured. Tested end to end in tests/bench/speedup/test_run.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
from pathlib import Path
from typing import Any

from harts.args import print_error
from harts.bench.speedup.executions import RECORD_KNOBS, compact_recompute_blocks, knobs_of, requested_blocks
from harts.bench.speedup.measure import measure_step
from harts.bench.speedup.parallel import measure_parallel_step
from harts.bench.speedup.recompute import check_recompute_flags, found_blocks
from harts.bench.speedup.records import error_row, format_table, headline
from harts.bench.speedup.reuse import BaselineReuse, case_name, measured_executions
from harts.config.execution import flag
from harts.engine_memory import release_memory
from harts.tracking import wandb_log

logger = logging.getLogger(__name__)


def run(args: argparse.Namespace) -> int:
    """`harts bench speedup`: 0 when every record has results, 1 when one is an error row, 128 + SIGTERM when
    terminated."""
    import torch

    from harts.config import config_to_dict
    from harts.model.config import load_model_config_with
    from harts.model.model import HybridModel
    from harts.objective.step import check_baseline_gdn_kernel
    from harts.optim.adamw import Fp32Gradients
    from harts.parallel.config import load_parallel_config
    from harts.parallel.launch import check_torchrun, is_reporting_rank, launched_by_torchrun
    from harts.tracking.records import Terminated, make_record, sigterm_raises, write_records

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    variants = run_variants(args)
    device = torch.device(args.device)
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    params_name = parameter_dtype(args.params, dtype_name, args.parallel)
    model_config = load_model_config_with(args.model, args.experts_backend)
    for run_args in variants:
        where = f"--variant {run_args.variant}: " if run_args.variant else ""
        baseline = knobs_of(run_args, "baseline", requested_blocks(run_args)["baseline"]).resolved(args.device)
        check_baseline_gdn_kernel(model_config, baseline, args.device, name=flag("gdn_kernel"), where=where)
    parallel = load_parallel_config(args.parallel) if args.parallel else None
    check_torchrun(parallel)
    if not is_reporting_rank():
        return _follow_rank_zero(variants, parallel, dtype_name)
    if parallel is None:
        with device:
            model = HybridModel(model_config)
        model.init_weights(args.model_seed)
        if params_name == "bf16":
            model.to(torch.bfloat16)
            Fp32Gradients(model.named_parameters())  # its hooks stay on the parameters for the run
    out = Path(args.out)  # the default set when the command started (harts.bench.outputs.records_files)
    records = []
    # One W&B run per record, opened before the step is measured and logged to while it runs.
    tracker = wandb_log.BenchLogger(wandb_log.options(args))

    def keep(record: dict[str, Any]) -> None:
        records.append(record)
        tracker.finish(record)

    # `timeout` and schedulers stop a long run with SIGTERM: end it as an error row that keeps the
    # phase it reached and the seconds of every step it finished, and write every record.
    terminated = False
    current = None  # (config, progress) of the step being measured, until its row is written
    reuse = BaselineReuse(not args.no_reuse_baseline, dtype_name)
    with sigterm_raises():
        try:
            for index, step, step_meta, run_args in _cases(args, variants):
                case_config = load_model_config_with(args.model, run_args.experts_backend)
                if parallel is None:
                    model.set_experts_backend(case_config.moe.experts_backend)
                config = {
                    "model": model_config.name, "model_config": config_to_dict(case_config), **step_meta,
                    **{name: getattr(run_args, name) for name in RECORD_KNOBS},
                    "device": args.device, "dtype": dtype_name, "params": params_name,
                    "compact_recompute_blocks": compact_recompute_blocks(run_args),
                    "compact_attention_backend": run_args.compact_attention_backend,
                    "repeats": run_args.repeats, "parallel": parallel.name if parallel else "single",
                    "world_size": parallel.world_size if parallel else 1,
                    "parallel_config": config_to_dict(parallel) if parallel else None, "variant": run_args.variant,
                }
                variant = f" (--variant {run_args.variant})" if run_args.variant else ""
                logger.info(f"step {index}{variant}: {step.num_trajectories} trajectories, "
                            f"{step.num_semantic_tokens:,} tokens ...")
                tracker.start("speedup", config)
                progress: dict[str, Any] = {"phase": "planning", "finished": [], "log": tracker.log}
                current = (config, progress)
                try:
                    reused = reuse.find(index, run_args)
                    if reused is not None:
                        logger.info(f"step {index}{variant}: the baseline of {case_name(reused.source)} (the same "
                                    "baseline settings), not measured again: measuring the compact execution only")
                    if parallel is None:
                        results = measure_step(run_args, model, step, device, dtype_name, progress, reused)
                        config.update(found_blocks(results))
                    else:
                        progress["phase"] = f"--parallel {parallel.name}"
                        results = measure_parallel_step(run_args, parallel, case_config, step, dtype_name, reused)
                        # The ranks' timings come back at the end: each repeat's history row then (of the
                        # executions measured here).
                        names = measured_executions(reused)
                        for repeat, pair in enumerate(zip(*(results[name]["fbg_repeats_s"] for name in names))):
                            tracker.log({"repeat": repeat + 1, **{name: {"fbg_s": value}
                                                                  for name, value in zip(names, pair)}})
                    keep(make_record("speedup", config, results))
                    current = None
                    reuse.keep(index, run_args, results)
                except (RuntimeError, ValueError, torch.OutOfMemoryError, Terminated) as error:
                    if current is not None:
                        keep(error_row(config, progress, error, device))
                        current = None
                    if isinstance(error, Terminated):
                        raise
                    if parallel is not None and launched_by_torchrun():
                        break  # this process is one rank of torchrun's: after a failure the ranks are out of step
                finally:
                    release_memory(device, model if parallel is None else None)
                write_records(records, out)
        except Terminated as error:
            terminated = True
            if current is not None:  # stopped while writing another error's row
                keep(error_row(*current, error, device))
        write_records(records, out)
    print(format_table(records))
    logger.info(f"wrote {len(records)} record(s) to {out}")
    if args.json:
        print(json.dumps([headline(r) for r in records]))
    tracker.close()
    if terminated:
        return 128 + signal.SIGTERM
    return 0 if all("error" not in r for r in records) else 1


def run_variants(args: argparse.Namespace) -> list[argparse.Namespace]:
    """The run's settings: `args` itself (variant None), then `args` with each `--variant`'s flags over them,
    each checked before any model is built (ValueError naming the variant)."""
    overrides = [{"variant": None}, *(args.variant or [])]
    variants = [argparse.Namespace(**{**vars(args), **override}) for override in overrides]
    measured: dict[tuple, str] = {}
    for run_args in variants:
        where = f"--variant {run_args.variant}: " if run_args.variant else ""
        # The same settings measured again would be two records of one configuration (and one step counted
        # twice in the report); more repeats belong in --repeats.
        resolved = {**vars(run_args), "compact_recompute_blocks": compact_recompute_blocks(run_args)}
        settings = tuple(sorted((k, repr(v)) for k, v in resolved.items() if k not in ("variant", "repeats")))
        if settings in measured:
            raise ValueError(f"{where}the same run settings as {measured[settings]} (only repeats differ)")
        measured[settings] = case_name(run_args.variant)
        check_recompute_flags(run_args, where)
        for name, blocks in requested_blocks(run_args).items():
            try:
                knobs_of(run_args, name, blocks).resolved(run_args.device, as_flags=True)
            except ValueError as error:
                message = str(error)
                if name == "compact" and run_args.compact_attention_backend is not None:
                    # The compact execution's backend came from its own flag: name that flag, not the shared one.
                    message = message.replace(flag("attention_backend"), "--compact-attention-backend")
                raise ValueError(f"{where}{message}") from None
    return variants


def _cases(args: argparse.Namespace, variants: list[argparse.Namespace]):
    """(index, step, step meta, settings) of every step of the trees, each with every variant in turn."""
    from harts.trees.sources import iter_steps

    for index, step, step_meta in iter_steps(args.trees, args.seed, args.steps, args.max_trees):
        for run_args in variants:
            yield index, step, step_meta, run_args


def parameter_dtype(requested: str | None, dtype_name: str, parallel: str | None) -> str:
    """The parameters' dtype of a run: `--params`, or bf16 for a bf16 run in one process, else fp32."""
    if requested is None:
        return "bf16" if dtype_name == "bf16" and parallel is None else "fp32"
    if requested == "bf16" and dtype_name != "bf16":
        raise ValueError("--params bf16 needs --dtype bf16 (bf16 parameters under fp32 compute are not a mode)")
    if requested == "bf16" and parallel is not None:
        raise ValueError("--params bf16 is not implemented with --parallel: its gradient reduction works on the "
                         "parameters' .grad, which the fp32 accumulation frees")
    return requested


def _follow_rank_zero(variants, parallel, dtype_name) -> int:
    """A torchrun rank other than 0: its part of every step's and variant's `--parallel` run, nothing printed or
    written (rank 0 writes the records); it stops at a failure, as rank 0 does, with one line. The ranks' program
    runs on rank 0's arguments (harts.parallel.launch broadcasts them), so that where rank 0 reuses a baseline
    every rank measures the compact execution alone."""
    import torch

    from harts.model.config import load_model_config_with
    from harts.parallel.launch import RankFailed

    try:
        for _, step, _, run_args in _cases(variants[0], variants):
            case_config = load_model_config_with(run_args.model, run_args.experts_backend)
            try:
                measure_parallel_step(run_args, parallel, case_config, step, dtype_name)
            finally:
                release_memory(torch.device(run_args.device))
    except RankFailed as error:
        print_error(str(error))
        return 1
    return 0
