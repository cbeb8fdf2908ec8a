"""`run_step` with `StepConfig.pooled_balance_coeff`: transformers' pooled load-balancing loss of each microbatch.

The reference is written out in the test: each microbatch's rows through the model (`build_layout`, the model's
forward), `pooled_load_balancing_loss` of its MoE layers' statistics (tests/test_api_pooled_balance.py checks that
function against transformers' own `load_balancing_loss_func`), coefficient × their mean over microbatches added to
the step without it. gdn-tiny (softmax routing, three MoE layers) with `moe.balance_statistics` and its router
weights scaled up; both executions, 1 and 3 microbatches, fp32: the loss, MoE loss and pooled loss within 1e-6
relative, every parameter gradient within 1e-5 relative. A model that cannot give the loss (sigmoid routing, no
statistics, MTP layers running) is refused by name before any forward; a bad coefficient by StepConfig.
"""

from dataclasses import replace

import numpy as np
import pytest

from harts.model.config import MTPConfig, load_model_config
from harts.model.moe import pooled_load_balancing_loss
from harts.objective.step import StepConfig, build_layout, run_step
from harts.trees.trie import PrefixIndex
from tests.model.helpers import sharp_router_model
from tests.objective.helpers import random_tree_step

COEFF = 0.5


def _model(config=None):
    if config is None:
        config = load_model_config("gdn-tiny")
        config = replace(config, moe=replace(config.moe, balance_statistics=True))
    return sharp_router_model(config, seed=3)


def _step_and_microbatches(num_microbatches: int):
    step = random_tree_step(np.random.default_rng(11), num=6, max_len=40, vocab=5).step
    return step, [np.sort(part) for part in np.array_split(np.arange(6), num_microbatches)]


def _grads(model):
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("num_microbatches", [1, 3], ids=["1mb", "3mb"])
@pytest.mark.parametrize("execution", ["baseline", "compact"])
def test_run_step_adds_each_microbatch_pooled_loss(execution, num_microbatches):
    model = _model()
    step, microbatches = _step_and_microbatches(num_microbatches)
    config = StepConfig(execution=execution)
    without = run_step(model, step, microbatches, config)
    index = PrefixIndex.from_step(step)
    pooled = []
    for members in microbatches:
        layout = build_layout(step, members, model, config, index)
        _, auxes = model(layout.input_ids, layout)
        pooled.append(pooled_load_balancing_loss(auxes))
    (COEFF * sum(pooled) / num_microbatches).backward()
    want_grads = _grads(model)
    mean = float(sum(pooled).detach()) / num_microbatches

    result = run_step(model, step, microbatches, replace(config, pooled_balance_coeff=COEFF))
    assert without.pooled_balance_loss is None and mean > 2.1  # top-2: 2 when balanced
    assert result.pooled_balance_loss == pytest.approx(mean, rel=1e-6)
    assert result.moe_loss == pytest.approx(without.moe_loss + COEFF * mean, rel=1e-6)
    assert result.loss == pytest.approx(without.loss + COEFF * mean, rel=1e-6)
    got_grads = _grads(model)
    for name, grad in got_grads.items():
        want = want_grads[name]
        error = float((grad - want).norm() / want.norm().clamp(min=1e-30))
        assert error <= 1e-5, (name, error)


def _softmax_tiny(**moe):
    config = load_model_config("tiny")
    return replace(config, moe=replace(config.moe, score_function="softmax", expert_bias=False, **moe))


REFUSED = {
    "sigmoid": (lambda: load_model_config("tiny"),
                "transformers' load-balancing loss is the softmax one; the model routes with sigmoid scores"),
    "no-statistics": (lambda: _softmax_tiny(aux_loss_coeff=0.0),
                      "its MoE layers do not report their load-balancing statistics"),
    "mtp": (lambda: replace(_softmax_tiny(balance_statistics=True), mtp=MTPConfig(num_layers=1)),
            "its MTP layers run in this step"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_model_that_cannot_give_the_pooled_loss_is_refused_before_running(case):
    make, message = REFUSED[case]
    model = _model(make())
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))
    step, microbatches = _step_and_microbatches(2)
    with pytest.raises(ValueError, match=rf"run_step: pooled_balance_coeff 0.5 on model '\w+': {message}"):
        run_step(model, step, microbatches, StepConfig(pooled_balance_coeff=COEFF))
    assert not calls


def test_the_refusals_are_the_pooled_loss_s_only():
    """The same models run without the coefficient, and the statistics come from the layers' own load-balancing
    loss when it is on (softmax tiny with its aux_loss_coeff, no balance_statistics)."""
    step, microbatches = _step_and_microbatches(2)
    for make, _ in REFUSED.values():
        run_step(_model(make()), step, microbatches, StepConfig(), backward=False)
    result = run_step(_model(_softmax_tiny()), step, microbatches, StepConfig(pooled_balance_coeff=COEFF),
                      backward=False)
    assert result.pooled_balance_loss > 0


@pytest.mark.parametrize("coeff", [-0.1, float("nan"), float("inf"), True, "0.1"])
def test_a_bad_coefficient_is_refused(coeff):
    with pytest.raises(ValueError, match="pooled_balance_coeff must be a finite number >= 0"):
        StepConfig(pooled_balance_coeff=coeff)
