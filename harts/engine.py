"""The execution engine under the command lines and trainers: a model and how it runs a step.

`Engine(model, config)` holds a model and its `StepConfig` (harts.config.execution's knobs resolved for a device,
and the loss; `Engine.build` makes one from an `ExecutionConfig`). `plan(step)` plans the step's microbatches
with the config's planner and capacity (`PlannedStep`: the plan, each microbatch's members in the step's batch
order, the prefix index and the planning seconds; `plan_step` without a model); `run(step, planned)` runs one
training step over them (layouts, forward, loss, backward: gradients accumulate in the model) and returns its
`StepResult`. `harts train-step` and `harts verify`, `harts train`, `harts rl` and `harts bench fidelity` run
through it; what stays in training/ and rl/ is the optimizer, the schedule and the logging. Tested in
tests/test_engine.py: a planned and run step equals `run_step` over the same members, and the plan honours the
config's planner and capacity.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from harts.config.execution import ExecutionConfig
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

    def __init__(self, model: torch.nn.Module, config: StepConfig) -> None:
        self.model = model
        self.config = config

    @classmethod
    def build(cls, model: torch.nn.Module, knobs: ExecutionConfig, device: str, *,
              loss_config: LossConfig | None = None, **fields) -> Engine:
        """The engine of `knobs` resolved for `device` (`harts.objective.step.step_config`: `loss_config` and
        `fields`, e.g. `execution`, replace the config's)."""
        return cls(model, step_config(knobs, device, loss_config=loss_config, **fields))

    def plan(self, step: Step, *, index: PrefixIndex | None = None, dp: int = 1) -> PlannedStep:
        """`plan_step` with this engine's config."""
        return plan_step(step, self.config, index=index, dp=dp)

    def run(self, step: Step, planned: PlannedStep | None = None, *, backward: bool = True,
            collect_logprobs: bool = False) -> StepResult:
        """One training step over `planned` (default: `plan(step)`): gradients accumulate in the model's
        parameters (zero them before, step the optimizer after); without `backward`, the forward and the loss
        only (a reference model's log-probs, with `collect_logprobs`)."""
        planned = self.plan(step) if planned is None else planned
        return run_step(self.model, step, planned.microbatches, self.config, index=planned.index, backward=backward,
                        collect_logprobs=collect_logprobs)
