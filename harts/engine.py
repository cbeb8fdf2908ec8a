"""The execution engine under the command lines, trainers and the library: a model and how it runs a step.

`Engine(model, config)` holds a model and its `StepConfig` (harts.config.execution's knobs resolved for a device,
and the loss; `Engine.build` makes one from an `ExecutionConfig`), and on the ranks of a parallel configuration the
model's cut for this rank (`parallel`: harts.parallel.parallelize's `ParallelModel`; `parallel_train_step` is the
rank program of `harts train-step --parallel`). Before it runs the model, the config's
experts_backend (when it names one) is set on the model's MoE layers, whatever the model's config says. It answers
at three grains:
- a step: `plan(step)` plans the microbatches with the config's planner and capacity, for the parallel config's DP
  degree (`PlannedStep`: the plan, each microbatch's members in the step's batch order, the prefix index and the
  planning seconds; `plan_step` without a model); `run(step, planned)` runs one training step over them (layouts,
  forward, loss, backward: gradients accumulate in the model): `run_step` in one process (`StepResult`),
  `run_parallel_step` on the ranks (`ParallelStepResult`, gradients reduced); `run_microbatches` over members
  given by hand (a benchmark's one microbatch, a slot alone);
- a microbatch: `layout(step, members)` its rows; `forward_microbatch` its log-probs (and entropy) through the
  compact LM head with its MoE losses, for a caller that owns the loss (harts.api, verl's engine), refusing a
  layout over a given capacity (`OverCapacity`); `forward(layout)` the model alone (final hidden states, MoE
  auxes); `balance_counts` the routing of a forward without gradients of each microbatch; all three in one process
  (on a rank's cut of the model they are refused: its rows, blocks or experts are a part);
- memory: `fit_recompute_blocks` is the search of recompute_blocks `auto` (harts.engine_memory: the fewest recomputed
  blocks whose untimed step peaks at most the device's memory less the config's memory_margin); an engine built with
  auto recomputes every block until it has searched (`search_pending`), and `search_reason` says when a step must be
  searched on (again) before it runs: not searched yet, or a microbatch that the searched steps' microbatches do not
  cover (`unsearched_extent`); `search_if_needed` searches then.
`harts train-step`, `harts train`, `harts rl`, `harts bench speedup` and `harts bench fidelity`, `harts.api` and
the verl engine run through it, `harts verify` plans through it (its comparisons are harts.objective.verify's and
harts.parallel.verify's, the layers' checks of their steps); tests/test_engine_bypass.py fails on a module that
calls a step's building blocks around it. What stays in training/ and rl/ is the optimizer, the schedule and the
logging.
Tested in tests/test_engine.py: a planned and run step equals `run_step` over the same members, the plan honours the
config's planner and capacity, a microbatch's outputs are `microbatch_logprobs`' on `build_layout`'s rows, and the
search sets the blocks it finds (against fake probes; tests/test_engine_memory.py tests the search itself); on
gloo ranks (tests/parallel/test_engine.py) a run is `run_parallel_step`'s. Legend: S the step's semantic positions,
S_mb a microbatch's, R a layout's rows, D the hidden size.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from harts import engine_memory
from harts.config.execution import AUTO, ExecutionConfig
from harts.model.config import ModelConfig
from harts.model.model import HybridModel, unwrap_model
from harts.objective.losses import LossConfig
from harts.objective.step import (
    StepConfig,
    StepResult,
    autocast_context,
    build_layout,
    microbatch_extent,
    microbatch_logprobs,
    run_step,
    semantic_index,
    step_config,
)
from harts.objective.targets import semantic_targets_from_step
from harts.parallel.groups import ParallelGroups
from harts.parallel.model import ParallelModel, parallelize
from harts.parallel.step import ParallelStepResult, run_parallel_step
from harts.planning.microbatch import plan
from harts.planning.plans import Plan
from harts.runtime.layout import Layout
from harts.trees.step import Step
from harts.trees.trie import PrefixIndex


@dataclass
class PlannedStep:
    """A step's microbatches as planned."""

    plan: Plan
    microbatches: list[np.ndarray]
    """Each microbatch's members: int64 indices into the step's batch order, in the plan's (slot, replica) order."""
    index: PrefixIndex
    seconds: float
    """Wall time of the prefix index (when built here), the planner and the members."""

    @property
    def num_microbatches(self) -> int:
        """Microbatches with at least one trajectory."""
        return len([m for m in self.microbatches if len(m)])


