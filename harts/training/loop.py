"""`train`: the optimizer steps of the hybrid model over a sequence of RL steps, with exact resume.

The model starts from `init_weights(seed)`, or from the Hugging Face checkpoint `init_from` (loaded straight
into the run's dtype and device by harts.model.hf; its config.json is the model config).

Step t (0-based; records and checkpoints count the steps done, t + 1):
1. data step order[t mod M] of the `StepSource` (M data steps; epoch t // M, whose order
   `epoch_order` gives at its first step), without old log-probs if `data.on_policy`; its
   microbatches planned (`Engine.plan` of harts.engine: the execution's planner, capacity T, one replica);
2. `Engine.run` (forward, GRPO/PPO loss, backward; for bf16 parameters the gradients accumulate in
   the fp32 masters);
3. a non-finite loss or gradient norm stops the run with a ValueError naming the step, before
   anything is updated or saved;
4. global-norm clipping (the pre-clip norm is logged), AdamW at the step's learning rate, the
   scheduler's step;
5. the aux-loss-free expert-bias update of every MoE layer that has an expert bias, from the
   step's q-weighted routed counts (`StepResult.tokens_per_expert`, summed over microbatches);
6. a record in RUN/train.jsonl, a checkpoint every `checkpoint.every` steps and after the last
   step (or the `max_steps` stop), then the `on_step_end(record)` hooks.
With `execution.recompute_blocks: auto` (CUDA), each start first searches the fewest recomputed blocks with which
its first step fits (`Engine.fit_recompute_blocks`: untimed steps, peaking at most the GPU's memory less
`execution.memory_margin` of it and less the AdamW moments the optimizer has yet to allocate), before the step's
gradients are zeroed, and trains with them. A later step with a microbatch that no single searched microbatch
covers (at least as large in rows, KDA rows and key/value rows alike; `Engine.unsearched_extent`: after a first step
smaller than T, a deeper tree) is searched on again first, from the blocks found: they only grow.

Exact resume: the checkpoint holds everything later steps read (weights, fp32 masters, AdamW
moments and step counts, the scheduler's step, the RNG states, the epoch's order, the step
index); planning and the step itself are deterministic functions of the data step and the
weights. So a run killed after any step and resumed from its last checkpoint repeats the
uninterrupted run: bitwise on the CPU (fp32, or bf16 with fp32 masters) with the same torch
thread count (a different one is warned about), and on CUDA under `torch.use_deterministic_algorithms(True)`;
otherwise on CUDA up to the kernels' own nondeterminism, which a few steps amplify. A
resumed run must have the same resolved config and model config as the checkpoint and as the
run's first start record (the first differing key is named: a checkpoint copied from another
run is refused), and the same data steps by content as the checkpoint (sha256 per data step;
`accept_changed_data` overrides). Resuming a run directory without a checkpoint (killed before
its first) starts again from step 0 and keeps the log. With `wandb`, each step record also goes to W&B
(harts.tracking.wandb_run).

RUN/train.jsonl: each start writes {"event": "start", "resumed_from", "config", "data" (number
and combined sha256 of the data steps), "device_memory_bytes" (the GPU's total; null on CPU), "environment"};
with recompute_blocks auto then {"event": "recompute_search", ...} (why, the blocks found, the margin, the limit,
every probe and the searched microbatches' extents), again before a step searched on again; then one
{"event": "step", ...} per step (loss, policy and MoE loss, with `loss.pooled_balance_coeff` the pooled
load-balancing loss without its coefficient, pre-clip gradient norm, lr,
clip fraction, KL to the reference policy, S, C, rows, seconds, peak_memory_bytes: the CUDA allocator's peak
over the step, optimizer included, null on CPU) and {"event": "checkpoint", ...} per checkpoint. On resume the
records of steps after the checkpoint (done before the stop, about to be redone) are removed from the log, and
their number is printed.
Tested in tests/training/test_loop.py (resume exactness after a hook that raises and after
max_steps, in fp32, bf16 and with two threads, and on CUDA under deterministic algorithms; the
expert-bias update with the step's counts; non-finite steps; run-directory checks; recompute_blocks auto against
simulated memory: the steps those of the blocks found, the search's record; peak memory per step on CUDA).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm import tqdm

from harts.config import config_to_dict
from harts.files import write_bytes
from harts.objective.step import (
    check_baseline_gdn_kernel,
    check_pooled_balance,
    pooled_balance_record,
    runs_mtp,
)
from harts.optim.adamw import MasterWeightAdamW, make_scheduler
from harts.optim.update import apply_update
from harts.tracking.wandb_log import WandbOptions
from harts.tracking.wandb_run import WandbTracker
from harts.training.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    read_metadata,
    remove_stale,
    save_checkpoint,
)
from harts.training.config import TrainConfig, resolve, train_config_from_dict
from harts.training.data import StepSource, epoch_order

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from harts.engine import Engine, PlannedStep
    from harts.model.model import HybridModel
    from harts.trees.step import Step

LOG_NAME = "train.jsonl"


def train(
    config: TrainConfig,
    run_dir: str | Path,
    *,
    resume: bool = False,
    max_steps: int | None = None,
    progress: bool = False,
    wandb: bool = False,
    wandb_options: WandbOptions | None = None,
    on_step_end: Iterable[Callable[[dict[str, Any]], None]] = (),
    accept_changed_data: bool = False,
) -> list[dict[str, Any]]:
    """Run `config`'s steps into `run_dir` (with `resume`: from its last checkpoint, or from step 0 when it
    has none), stopping after step `max_steps` if given (with a checkpoint there); with `wandb`, also log
    each step to W&B (`wandb_options`: the `--wandb-*` flags) (harts.tracking.wandb_run); return the step
    records of this call. A resume whose data steps' content differs from the checkpoint's is refused
    unless `accept_changed_data`."""
    run_dir = Path(run_dir)
    model_config = model_config_of(config)
    source = StepSource(config.data.trees, config.data.seed, model_config.vocab_size)
    config = resolve(config, source.num_steps)
    if config.schedule.warmup_steps > config.num_steps:
        raise ValueError(f"schedule.warmup_steps ({config.schedule.warmup_steps}) exceeds num_steps ({config.num_steps})")
    if max_steps is not None and max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda: no CUDA device is available")
    check_baseline_gdn_kernel(model_config, config.execution, config.device, name="execution.gdn_kernel")
    check_pooled_balance(model_config, config.loss, "harts train", mtp=runs_mtp(model_config, config.execution),
                         name="loss.pooled_balance_coeff")
    resolved = {"train": config_to_dict(config), "model": config_to_dict(model_config)}
    stop = config.num_steps if max_steps is None else min(config.num_steps, max_steps)
    digests = source.digests()
    if resume:
        checkpoint = _checkpoint_to_resume(run_dir, resolved, source, digests, accept_changed_data)
    else:
        checkpoint = _check_fresh(run_dir)
    if checkpoint is not None and read_metadata(checkpoint)[0]["step"] >= stop:
        return []

    run = _Run.build(config, model_config, resolved, source, digests, run_dir)
    if checkpoint is not None:
        start, order = run.restore(checkpoint)
    else:
        start, order = 0, None
        if resume:
            _restart(run_dir)
    records = []
    run_dir.mkdir(parents=True, exist_ok=True)
    start_record = _start_record(resolved, checkpoint, start, digests, torch.device(config.device))
    tracker = WandbTracker.start(start_record, run_dir, wandb_options) if wandb else None
    failed = True
    try:
        # Unbuffered: a write that fails (a full disk) leaves nothing behind for the close to fail on again.
        with (run_dir / LOG_NAME).open("ab", buffering=0) as log:
            _write(log, start_record)
            bar = tqdm(total=config.num_steps, initial=start, desc="train", unit="step", disable=not progress,
                       file=sys.stderr, dynamic_ncols=True)
            for t in range(start, stop):
                epoch, position = divmod(t, source.num_steps)
                if position == 0:
                    order = epoch_order(source.num_steps, config.data.shuffle)
                assert order is not None and len(order) == source.num_steps, "the epoch's order comes from the checkpoint"
                search = run.search_if_needed(order[position])
                if search is not None:
                    _write(log, {"event": "recompute_search", "step": t, "data_step": order[position], **search})
                record = {"event": "step", "step": t + 1, "epoch": epoch, **run.step(t + 1, order[position])}
                _write(log, record)
                records.append(record)
                if tracker is not None:
                    tracker.log(record)
                bar.set_postfix(loss=f"{record['loss']:.4g}", lr=f"{record['lr']:.3g}",
                                grad_norm=f"{record['grad_norm']:.3g}", refresh=False)
                bar.update(1)
                every = config.checkpoint.every
                if t + 1 == stop or (every and (t + 1) % every == 0):
                    _write(log, run.save(t + 1, order))
                for hook in on_step_end:
                    hook(record)
            bar.close()
        failed = False
    finally:
        if tracker is not None:
            tracker.finish(failed)
        run.optimizer.remove_hooks()
    return records


def model_config_of(config: TrainConfig):
    """The model config of a run: `model`'s, or the config.json of the Hugging Face checkpoint `init_from`, with the
    execution's experts backend when it names one."""
    from harts.model.config import load_model_config, with_experts_backend
    from harts.model.hf import load_hf_config

    model_config = load_hf_config(config.init_from) if config.init_from is not None else load_model_config(config.model)
    return with_experts_backend(model_config, config.execution.experts_backend)


