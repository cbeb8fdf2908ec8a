"""The engine: a planned step's members are the plan's trajectories in the step's batch order, the plan follows the
config's planner and capacity, and a step run through the engine is `run_step` over the same members (the same
loss and gradients, bitwise: the same calls in the same order)."""

import numpy as np
import pytest
import torch

from harts.config.execution import ExecutionConfig
from harts.engine import Engine, plan_step
from harts.model.config import load_model_config
from harts.model.model import HybridModel
from harts.objective.step import run_step
from harts.trees.io import read_step
from tests.fixtures import one_thread  # noqa: F401

STEP = "data/samples/tiny-step.jsonl.gz"


@pytest.fixture(scope="module")
def step():
    return read_step(STEP, vocab_size=256)


@pytest.mark.parametrize("execution, planner, capacity", [
    ("compact", None, 1024), ("baseline", None, 1024), ("compact", "greedy-trie", 512), ("compact", "harts", 300),
], ids=["compact-default", "baseline-default", "greedy-trie", "small-capacity"])
def test_plan_follows_the_config_and_covers_the_step(step, execution, planner, capacity):
    config = ExecutionConfig(planner=planner, capacity=capacity).resolved("cpu", execution)
    planned = plan_step(step, config)
    assert planned.plan.planner == (planner or ("harts" if execution == "compact" else "per-trajectory"))
    assert planned.plan.capacity == capacity
    members = np.sort(np.concatenate(planned.microbatches))
    assert members.tolist() == list(range(step.num_trajectories))
    for microbatch, members_of in zip(planned.plan.microbatches, planned.microbatches):
        assert [step.ids[k] for k in members_of] == list(microbatch.trajectory_ids)
        assert members_of.dtype == np.int64
    assert planned.num_microbatches == len([m for m in planned.microbatches if len(m)])


def test_plan_keeps_empty_microbatches_of_idle_replicas(step):
    config = ExecutionConfig(capacity=100_000).resolved("cpu", "compact")
    planned = plan_step(step, config, dp=16)  # more replicas than the step's 10 trajectories
    assert len(planned.microbatches) % 16 == 0 and planned.num_microbatches < len(planned.microbatches)


def test_a_run_is_run_step_over_the_planned_members(step):
    torch.manual_seed(0)
    model = HybridModel(load_model_config("tiny"))
    model.init_weights(0)
    engine = Engine.build(model, ExecutionConfig(capacity=300), "cpu", execution="compact")
    planned = engine.plan(step)
    assert planned.num_microbatches > 1
    result = engine.run(step, planned)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    expected = run_step(model, step, planned.microbatches, engine.config, index=planned.index)
    assert result.loss == expected.loss and result.num_rows == expected.num_rows
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    model.zero_grad()
    forward_only = engine.run(step, planned, backward=False)
    assert forward_only.loss == expected.loss and all(p.grad is None for p in model.parameters())
