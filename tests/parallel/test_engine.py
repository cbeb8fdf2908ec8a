"""The engine on the ranks of a parallel configuration: `Engine.run` is `run_parallel_step` over its plan.

In this process (a gloo group of one rank): the same loss, log-probs and bitwise the same gradients as
`run_parallel_step` over the same microbatches, both executions, and a forward without backward; the microbatch grain
(one process's) refused. On two spawned
gloo ranks (dp2): the engine plans for the config's two replicas and its step (`parallel_train_step`, the rank
program of `harts train-step --parallel`) has the loss of `run_step` of the plain model over those microbatches.
"""

import numpy as np
import pytest
import torch

from harts.config.execution import ExecutionConfig
from harts.engine import Engine, parallel_engine, parallel_train_step
from harts.model.config import load_model_config
from harts.model.model import HybridModel
from harts.objective.step import run_step, step_config
from harts.parallel.config import load_parallel_config
from harts.parallel.launch import launch
from harts.parallel.model import parallelize
from harts.parallel.step import ParallelStepResult, run_parallel_step
from tests.parallel.helpers import tree_step_and_microbatches

SEED = 7


def _model():
    model = HybridModel(load_model_config("tiny"))
    model.init_weights(SEED)
    return model


def _config(execution: str):
    return step_config(ExecutionConfig(capacity=50), "cpu", execution=execution)


@pytest.mark.parametrize("execution", ["baseline", "compact"])
def test_a_run_is_run_parallel_step_over_the_plan(groups, execution):
    step, _ = tree_step_and_microbatches()
    config = _config(execution)
    model = _model()
    engine = Engine(model, config, parallel=parallelize(model, groups))
    planned = engine.plan(step)
    assert planned.plan.dp == 1 and planned.num_microbatches > 1
    result = engine.run(step, planned, collect_logprobs=True)
    assert isinstance(result, ParallelStepResult)
    reference = parallelize(_model(), groups)
    expected = run_parallel_step(reference, step, planned.microbatches, config, index=planned.index, collect=True)
    assert result.loss == expected.loss and result.num_rows == expected.num_rows
    assert torch.equal(result.logprobs, expected.logprobs)
    grads = dict(reference.named_parameters())
    for name, parameter in engine.parallel.named_parameters():
        assert torch.equal(parameter.grad, grads[name].grad), name
    model.zero_grad(set_to_none=True)
    forward_only = engine.run(step, planned, backward=False)
    assert forward_only.loss == expected.loss and all(p.grad is None for p in model.parameters())


def test_the_memory_search_is_refused_on_ranks(groups):
    model = _model()
    engine = Engine(model, _config("compact"), parallel=parallelize(model, groups))
    with pytest.raises(ValueError, match="searched in one process, not under a parallel config"):
        engine.fit_recompute_blocks(tree_step_and_microbatches()[0])


def test_the_microbatch_grain_is_refused_on_ranks(groups):
    """`forward`, `forward_microbatch` and `balance_counts` run the whole model in one process: on a rank's cut of it
    (sharded rows, a stage's blocks, a share of the experts) each is a ValueError naming the config, before the model
    runs."""
    model = _model()
    engine = Engine(model, _config("compact"), parallel=parallelize(model, groups))
    step, microbatches = tree_step_and_microbatches()
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))
    for method, call in (("forward", lambda: engine.forward(engine.layout(step, microbatches[0]))),
                         ("forward_microbatch", lambda: engine.forward_microbatch(step, microbatches[0])),
                         ("balance_counts", lambda: engine.balance_counts(step, microbatches))):
        with pytest.raises(ValueError, match=rf"Engine.{method} runs the model in one process, not on the ranks of "
                                             r"parallel config 'single'"):
            call()
    assert not calls


def _plan_and_run(groups, step, config):
    engine = parallel_engine(groups, load_model_config("tiny"), SEED, config)
    planned = engine.plan(step)
    result = parallel_train_step(groups, load_model_config("tiny"), SEED, step, planned.microbatches, config)
    assert isinstance(result, ParallelStepResult)
    return planned.plan.dp, planned.microbatches, result.loss, result.num_rows


def test_two_replicas_plan_for_both_and_add_up_to_run_step():
    step, _ = tree_step_and_microbatches()
    config = _config("compact")
    dp, microbatches, loss, rows = launch(_plan_and_run, load_parallel_config("dp2"), step, config)
    assert dp == 2 and len(microbatches) % 2 == 0 and len(microbatches) > 2
    expected = run_step(_model(), step, microbatches, config)
    assert loss == pytest.approx(expected.loss, rel=1e-6) and rows == expected.num_rows
    assert np.array_equal(np.sort(np.concatenate(microbatches)), np.arange(step.num_trajectories))