@dataclass(eq=False)
class MicrobatchOutputs:
    """One microbatch through the model and the compact LM head (`Engine.forward_microbatch`); S_mb: its semantic
    positions, in `semantic_index` order (its members' positions, member by member)."""

    layout: Layout
    """Its rows, on the model's device."""
    semantic_index: np.ndarray
    """int64 [S_mb]: the step's semantic positions of the microbatch."""
    logprobs_S: torch.Tensor
    """fp32 [S_mb] λ at the temperature asked for."""
    entropy_S: torch.Tensor | None
    """fp32 [S_mb]: the entropy of each predicting distribution (when asked for)."""
    moe_loss: torch.Tensor
    """The model's MoE losses of this forward, summed over its MoE layers (each its rows' mean)."""
    auxes: list
    """Per MoE layer, its `harts.model.moe.MoEAux` (losses, q-weighted routed counts, load-balancing counts)."""

    @property
    def num_rows(self) -> int:
        return self.layout.num_rows


class OverCapacity(ValueError):
    """A microbatch with more rows than the capacity it was to run under (`Engine.forward_microbatch`)."""

    def __init__(self, step: Step, num_rows: int, capacity: int, execution: str) -> None:
        super().__init__(f"{step.source}: {num_rows:,} rows ({execution} execution) in one microbatch, more than the "
                         f"capacity {capacity:,}")
        self.num_rows, self.capacity = num_rows, capacity


def plan_step(step: Step, config: ExecutionConfig, *, index: PrefixIndex | None = None, dp: int = 1) -> PlannedStep:
    """The step planned with the config's planner (resolved: not None) and capacity for `dp` replicas (`index`: the
    step's prefix index, built here when not given). Needs no model: a parallel run plans in the launching process."""
    assert config.planner is not None, "plan_step takes a resolved config"
    start = time.perf_counter()
    index = PrefixIndex.from_step(step) if index is None else index
    planned = plan(step, config.capacity, dp, planner=config.planner, index=index)
    members = planned.members(step)
    return PlannedStep(plan=planned, microbatches=members, index=index, seconds=time.perf_counter() - start)


