"""harts.api with `StepConfig.pooled_balance_coeff`: the pooled load-balancing loss in a planned step and a micro-batch.

The reference is written out by hand from `api.policy_loss` per microbatch: each of the plan's microbatches cut out
of the batch (its rows of the padded batch), its policy loss with the step's normaliser, plus c × its pooled loss
(`pooled_balance=True`: transformers' loss of the microbatch, tests/test_api_pooled_balance.py checks it against
transformers' own function) ÷ K, K the plan's microbatches over all replicas; with the model's own MoE losses on,
the step without the coefficient plus those terms. `policy_step` must give that loss, its parts and every gradient
(fp32 on the CPU: the loss within 1e-6 relative, each parameter gradient within 1e-5 relative); two replicas add up
to it; `policy_loss` with the coefficient and the step's normaliser and micro-batch count adds up to `run_step`
with it (tests/objective/test_step_pooled_balance.py's reference). The model: gdn-tiny (softmax routing, three MoE
layers of 4 experts, top-2) with `moe.balance_statistics` and its router weights scaled up, so that routing is far
from uniform. A model that cannot give the loss is refused before any forward.
"""

import dataclasses

import numpy as np
import pytest
import torch

from harts import api
from harts.model.config import load_model_config
from harts.model.model import HybridModel
from harts.objective.step import run_step, step_normalizer
from harts.objective.targets import semantic_targets_from_step
from tests.fixtures import one_thread  # noqa: F401  (autouse fixture)
from tests.model.helpers import sharp_router_model
from tests.test_api import CAPACITIES, LOSSES, case_data, make_batch, relative_gradient_error

COEFF = 0.5


def pooled_model(own_moe_losses: bool):
    """gdn-tiny with balance statistics, sharp routing; its own load-balancing and z-losses on or off."""
    config = load_model_config("gdn-tiny")
    coeffs = dict(aux_loss_coeff=0.5, z_loss_coeff=0.05) if own_moe_losses else dict(aux_loss_coeff=0.0,
                                                                                     z_loss_coeff=0.0)
    return sharp_router_model(dataclasses.replace(config, moe=dataclasses.replace(
        config.moe, balance_statistics=True, **coeffs)), seed=42)


def take_gradients(model):
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def batch_of(model, seed=3):
    """The verl-padded GRPO batch of tests/test_api.py (4 prompts × 8 samples), old and reference log-probs near the
    policy's (+ noise where the loss mask is 1, so that part of the tokens is clipped)."""
    _, pairs, fields, _, _, _ = case_data("grpo-4x8-verl")
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        current = api.logprobs(model, [{"input_ids": torch.as_tensor(p + r)} for p, r in pairs]).log_probs
    near = []
    for f, lp in zip(fields, current):
        mask = f["loss_mask"] == 1
        near.append(dict(f, **{name: np.where(mask, np.minimum(lp.numpy() + 0.3 * rng.standard_normal(len(lp)), 0),
                                              np.nan) for name in ("old_log_probs", "ref_log_probs")}))
    return make_batch("verl", pairs, near)[0]


def rows(batch, members):
    """The padded batch's rows `members` (one microbatch of the plan)."""
    index = torch.from_numpy(np.asarray(members))
    return {name: value[index] for name, value in batch.items()}


def reference(model, batch, plan, config, *, policy: bool):
    """By hand from `policy_loss` per microbatch of the plan: Σ_k (policy_k, with `policy`) + c × pooled_k / K, K the
    plan's microbatches; backward into the model's gradients. Returns (that loss, the mean pooled loss)."""
    without = dataclasses.replace(config, pooled_balance_coeff=0.0)
    normalizer = step_normalizer(semantic_targets_from_step(api.as_batch(batch).step), config)
    num_microbatches = len(plan.microbatches)
    total = pooled_mean = 0.0
    for members in plan.microbatches:
        part = api.policy_loss(model, rows(batch, members), config=without, normalizer=normalizer,
                               num_microbatches=num_microbatches, pooled_balance=True)
        loss = COEFF * part.pooled_balance_loss / num_microbatches
        if policy:
            loss = loss + part.policy_loss
        loss.backward()
        total += float(loss.detach())
        pooled_mean += float(part.pooled_balance_loss.detach()) / num_microbatches
    return total, pooled_mean


@pytest.mark.parametrize("own_moe_losses", [False, True], ids=["own-moe-losses-off", "own-moe-losses-on"])
@pytest.mark.parametrize("capacity", CAPACITIES)
@pytest.mark.parametrize("loss", ["grpo-kl-clip-higher", "ppo-dual-clip-seq-mean"])
def test_planned_step_adds_each_microbatch_pooled_loss(loss, capacity, own_moe_losses):
    model = pooled_model(own_moe_losses)
    batch = batch_of(model)
    config = dataclasses.replace(LOSSES[loss], pooled_balance_coeff=COEFF)
    plan = api.plan(batch, CAPACITIES[capacity])
    assert len(plan.microbatches) >= 4

    model.zero_grad(set_to_none=True)
    if own_moe_losses:  # the step without the coefficient, then the pooled terms by hand
        without = api.policy_step(model, plan, config=dataclasses.replace(config, pooled_balance_coeff=0.0))
        assert without.pooled_balance_loss is None and float(without.moe_loss) > 0.1
        added, pooled = reference(model, batch, plan, config, policy=False)
        want_loss, want_policy, want_moe = float(without.loss) + added, float(without.policy_loss), \
            float(without.moe_loss) + added
    else:
        want_loss, pooled = reference(model, batch, plan, config, policy=True)
        want_moe = COEFF * pooled
        want_policy = want_loss - want_moe
    want = take_gradients(model)
    step = api.policy_step(model, plan, config=config)
    got = take_gradients(model)

    assert pooled > 2.0  # top-2: 2 when balanced
    assert float(step.pooled_balance_loss) == pytest.approx(pooled, rel=1e-6)
    assert float(step.moe_loss) == pytest.approx(want_moe, rel=1e-6)
    assert float(step.policy_loss) == pytest.approx(want_policy, rel=1e-6, abs=1e-7)
    assert float(step.loss) == pytest.approx(want_loss, rel=1e-6)
    assert relative_gradient_error(got, want) <= 1e-5