def engine_of(config: TrainConfig, model: torch.nn.Module) -> Engine:
    """The engine of a (resolved) training config's steps (recompute_blocks auto: searched at a start's first step
    and again where a step outgrows the search, `_Run.search_if_needed`)."""
    from harts.engine import Engine

    return Engine.build(model, config.execution, config.device, loss_config=config.loss)


@dataclass
class _Run:
    """The model, optimizer and scheduler of a run, and what a step needs besides them."""

    config: TrainConfig
    resolved: dict[str, Any]
    source: StepSource
    digests: list[str]
    run_dir: Path
    model: HybridModel
    optimizer: MasterWeightAdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR
    engine: Engine
    staged: tuple[int, Step, PlannedStep, float] | None = None
    """The data step loaded last, its plan and the seconds its loading took (a search's check, the search and the
    step share them: one load and one plan a step)."""

    @classmethod
    def build(cls, config: TrainConfig, model_config, resolved: dict[str, Any], source: StepSource,
              digests: list[str], run_dir: Path) -> _Run:
        from harts.model.hf import load_hf_checkpoint
        from harts.model.model import HybridModel

        torch.manual_seed(config.seed)
        np.random.seed(config.seed)
        random.seed(config.seed)
        if config.init_from is not None:
            dtype = torch.bfloat16 if config.dtype == "bf16" else torch.float32
            model, _ = load_hf_checkpoint(config.init_from, dtype=dtype, device=config.device)
        else:
            with torch.device(config.device):
                model = HybridModel(model_config)
            model.init_weights(config.seed)
            if config.dtype == "bf16":
                model.to(torch.bfloat16)
        optimizer = MasterWeightAdamW(model.named_parameters(), config.optimizer)
        return cls(config=config, resolved=resolved, source=source, digests=digests, run_dir=run_dir, model=model,
                   optimizer=optimizer, scheduler=make_scheduler(optimizer, config.schedule, config.num_steps),
                   engine=engine_of(config, model))

    def restore(self, checkpoint: Path) -> tuple[int, list[int]]:
        """Load `checkpoint` (after `build`: module construction draws from the global RNG, which
        this restores); trim the log to it; return (steps done, the epoch's order)."""
        trainer = load_checkpoint(checkpoint, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler)
        if len(trainer["epoch_order"]) != self.source.num_steps:
            raise ValueError(f"{checkpoint / 'trainer.json'}: 'epoch_order' orders {len(trainer['epoch_order'])} data "
                             f"steps, {self.config.data.trees} has {self.source.num_steps}")
        if trainer["torch_threads"] != torch.get_num_threads():
            logger.warning(f"{checkpoint} was written with {trainer['torch_threads']} torch threads, this run has "
                           f"{torch.get_num_threads()}: the continuation is not bitwise that of an uninterrupted run")
        dropped, damaged = _truncate_log(self.run_dir / LOG_NAME, trainer["step"])
        logger.info(f"resuming {self.run_dir} from {checkpoint.name}"
                    + (f"; {dropped} logged step(s) after it are redone" if dropped else "")
                    + (f"; the torn last line of {LOG_NAME} removed" if damaged else ""))
        return trainer["step"], trainer["epoch_order"]

    def save(self, step: int, order: list[int]) -> dict[str, Any]:
        """Checkpoint after `step` steps; return the log's checkpoint record."""
        started = time.perf_counter()
        path = save_checkpoint(
            self.run_dir, step, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
            config=self.resolved, cuda=self.config.device == "cuda",
            trainer={"epoch_order": order, "torch_threads": torch.get_num_threads(),
                     "versions": {"torch": torch.__version__}, "data_sha256": self.digests},
        )
        return {"event": "checkpoint", "step": step, "path": str(path.relative_to(self.run_dir)),
                "seconds": time.perf_counter() - started}

    def data_step(self, data_index: int) -> Step:
        """Data step `data_index` as the run trains on it (without old log-probs if `data.on_policy`)."""
        step = self.source.step(data_index)
        return replace(step, old_logprobs=None) if self.config.data.on_policy else step

    def planned_step(self, data_index: int) -> tuple[Step, PlannedStep, float]:
        """Data step `data_index` as the run trains on it, its plan (which the recomputed blocks do not change) and
        the seconds its loading took, loaded and planned once (`staged`)."""
        if self.staged is None or self.staged[0] != data_index:
            started = time.perf_counter()
            step = self.data_step(data_index)
            seconds = time.perf_counter() - started
            self.staged = (data_index, step, self.engine.plan(step), seconds)
        return self.staged[1:]

    def search_if_needed(self, data_index: int) -> dict[str, Any] | None:
        """recompute_blocks auto: `Engine.search_if_needed` on data step `data_index` (the start's first step, or a
        microbatch that no single microbatch searched on covers in rows, KDA rows and key/value rows), before any
        of its gradients (the probes' are freed and the step zeroes the masters'), leaving the memory the
        optimizer's moments will take once allocated; the search's record, or None."""
        if not (self.engine.search_pending or self.engine.searched_extents):
            return None  # a number of blocks: nothing to load or plan ahead of the step
        step, planned, _ = self.planned_step(data_index)
        return self.engine.search_if_needed(step, planned, reserved_bytes=self.optimizer.pending_state_bytes())

    def step(self, number: int, data_index: int) -> dict[str, Any]:
        """Optimizer step `number` (1-based) on data step `data_index`; its record's measurements, with the CUDA
        allocator's peak over the whole step (its optimizer too; None on the CPU, which has no device peak)."""
        from harts.engine_memory import PeakMemory

        if self.config.device != "cuda":
            return {**self._step(number, data_index), "peak_memory_bytes": None}
        with PeakMemory(torch.device(self.config.device)) as memory:
            record = self._step(number, data_index)
        return {**record, "peak_memory_bytes": memory.peak}

    def _step(self, number: int, data_index: int) -> dict[str, Any]:
        from harts.objective.losses import step_kl

        config = self.config
        step, planned, data_seconds = self.planned_step(data_index)
        started = time.perf_counter()

        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.zero_grad()
        result = self.engine.run(step, planned, collect_logprobs=step.ref_logprobs is not None)
        where = f"step {number} ({self.source.describe(data_index)})"
        if not math.isfinite(result.loss):
            hint = ""
            if step.old_logprobs is not None and len(step.old_logprobs):
                hint = (f"; the step's old_logprobs go down to {float(step.old_logprobs.min()):.6g}, so the ratio "
                        "exp(logprob - old_logprob) can overflow: check them, or train on-policy (--on-policy)")
            raise ValueError(f"{where}: the loss is {result.loss}{hint}")
        start = time.perf_counter()
        grad_norm = apply_update(self.model, self.optimizer, self.scheduler, config.optimizer.max_grad_norm,
                                 result.tokens_per_expert, where)
        optimizer_seconds = time.perf_counter() - start
        return {
            "data_step": data_index,
            "loss": result.loss,
            "policy_loss": result.policy_loss,
            "moe_loss": result.moe_loss,
            **pooled_balance_record(result),
            "grad_norm": grad_norm,
            "lr": lr,
            "clip_fraction": result.clip_fraction,
            "kl": step_kl(step, result.logprobs),
            "semantic_tokens": result.num_semantic_tokens,
            "compact_tokens": planned.index.segment_tree().num_compact_tokens,
            "rows": result.num_rows,
            **result.mtp_record(),
            "microbatches": planned.num_microbatches,
            "seconds": {"data": data_seconds, "plan": planned.seconds, **result.seconds,
                        "optimizer": optimizer_seconds,
                        "total": data_seconds + planned.seconds + time.perf_counter() - started},
        }