class Engine:
    """A model and its step config, in one process or on one rank of a parallel configuration: plans and runs
    training steps and microbatches (module docstring)."""

    def __init__(self, model: torch.nn.Module, config: StepConfig, *, parallel: ParallelModel | None = None,
                 search_pending: bool = False) -> None:
        assert parallel is None or parallel.model is model, "a parallel engine holds its ParallelModel's model"
        self.model = model
        """The model as given: a HybridModel, or a wrapper of one (DistributedDataParallel, fully_shard,
        torch.compile) for the microbatch methods."""
        self.config = config
        self.parallel = parallel
        """This rank's cut of the model (harts.parallel.parallelize); None in one process."""
        self.search_pending = search_pending
        """recompute_blocks auto, not yet searched: `fit_recompute_blocks` finds them (until then every block)."""
        self.searched_extents: list[tuple[int, int, int]] = []
        """The `microbatch_extent` of every microbatch of the steps `fit_recompute_blocks` searched on."""
        self._select_experts()

    @classmethod
    def build(cls, model: torch.nn.Module, knobs: ExecutionConfig, device: str, *,
              loss_config: LossConfig | None = None, **fields) -> Engine:
        """The engine of `knobs` resolved for `device` (`harts.objective.step.step_config`: `loss_config` and
        `fields`, e.g. `execution`, replace the config's); recompute_blocks auto stands for every block of the model
        until `fit_recompute_blocks` (`search_pending`)."""
        pending = knobs.recompute_blocks == AUTO and "recompute_blocks" not in fields
        if pending:
            fields = {**fields, "recompute_blocks": len(unwrap_model(model).blocks)}
        return cls(model, step_config(knobs, device, loss_config=loss_config, **fields), search_pending=pending)

    def _select_experts(self) -> None:
        """The config's experts_backend, when it names one, on the model's MoE layers: the knob is the execution's,
        the backend a layer attribute (`HybridModel.set_experts_backend`). Set again before every run, since engines
        of different configs may share a model."""
        backend = self.config.experts_backend
        model = unwrap_model(self.model)
        if backend is not None and model.config.moe.experts_backend != backend:
            model.set_experts_backend(backend)

    @property
    def device(self) -> torch.device:
        """Where the model's parameters are (and where it runs)."""
        return next(self.model.parameters()).device

    # Steps

    def plan(self, step: Step, *, index: PrefixIndex | None = None, dp: int | None = None) -> PlannedStep:
        """`plan_step` with this engine's config, for `dp` replicas (default: the parallel config's DP degree, 1 in
        one process)."""
        if dp is None:
            dp = 1 if self.parallel is None else self.parallel.groups.config.dp
        return plan_step(step, self.config, index=index, dp=dp)

    def run(self, step: Step, planned: PlannedStep | None = None, *, backward: bool = True,
            collect_logprobs: bool = False, progress: str | None = None) -> StepResult | ParallelStepResult:
        """One training step over `planned` (default: `plan(step)`): gradients accumulate in the model's
        parameters (zero them before, step the optimizer after; on the ranks, reduced over them); without
        `backward`, the forward and the loss only (a reference model's log-probs, with `collect_logprobs`: on global
        rank 0 under a parallel config); with `progress`, a progress bar of that name over the microbatches (one
        process). Call it on every rank with the same arguments under a parallel config."""
        planned = self.plan(step) if planned is None else planned
        return self.run_microbatches(step, planned.microbatches, index=planned.index, backward=backward,
                                     collect_logprobs=collect_logprobs, progress=progress)

    def run_microbatches(self, step: Step, microbatches: list[np.ndarray], *, index: PrefixIndex | None = None,
                         backward: bool = True, collect_logprobs: bool = False,
                         progress: str | None = None) -> StepResult | ParallelStepResult:
        """`run` over microbatches given by hand (each an int64 array of trajectories in the step's batch order,
        together covering the step once; under a parallel config K = S·D of them in (slot, replica) order, none
        empty): a benchmark's one microbatch alone, or its warm-up."""
        self._select_experts()
        if self.parallel is not None:
            return run_parallel_step(self.parallel, step, microbatches, self.config, index=index, backward=backward,
                                     collect=collect_logprobs)
        return run_step(self.model, step, microbatches, self.config, index=index, backward=backward,
                        collect_logprobs=collect_logprobs, progress=progress)

    # Microbatches

    def layout(self, step: Step, members: np.ndarray, index: PrefixIndex | None = None, *,
               attention_splits: list[np.ndarray] | None = None) -> Layout:
        """The rows of the config's execution for the trajectories `members` of the step, on the host (`index`: the
        step's prefix index, built here for the compact execution when not given; `attention_splits`, baseline
        only: `harts.objective.step.build_layout`)."""
        if index is None and self.config.execution == "compact":
            index = PrefixIndex.from_step(step)
        return build_layout(step, np.asarray(members, dtype=np.int64), self.model, self.config, index,
                            attention_splits=attention_splits)

    def _in_one_process(self, method: str) -> None:
        """The microbatch grain runs the whole model in this process: on a rank's cut of it (sharded rows, a pipeline
        stage's blocks, a share of the experts) its outputs, auxes and counts would be a part, or wrong."""
        if self.parallel is not None:
            raise ValueError(f"Engine.{method} runs the model in one process, not on the ranks of parallel config "
                             f"{self.parallel.groups.config.name!r} (run the step: Engine.run)")

    def forward(self, layout: Layout) -> tuple[torch.Tensor, list]:
        """The model alone over a layout's rows (on the model's device) in the config's dtype, without recomputation
        and without the LM head: (final hidden states [R, D], per MoE layer its aux). Gradients flow unless called
        under `torch.no_grad()`. In one process only, as `forward_microbatch` and `balance_counts`."""
        self._in_one_process("forward")
        self._select_experts()
        with autocast_context(self.device, self.config):
            return self.model(layout.input_ids, layout)

    def forward_microbatch(self, step: Step, members: np.ndarray, targets_S: torch.Tensor | np.ndarray | None = None,
                           *, index: PrefixIndex | None = None, temperature: float = 1.0,
                           return_entropy: bool = False, capacity: int | None = None) -> MicrobatchOutputs:
        """One microbatch (`members`: its trajectories) through the model and the compact LM head
        (`harts.objective.step.microbatch_logprobs`): the log-probs of the targets at `temperature` (and the
        entropies), with the MoE losses and auxes; differentiable unless called under `torch.no_grad()`.

        `targets_S`: int64 [S] the next token of every semantic position of the step in batch order, a tensor on any
        device or an array (default: the step's own, `semantic_targets_from_step`); `capacity`: `OverCapacity` for a
        layout of more rows, before the model runs."""
        self._in_one_process("forward_microbatch")
        self._select_experts()
        members = np.asarray(members, dtype=np.int64)
        layout = self.layout(step, members, index)
        if capacity is not None and layout.num_rows > capacity:
            raise OverCapacity(step, layout.num_rows, capacity, self.config.execution)
        device = self.device
        layout = layout.to(device)
        sem_index = semantic_index(step, members)
        if targets_S is None:
            targets_S = semantic_targets_from_step(step).targets
        if isinstance(targets_S, np.ndarray):
            targets = torch.from_numpy(targets_S[sem_index]).to(device)
        else:
            targets = targets_S[torch.from_numpy(sem_index).to(targets_S.device)].to(device)
        logprobs_S, entropy_S, moe, auxes = microbatch_logprobs(
            self.model, layout, targets, self.config, device, temperature=temperature, return_entropy=return_entropy,
        )
        return MicrobatchOutputs(layout=layout, semantic_index=sem_index, logprobs_S=logprobs_S, entropy_S=entropy_S,
                                 moe_loss=moe, auxes=auxes)

    @torch.no_grad()
    def balance_counts(self, step: Step, microbatches: list[np.ndarray], *,
                       index: PrefixIndex | None = None) -> list[torch.Tensor]:
        """Per MoE layer of the model, the load-balancing assignment counts of a forward without gradients of each
        microbatch (`forward`: the routing of a training forward of the same rows and weights), summed, in the
        parameters' dtype promoted to fp32 at least; zeros without microbatches. The model's MoE layers must report
        them (`moe.aux_loss_coeff` > 0 or `moe.balance_statistics`)."""
        self._in_one_process("balance_counts")
        moe = unwrap_model(self.model).config.moe
        if not (moe.aux_loss_coeff > 0 or moe.balance_statistics):
            raise ValueError("Engine.balance_counts: the model's MoE layers do not report their load-balancing counts "
                             "(moe.aux_loss_coeff is 0 and moe.balance_statistics is off)")
        parameter = next(self.model.parameters())
        counts = [torch.zeros(block.mlp.config.num_experts, dtype=torch.promote_types(parameter.dtype, torch.float32),
                              device=parameter.device) for block in unwrap_model(self.model).blocks if block.is_moe]
        for members in microbatches:
            _, auxes = self.forward(self.layout(step, members, index).to(parameter.device))
            counts = [total + aux.balance_counts_E.to(total.dtype) for total, aux in zip(counts, auxes, strict=True)]
        return counts

    # Memory

    def probe(self, step: Step, planned: PlannedStep, recompute_blocks: int | None) -> dict[str, Any]:
        """One untimed step of `planned` with `recompute_blocks` recomputed (`engine_memory.probe_step`: whether
        it ran in the device's memory, its peak and seconds); the model's gradients are freed after it."""
        config = replace(self.config, recompute_blocks=recompute_blocks)
        self._select_experts()
        answer = engine_memory.probe_step(
            lambda: run_step(self.model, step, planned.microbatches, config, index=planned.index), self.device,
            self.model)
        return {"recompute_blocks": recompute_blocks, **answer}

    def fit_recompute_blocks(self, step: Step, planned: PlannedStep | None = None, *, reserved_bytes: int = 0,
                             within_bytes: int | None = None, within: str = "a given peak",
                             on_probe: Callable[[int], None] | None = None) -> dict[str, Any]:
        """Set this engine's recompute_blocks to the fewest with which a step of `planned` (default: `plan(step)`)
        runs on the model's device and peaks at most its total memory less the config's memory_margin of it and
        less `reserved_bytes` (what the caller will hold that a probe does not: an optimizer's state not yet
        allocated), and at most `within_bytes` where given (`within` names it in the error); return the search's
        record (`engine_memory.fit_recompute_blocks`: the blocks, the limit's terms, every `probe`).
        `on_probe(n)` runs before the probe of n blocks. A search after an earlier one (for a step with a microbatch
        outside the searched ones: `unsearched_extent`) tries the blocks found first and bisects above them only, so
        they never decrease and the steps searched before still fit. ValueError on a device without a total (the
        CPU's) and under a parallel config (one process searches)."""
        if self.parallel is not None:
            raise ValueError(f"recompute_blocks {AUTO} is searched in one process, not under a parallel config")
        planned = self.plan(step) if planned is None else planned
        device = self.device
        total = engine_memory.device_memory_bytes(device)
        if total is None:
            raise ValueError(f"recompute_blocks {AUTO} searches a GPU's memory: the model is on {device}")

        def probe(n: int) -> dict[str, Any]:
            if on_probe is not None:
                on_probe(n)
            return self.probe(step, planned, n)

        extents = self.extents(step, planned)
        search = engine_memory.fit_recompute_blocks(
            probe, len(unwrap_model(self.model).blocks), device_memory_bytes=total,
            memory_margin=self.config.memory_margin, reserved_bytes=reserved_bytes, within_bytes=within_bytes,
            within=within, at_least=self.config.recompute_blocks if self.searched_extents else None)
        self.config = replace(self.config, recompute_blocks=search["recompute_blocks"])
        self.search_pending = False
        self.searched_extents += extents
        return {**search, "extents": [list(extent) for extent in extents]}

    def extents(self, step: Step, planned: PlannedStep) -> list[tuple[int, int, int]]:
        """Each microbatch's `microbatch_extent` (what its kept activations scale with: rows, KDA rows, key/value
        rows), from its host layout."""
        return [microbatch_extent(self.layout(step, members, planned.index))
                for members in planned.microbatches if len(members)]

    def search_reason(self, step: Step, planned: PlannedStep) -> str | None:
        """Why recompute_blocks auto searches on `planned` before running it: not searched yet (`search_pending`),
        or a microbatch that no microbatch searched on covers (`unsearched_extent`: the blocks found might not hold
        it); None: no search (a number of blocks, or every microbatch covered)."""
        if self.search_pending:
            return "not searched yet"
        extent = self.unsearched_extent(step, planned)
        if extent is None:
            return None
        rows, kda_rows, kv_rows = extent
        return (f"a microbatch of {rows} rows, {kda_rows} KDA rows and {kv_rows} key/value rows that no microbatch "
                "searched on covers")

    def search_if_needed(self, step: Step, planned: PlannedStep, *, reserved_bytes: int = 0) -> dict[str, Any] | None:
        """`fit_recompute_blocks` on `planned` when `search_reason` gives a reason, and its record with that `reason`
        first; None otherwise (the loops of harts train and harts rl call it before each step)."""
        reason = self.search_reason(step, planned)
        if reason is None:
            return None
        return {"reason": reason, **self.fit_recompute_blocks(step, planned, reserved_bytes=reserved_bytes)}

    def unsearched_extent(self, step: Step, planned: PlannedStep) -> tuple[int, int, int] | None:
        """After `fit_recompute_blocks`: the extent of the first microbatch of `planned` that no single microbatch
        searched on covers (at least as large in rows, KDA rows and key/value rows alike: its kept activations may
        need more memory than any probe measured, so search again on this step), None when each is covered or
        nothing was searched."""
        if not self.searched_extents:
            return None
        for extent in self.extents(step, planned):
            if not any(all(mine <= theirs for mine, theirs in zip(extent, searched))
                       for searched in self.searched_extents):
                return extent
        return None


def parallel_engine(groups: ParallelGroups, model_config: ModelConfig, seed: int, config: StepConfig) -> Engine:
    """On one rank of `groups`: the model of `model_config` initialised with `seed` (alike on every rank), cut for
    this rank (harts.parallel.parallelize), and its engine."""
    model = HybridModel(model_config).to(groups.device)
    model.init_weights(seed)
    return Engine(model, config, parallel=parallelize(model, groups))


def parallel_train_step(groups: ParallelGroups, model_config: ModelConfig, seed: int, step: Step,
                        microbatches: list[np.ndarray], config: StepConfig) -> ParallelStepResult:
    """The rank program of `harts train-step --parallel` (harts.parallel.launch runs it on every rank): one step of
    the planned microbatches through `parallel_engine`."""
    return parallel_engine(groups, model_config, seed, config).run_microbatches(step, microbatches)
