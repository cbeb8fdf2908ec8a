"""`run_step` against the step's objective written out in the test, over the whole step.

Tests comparing two executions share `run_step`'s normaliser and MoE averaging, so a wrong
normaliser scales both alike and passes them. Here the reference runs the tiny model (fp32,
CPU) on each trajectory alone, takes log_softmax and the next token's log-prob in the test,
and writes the per-token loss as formulas (clipped surrogate off-policy, k3 KL for GRPO, dual
clip for PPO), normalised by the step's masked-token count (token-mean) or averaged per
trajectory over the trajectories with a masked token (seq-mean-token-mean; one trajectory of
the step has none). The MoE part is megatron's router z-loss and switch load-balancing loss
written out on the router inputs of each microbatch's rows (captured from the same forwards),
averaged over microbatches. Loss, policy loss, MoE loss, clip fraction and every parameter's
gradient must match, for 1 and 3 microbatches, both executions, both aggregations.
"""

from dataclasses import replace

import numpy as np
import pytest
import torch

from harts.model.config import load_model_config
from harts.model.model import HybridModel
from harts.model.moe import MoE
from harts.objective.losses import GRPOConfig, PPOConfig
from harts.objective.step import StepConfig, run_step
from harts.runtime.layout import baseline_layout
from tests.objective.helpers import random_tree_step

CLIP_LOW, CLIP_HIGH, KL_COEF, DUAL_CLIP = 0.2, 0.28, 0.1, 1.5
AGGREGATIONS = ("token-mean", "seq-mean-token-mean")


@pytest.fixture(scope="module")
def model():
    model = HybridModel(load_model_config("tiny"))
    model.init_weights(seed=42)
    return model


def _trajectory_forward(model, step, k):
    """(λ of tokens 1..L-1 of trajectory k, router inputs [L, D] of every MoE layer), the model
    run on the trajectory alone."""
    captured = []
    hooks = [m.register_forward_hook(lambda _m, args, _out: captured.append(args[0]))
             for m in model.modules() if isinstance(m, MoE)]
    try:
        layout = baseline_layout(step, np.array([k]), conv_size=model.config.kda.conv_size,
                                 chunk_size=model.config.kda.chunk_size)
        hidden, _ = model(layout.input_ids, layout)
    finally:
        for hook in hooks:
            hook.remove()
    tokens = torch.from_numpy(step.trajectory_tokens(k).astype(np.int64))
    logprobs = torch.log_softmax(hidden[:-1] @ model.lm_head.weight.T, dim=-1)
    return logprobs.gather(1, tokens[1:, None])[:, 0], captured


def _moe_losses(model, router_inputs):
    """Σ over MoE layers of the z-loss and switch load-balancing loss of these rows (megatron's
    `z_loss_func` and `switch_load_balancing_loss_func`, sigmoid scores normalised over experts)."""
    total = torch.zeros(())
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for layer, x in zip(layers, router_inputs):
        c = layer.config
        assert c.score_function == "sigmoid"
        logits = x @ layer.router_weight.T
        total = total + c.z_loss_coeff * torch.logsumexp(logits, dim=-1).square().mean()
        scores = torch.sigmoid(logits)
        scores = scores / scores.sum(dim=-1, keepdim=True)
        selected = torch.zeros_like(scores).scatter(1, torch.topk(scores, c.top_k, dim=1).indices, 1.0)
        num_rows = x.shape[0]
        total = total + c.aux_loss_coeff * c.num_experts / (c.top_k * num_rows**2) * (
            scores.sum(0) * selected.sum(0)).sum()
    return total


def _per_token_loss(loss, logprobs, old, ref, advantages):
    """ℓ per masked token; and whether the clipped term is the active one."""
    ratio = torch.exp(logprobs - old)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH)
    surrogate = torch.maximum(unclipped, clipped)
    if loss == "grpo":
        delta = ref - logprobs
        return surrogate + KL_COEF * (torch.exp(delta) - delta - 1), clipped > unclipped
    dual = torch.where(advantages < 0, torch.minimum(surrogate, -advantages * DUAL_CLIP), surrogate)
    return dual, clipped > unclipped