def _check_fresh(run_dir: Path) -> None:
    """ValueError if `run_dir` holds an earlier run (a fresh run never mixes with one)."""
    if latest_checkpoint(run_dir) is not None or (run_dir / LOG_NAME).exists():
        raise ValueError(f"{run_dir}: holds an earlier run (checkpoints or {LOG_NAME}); continue it with --resume "
                         "(from its last checkpoint, or from step 0 if it has none) or choose another directory")
    remove_stale(run_dir)


def _checkpoint_to_resume(run_dir: Path, resolved: dict[str, Any], source: StepSource, digests: list[str],
                          accept_changed_data: bool) -> Path | None:
    """The last checkpoint of `run_dir` (None: there is none, the run restarts), after checking that `resolved`
    equals the checkpoint's config and the run's first start's, and `digests` the checkpoint's data (each
    mismatch a ValueError naming the key or the data step)."""
    checkpoint = latest_checkpoint(run_dir)
    for stale in remove_stale(run_dir):
        logger.info(f"removed {stale}, an incomplete checkpoint")
    if checkpoint is not None:
        trainer, saved = read_metadata(checkpoint)
        difference = first_difference(_with_new_defaults(saved, checkpoint / "config.json"), resolved)
        if difference is not None:
            key, then, now = difference
            raise ValueError(f"{checkpoint / 'config.json'}: '{key}' is {then!r} in the checkpoint but {now!r} now; "
                             "resume with the checkpoint's config")
        _check_data(checkpoint, trainer.get("data_sha256"), source, digests, accept_changed_data)
    log = run_dir / LOG_NAME
    first = first_start_record(log)
    if first is not None:
        difference = first_difference(_with_new_defaults(first["config"], log), resolved)
        if difference is not None:
            key, then, now = difference
            raise ValueError(f"{log}: '{key}' is {then!r} in the run's first start but {now!r} now"
                             + (f" ({checkpoint.name} is not this run's?)" if checkpoint is not None else "")
                             + "; resume with the run's config, or train into another directory")
    return checkpoint