def test_replicas_add_up_to_the_step():
    """D = 2: K counts the microbatches of both replicas; their pooled parts, losses and gradients add up to the
    step's."""
    model = pooled_model(own_moe_losses=False)
    batch = batch_of(model, seed=5)
    config = dataclasses.replace(LOSSES["grpo-kl-clip-higher"], pooled_balance_coeff=COEFF)
    plan = api.plan(batch, CAPACITIES["groups-split"], dp=2)
    assert len(plan.microbatches) >= 4 and all(len(m) for m in plan.microbatches)
    model.zero_grad(set_to_none=True)
    want_loss, pooled = reference(model, batch, plan, config, policy=True)
    want = take_gradients(model)
    parts = [api.policy_step(model, plan, config=config, rank=rank) for rank in (0, 1)]
    got = take_gradients(model)
    assert all(0 < float(p.pooled_balance_loss) < pooled for p in parts)
    assert sum(float(p.pooled_balance_loss) for p in parts) == pytest.approx(pooled, rel=1e-6)
    assert sum(float(p.loss) for p in parts) == pytest.approx(want_loss, rel=1e-6)
    assert relative_gradient_error(got, want) <= 1e-5


def test_micro_batches_with_the_coefficient_add_up_to_run_step():
    """`policy_loss` with the coefficient, the step's normaliser and micro-batch count: the micro-batches' losses,
    pooled losses and gradients add up to `run_step`'s with it on the same microbatches (MoE losses on)."""
    model = pooled_model(own_moe_losses=True)
    batch = batch_of(model)
    config = dataclasses.replace(LOSSES["grpo-kl-clip-higher"], pooled_balance_coeff=COEFF)
    groups = [np.arange(0, 8), np.arange(8, 24), np.arange(24, 32)]
    step = api.as_batch(batch).step
    normalizer = step_normalizer(semantic_targets_from_step(step), config)
    model.zero_grad(set_to_none=True)
    total = moe = pooled = 0.0
    for members in groups:
        part = api.policy_loss(model, rows(batch, members), config=config, normalizer=normalizer,
                               num_microbatches=len(groups))
        part.loss.backward()
        total, moe = total + float(part.loss.detach()), moe + float(part.moe_loss.detach())
        pooled += float(part.pooled_balance_loss.detach()) / len(groups)
    got = take_gradients(model)
    expected = run_step(model, step, groups, config)
    want = take_gradients(model)
    assert expected.pooled_balance_loss > 2.0
    assert pooled == pytest.approx(expected.pooled_balance_loss, rel=1e-6)
    assert moe == pytest.approx(expected.moe_loss, rel=1e-6)
    assert total == pytest.approx(expected.loss, rel=1e-6)
    assert relative_gradient_error(got, want) <= 1e-5


def test_without_the_coefficient_nothing_is_added():
    model = pooled_model(own_moe_losses=False)
    batch = batch_of(model)
    step = api.policy_step(model, api.plan(batch, CAPACITIES["groups-split"]), backward=False)
    one = api.policy_loss(model, batch)
    assert step.pooled_balance_loss is None and one.pooled_balance_loss is None
    assert float(step.moe_loss) == 0.0 and float(one.moe_loss) == 0.0


def _softmax_tiny(**moe):
    config = load_model_config("tiny")
    return dataclasses.replace(config, moe=dataclasses.replace(config.moe, score_function="softmax",
                                                               expert_bias=False, **moe))


REFUSED = {
    "no-moe": (lambda: dataclasses.replace(load_model_config("tiny"), num_dense_layers=4),
               "the model has no MoE layer"),
    "sigmoid": (lambda: load_model_config("tiny"),
                "transformers' load-balancing loss is the softmax one; the model routes with sigmoid scores"),
    "no-statistics": (lambda: _softmax_tiny(aux_loss_coeff=0.0),
                      "its MoE layers do not report their load-balancing statistics"),
}


@pytest.mark.parametrize("call", ["policy_step", "policy_loss"])
@pytest.mark.parametrize("case", REFUSED)
def test_a_model_that_cannot_give_the_pooled_loss_is_refused_before_running(case, call):
    make, message = REFUSED[case]
    model = HybridModel(make())
    model.init_weights(seed=0)
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))
    batch = case_data("grpo-4x8-verl")[3]
    config = dataclasses.replace(api.device_config("cpu"), pooled_balance_coeff=COEFF)
    with pytest.raises(ValueError, match=rf"^{call}: pooled_balance_coeff 0.5 on model 'tiny': {message}"):
        if call == "policy_step":
            api.policy_step(model, api.plan(batch, CAPACITIES["groups-whole"]), config=config)
        else:
            api.policy_loss(model, batch, config=config)
    assert not calls