def _written_out_step(model, step, microbatches, loss, aggregation):
    """(loss, policy loss, MoE loss, clip fraction, clipped flags of the masked tokens) of the step
    from the formulas above; the clip fraction is the mean over microbatches, as `run_step` reports it."""
    per_trajectory, router_inputs, clipped_of = [], [], []
    for k in range(step.num_trajectories):
        logprobs, inputs = _trajectory_forward(model, step, k)
        lo, hi = int(step.offsets[k]) + 1, int(step.offsets[k + 1])

        def target(array):
            return torch.from_numpy(np.asarray(array[lo:hi], dtype=np.float32))

        mask = torch.from_numpy(step.loss_mask[lo:hi].astype(bool))
        ell, clipped = _per_token_loss(loss, logprobs, target(step.old_logprobs), target(step.ref_logprobs),
                                       target(step.advantages()))
        per_trajectory.append(ell[mask])
        clipped_of.append(clipped[mask])
        router_inputs.append(inputs)
    if aggregation == "token-mean":
        policy = torch.cat(per_trajectory).sum() / sum(len(t) for t in per_trajectory)
    else:
        trained = [t for t in per_trajectory if len(t)]
        policy = sum(t.mean() for t in trained) / len(trained)
    num_layers = len(router_inputs[0])
    moe = sum(
        _moe_losses(model, [torch.cat([router_inputs[k][layer] for k in members]) for layer in range(num_layers)])
        for members in microbatches
    ) / len(microbatches)
    clip_fraction = np.mean([
        float(torch.cat([clipped_of[k] for k in members]).float().mean()) for members in microbatches
    ])
    return policy + moe, policy, moe, clip_fraction, torch.cat(clipped_of)


@pytest.fixture(scope="module")
def off_policy_step(model):
    """A random tree step whose last trajectory trains nothing, with old and ref log-probs the
    model's current ones + N(0, 0.3²) noise (ratios away from 1)."""
    rng = np.random.default_rng(7)
    step = random_tree_step(rng, num=9, max_len=40, vocab=3).step
    loss_mask = step.loss_mask.copy()
    loss_mask[step.offsets[-2]:] = 0
    current = np.zeros(step.num_semantic_tokens, dtype=np.float32)
    with torch.no_grad():
        for k in range(step.num_trajectories):
            current[step.offsets[k] + 1 : step.offsets[k + 1]] = _trajectory_forward(model, step, k)[0].numpy()

    def jitter():
        return (current + 0.3 * rng.standard_normal(len(current))).astype(np.float32)

    return replace(step, loss_mask=loss_mask, old_logprobs=jitter(), ref_logprobs=jitter())