def _check_data(checkpoint: Path, then: list[str] | None, source: StepSource, now: list[str], accept: bool) -> None:
    if then is None:
        logger.warning(f"{checkpoint / 'trainer.json'} records no data digests (an older harts wrote it): "
                       "the data steps' content is not compared")
        return
    if then == now:
        return
    if len(then) != len(now):
        change = f"{source.trees} has {len(now)} data steps, the checkpoint's run had {len(then)}"
    else:
        index = next(i for i, (a, b) in enumerate(zip(then, now)) if a != b)
        change = (f"{source.describe(index)}: data step {index} has changed since {checkpoint.name} "
                  f"(sha256 {then[index][:12]}... then, {now[index][:12]}... now)")
    if not accept:
        raise ValueError(f"{change}; restore the run's data, or pass --accept-changed-data to continue on these")
    logger.warning(f"{change}; continuing on the new data (--accept-changed-data)")


def _restart(run_dir: Path) -> None:
    """Resume without a checkpoint: the run starts again from step 0, its log kept (the steps it logged redone)."""
    dropped, damaged = _truncate_log(run_dir / LOG_NAME, 0)
    logger.info(f"{run_dir}: no checkpoint to resume from, starting from step 0"
                + (f"; {dropped} logged step(s) are redone" if dropped else "")
                + (f"; the torn last line of {LOG_NAME} removed" if damaged else ""))


