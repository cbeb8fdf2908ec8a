"""The execution engine under the command lines and trainers: a model and how it runs a step.

`Engine(model, config)` holds a model and its `StepConfig` (harts.config.execution's knobs resolved for a device,
and the loss; `Engine.build` makes one from an `ExecutionConfig`). `plan(step)` plans the step's microbatches
with the config's planner and capacity (`PlannedStep`: the plan, each microbatch's members in the step's batch
order, the prefix index and the planning seconds; `plan_step` without a model); `run(step, planned)` runs one
training step over them (layouts, forward, loss, backward: gradients accumulate in the model) and returns its
`StepResult` (`run_microbatches`: over members given by hand, e.g. one microbatch alone). `fit_recompute_blocks`
is the search of recompute_blocks `auto` (harts.engine_memory: the fewest recomputed blocks whose untimed step peaks
at most the device's memory less the config's memory_margin); an engine built with auto recomputes every block
until it has searched (`search_pending`). `harts train-step` and `harts verify`, `harts train`, `harts rl`,
`harts bench speedup` and `harts bench fidelity` run through it; what stays in training/ and rl/ is the
optimizer, the schedule and the logging. Tested in tests/test_engine.py: a planned and run step equals `run_step`
over the same members, the plan honours the config's planner and capacity, and the search sets the blocks it
finds (against fake probes; tests/test_engine_memory.py tests the search itself).
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
from harts.model.model import unwrap_model
from harts.objective.losses import LossConfig
from harts.objective.step import StepConfig, StepResult, run_step, step_config
from harts.planning.microbatch import plan
from harts.planning.plans import Plan
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
    """A model and its step config: plans and runs training steps (module docstring)."""

    def __init__(self, model: torch.nn.Module, config: StepConfig, *, search_pending: bool = False) -> None:
        self.model = model
        self.config = config
        self.search_pending = search_pending
        """recompute_blocks auto, not yet searched: `fit_recompute_blocks` finds them (until then every block)."""

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

    def plan(self, step: Step, *, index: PrefixIndex | None = None, dp: int = 1) -> PlannedStep:
        """`plan_step` with this engine's config."""
        return plan_step(step, self.config, index=index, dp=dp)

    def run(self, step: Step, planned: PlannedStep | None = None, *, backward: bool = True,
            collect_logprobs: bool = False, progress: str | None = None) -> StepResult:
        """One training step over `planned` (default: `plan(step)`): gradients accumulate in the model's
        parameters (zero them before, step the optimizer after); without `backward`, the forward and the loss
        only (a reference model's log-probs, with `collect_logprobs`); with `progress`, a progress bar of that name
        over the microbatches."""
        planned = self.plan(step) if planned is None else planned
        return self.run_microbatches(step, planned.microbatches, index=planned.index, backward=backward,
                                     collect_logprobs=collect_logprobs, progress=progress)

    def run_microbatches(self, step: Step, microbatches: list[np.ndarray], *, index: PrefixIndex | None = None,
                         backward: bool = True, collect_logprobs: bool = False,
                         progress: str | None = None) -> StepResult:
        """`run` over microbatches given by hand (each an int64 array of trajectories in the step's batch order,
        together covering the step once): a benchmark's one microbatch alone, or its warm-up."""
        return run_step(self.model, step, microbatches, self.config, index=index, backward=backward,
                        collect_logprobs=collect_logprobs, progress=progress)

    def probe(self, step: Step, planned: PlannedStep, recompute_blocks: int | None) -> dict[str, Any]:
        """One untimed step of `planned` with `recompute_blocks` recomputed (`engine_memory.probe_step`: whether
        it ran in the device's memory, its peak and seconds); the model's gradients are freed after it."""
        config = replace(self.config, recompute_blocks=recompute_blocks)
        device = next(self.model.parameters()).device
        answer = engine_memory.probe_step(
            lambda: run_step(self.model, step, planned.microbatches, config, index=planned.index), device, self.model)
        return {"recompute_blocks": recompute_blocks, **answer}

    def fit_recompute_blocks(self, step: Step, planned: PlannedStep | None = None, *, reserved_bytes: int = 0,
                             within_bytes: int | None = None, within: str = "a given peak",
                             on_probe: Callable[[int], None] | None = None) -> dict[str, Any]:
        """Set this engine's recompute_blocks to the fewest with which a step of `planned` (default: `plan(step)`)
        runs on the model's device and peaks at most its total memory less the config's memory_margin of it and
        less `reserved_bytes` (what the caller will hold that a probe does not: an optimizer's state not yet
        allocated), and at most `within_bytes` where given (`within` names it in the error); return the search's
        record (`engine_memory.fit_recompute_blocks`: the blocks, the limit's terms, every `probe`).
        `on_probe(n)` runs before the probe of n blocks. ValueError on a device without a total (the CPU's)."""
        planned = self.plan(step) if planned is None else planned
        device = next(self.model.parameters()).device
        total = engine_memory.device_memory_bytes(device)
        if total is None:
            raise ValueError(f"recompute_blocks {AUTO} searches a GPU's memory: the model is on {device}")

        def probe(n: int) -> dict[str, Any]:
            if on_probe is not None:
                on_probe(n)
            return self.probe(step, planned, n)

        search = engine_memory.fit_recompute_blocks(
            probe, len(unwrap_model(self.model).blocks), device_memory_bytes=total,
            memory_margin=self.config.memory_margin, reserved_bytes=reserved_bytes, within_bytes=within_bytes,
            within=within)
        self.config = replace(self.config, recompute_blocks=search["recompute_blocks"])
        self.search_pending = False
        return search