def _gradients(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("num_microbatches", [1, 3], ids=["1mb", "3mb"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("loss", ["grpo", "ppo"])
@pytest.mark.parametrize("execution", ["baseline", "compact"])
def test_run_step_equals_written_out_objective(model, off_policy_step, execution, loss, aggregation,
                                               num_microbatches):
    step = off_policy_step
    order = np.random.default_rng(8).permutation(step.num_trajectories)
    microbatches = np.array_split(order, num_microbatches)
    config = StepConfig(
        execution=execution, loss=loss,
        grpo=GRPOConfig(clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, kl_coef=KL_COEF, aggregation=aggregation),
        ppo=PPOConfig(clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, dual_clip_ratio=DUAL_CLIP,
                      aggregation=aggregation),
    )

    model.zero_grad(set_to_none=True)
    expected, policy, moe, clip_fraction, clipped = _written_out_step(model, step, microbatches, loss, aggregation)
    expected.backward()
    expected_grads = _gradients(model)
    assert 0 < float(clipped.float().mean()) < 1, "clipping active on part of the tokens"
    assert float(moe.detach()) > 0

    model.zero_grad(set_to_none=True)
    result = run_step(model, step, microbatches, config)
    grads = _gradients(model)
    model.zero_grad(set_to_none=True)

    assert result.loss == pytest.approx(float(expected.detach()), rel=1e-5)
    assert result.policy_loss == pytest.approx(float(policy.detach()), rel=1e-5)
    assert result.moe_loss == pytest.approx(float(moe.detach()), rel=1e-5)
    assert result.clip_fraction == pytest.approx(clip_fraction, abs=1e-12)
    assert grads.keys() == expected_grads.keys()
    for name, expected_grad in expected_grads.items():
        difference = float((grads[name] - expected_grad).norm())
        assert difference <= 1e-4 * float(expected_grad.norm()) + 1e-9, name


@pytest.mark.parametrize("precision", ["fp32", "input"])
def test_logprob_grad_precision_reaches_the_lm_head(model, monkeypatch, precision):
    import harts.objective.step as step_module

    seen = []
    original = step_module.compact_logprobs

    def recording(*args, **kwargs):
        seen.append(kwargs["grad_precision"])
        return original(*args, **kwargs)

    monkeypatch.setattr(step_module, "compact_logprobs", recording)
    step = random_tree_step(np.random.default_rng(0), num=4, max_len=30, vocab=3).step
    run_step(model, step, [np.arange(step.num_trajectories)], StepConfig(logprob_grad_precision=precision))
    model.zero_grad(set_to_none=True)
    assert seen == [precision]


def _trajectory_entropy(model, step, k):
    """Entropies of the distributions predicting tokens 1..L-1 of trajectory k, the model run on it alone."""
    layout = baseline_layout(step, np.array([k]), conv_size=model.config.kda.conv_size,
                             chunk_size=model.config.kda.chunk_size)
    hidden, _ = model(layout.input_ids, layout)
    log_p = torch.log_softmax(hidden[:-1] @ model.lm_head.weight.T, dim=-1)
    return -(log_p.exp() * log_p).sum(-1)


ENTROPY_COEF = 0.3


@pytest.mark.parametrize("num_microbatches", [1, 3], ids=["1mb", "3mb"])
@pytest.mark.parametrize("entropy_aggregation", [None, "seq-mean-token-mean"], ids=["same", "seq-mean"])
@pytest.mark.parametrize("execution", ["baseline", "compact"])
def test_run_step_entropy_bonus_equals_written_out_objective(model, off_policy_step, execution, entropy_aggregation,
                                                             num_microbatches):
    """The entropy bonus (verl's entropy_coeff, TRL's entropy_coef) through run_step: the written-out token-mean
    policy loss minus the coefficient times the entropies aggregated over the whole step, its own way."""
    step = off_policy_step
    microbatches = np.array_split(np.random.default_rng(8).permutation(step.num_trajectories), num_microbatches)
    config = StepConfig(execution=execution, loss="grpo", grpo=GRPOConfig(
        clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, kl_coef=KL_COEF, entropy_coef=ENTROPY_COEF,
        entropy_aggregation=entropy_aggregation))

    model.zero_grad(set_to_none=True)
    expected, _, _, _, _ = _written_out_step(model, step, microbatches, "grpo", "token-mean")
    entropies = []
    for k in range(step.num_trajectories):
        mask = torch.from_numpy(step.loss_mask[int(step.offsets[k]) + 1:int(step.offsets[k + 1])].astype(bool))
        entropies.append(_trajectory_entropy(model, step, k)[mask])
    if entropy_aggregation is None:
        bonus = torch.cat(entropies).sum() / sum(len(e) for e in entropies)
    else:
        trained = [e for e in entropies if len(e)]
        bonus = sum(e.mean() for e in trained) / len(trained)
    assert float(bonus) > 0
    expected = expected - ENTROPY_COEF * bonus
    expected.backward()
    expected_grads = _gradients(model)

    model.zero_grad(set_to_none=True)
    result = run_step(model, step, microbatches, config)
    grads = _gradients(model)
    model.zero_grad(set_to_none=True)

    assert result.loss == pytest.approx(float(expected.detach()), rel=1e-5)
    for name, expected_grad in expected_grads.items():
        difference = float((grads[name] - expected_grad).norm())
        assert difference <= 1e-4 * float(expected_grad.norm()) + 1e-9, name


@pytest.mark.parametrize("calls", ["linked", "separate"])
def test_kda_calls_reaches_the_layout_of_every_depth(calls):
    """`kda_calls` reaches the compact layouts of the microbatch and of each MTP depth: on fla their schedules of
    several calls run as one linked launch where the knob asks for it, else one call after another."""
    from harts.model.config import MTPConfig
    from harts.objective.step import build_layout, build_mtp_layouts
    from harts.trees.trie import PrefixIndex
    from tests.trees.helpers import make_step

    config = load_model_config("tiny")
    config = replace(config, kda=replace(config.kda, chunk_size=32), mtp=MTPConfig(num_layers=2, layer_kind="kda"))
    model = HybridModel(config)
    rng = np.random.default_rng(0)
    trunk = rng.integers(1, 50, 100).tolist()
    step = make_step([trunk + rng.integers(1, 50, 60).tolist(), trunk[:90] + [99] * 50, trunk[:70] + [98] * 40],
                     trees=["t"] * 3)
    step_config = StepConfig(execution="compact", kda_backend="fla", kda_calls=calls)
    members = np.arange(3)
    index = PrefixIndex.from_step(step)
    layouts = [build_layout(step, members, model, step_config, index),
               *(m.layout for m in build_mtp_layouts(step, members, model, step_config, index))]
    assert len(layouts) == 3
    for layout in layouts:
        assert layout.kda_schedule.num_calls > 1
        assert (layout.prepared_schedule().linked is None) == (calls == "separate")
        assert (layout.to("cpu").kda_prepared.linked is None) == (calls == "separate")