def first_start_record(log: Path) -> dict[str, Any] | None:
    """The first start record of a run's log (None when there is no log or it holds none)."""
    if not log.exists():
        return None
    for _, record in _log_records(log):
        if isinstance(record, dict) and record.get("event") == "start":
            if not isinstance(record.get("config"), dict) or not isinstance(record["config"].get("train"), dict):
                raise ValueError(f"{log}: the first start record has no config.train object")
            return record
    return None


def _log_records(path: Path) -> list[tuple[bytes, dict[str, Any] | None]]:
    """Each line of a run's log as (its bytes, its record), the record None for a damaged last line: a kill or a full
    disk can tear only the line being appended. A damaged line before the last is refused, not dropped: the log was
    altered by something else."""
    lines = path.read_bytes().splitlines(keepends=True)
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            record = None
        if not isinstance(record, dict):
            if number < len(lines):
                raise ValueError(f"{path}: line {number}: not a JSON record (only the last line of a run's log can "
                                 "be torn, by a kill or a full disk); repair or remove the line")
            record = None
        records.append((line, record))
    return records


def _with_new_defaults(saved: dict[str, Any], where: Path) -> dict[str, Any]:
    """A checkpoint's (or start record's) resolved config with the training keys it lacks (added to HARTS after it was written)
    at their defaults: read back through the strict loader, which fills them, and resolved again (an execution
    knob added since defaults by device as the others did), and likewise the model config's (e.g. `mtp`); an
    unreadable one is compared as it is (and so reported)."""
    from harts.config import from_dict
    from harts.model.config import ModelConfig

    if not isinstance(saved, dict) or not isinstance(saved.get("train"), dict):
        return saved
    try:
        train = config_to_dict(resolve(train_config_from_dict(saved["train"], str(where)), 1))
    except ValueError:
        return saved
    filled = {**saved, "train": train}
    if isinstance(saved.get("model"), dict):
        try:
            filled["model"] = config_to_dict(from_dict(ModelConfig, saved["model"], str(where)))
        except ValueError:
            pass
    return filled


def first_difference(then: Any, now: Any, prefix: str = "") -> tuple[str, Any, Any] | None:
    """(dotted key, old, new) of the first difference between two JSON-like values, or None."""
    if isinstance(then, dict) and isinstance(now, dict):
        for key in sorted(set(then) | set(now), key=str):
            found = first_difference(then.get(key, "<absent>"), now.get(key, "<absent>"), f"{prefix}{key}.")
            if found is not None:
                return found
        return None
    # A JSON round trip turns tuples into lists: compare through JSON.
    if json.dumps(then) != json.dumps(now):
        return prefix.rstrip("."), then, now
    return None


def _truncate_log(path: Path, step: int) -> tuple[int, int]:
    """Keep the records of `path` up to step `step`; return (step records removed, torn last lines removed)."""
    if not path.exists():
        return 0, 0
    kept, dropped, damaged = [], 0, 0
    for line, record in _log_records(path):
        if record is None:
            damaged += 1
        elif isinstance(record.get("step"), int) and record["step"] > step:
            dropped += record.get("event") == "step"
        else:
            kept.append(line if line.endswith(b"\n") else line + b"\n")
    write_bytes(path, b"".join(kept))
    return dropped, damaged


def _start_record(resolved: dict[str, Any], checkpoint: Path | None, step: int, digests: list[str],
                  device: torch.device) -> dict[str, Any]:
    from harts import engine_memory
    from harts.tracking.records import environment

    data = {"num_steps": len(digests), "sha256": hashlib.sha256("\n".join(digests).encode()).hexdigest()}
    return {"event": "start", "resumed_from": checkpoint.name if checkpoint else None, "step": step,
            "torch_threads": torch.get_num_threads(), "config": resolved, "data": data,
            "device_memory_bytes": engine_memory.device_memory_bytes(device), "environment": environment()}


def _write(log, record: dict[str, Any]) -> None:
    """Append one record. A full disk can leave the line torn: a resume removes an unreadable last line."""
    try:
        line = memoryview((json.dumps(record, allow_nan=False) + "\n").encode())
        while line:  # an unbuffered write may take part of the line (then the next one reports the full disk)
            line = line[log.write(line):]
    except OSError as error:
        raise OSError(f"{log.name}: could not write ({error.strerror or error})") from None
