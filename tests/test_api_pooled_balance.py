"""harts/api.py's `pooled_balance`: transformers' load-balancing loss of a batch, read from HARTS's compact rows.

The reference is transformers' own `load_balancing_loss_func` (Qwen3-Next's; Qwen3.5-MoE's is the same function) on
the router logits of every MoE layer in the batch's padded layout: each sequence run alone through the model (its
logits recorded at each MoE layer's router), placed where the batch has it, and padding filled with random logits
that only the attention mask keeps out. Batches: GRPO groups (2 prompts × 4 samples, one sample sharing a response
prefix, one a duplicate) left-padded, right-padded and in verl's two-sided padding, in the compact execution (shared
rows computed once, weighted by their multiplicity) and the per-trajectory one; a gdn-tiny model (one dense layer,
three MoE layers, 4 experts top-2) whose router weights are scaled up so that routing is far from uniform (a per-layer
mean then differs from the pooled one). fp32 on the CPU: the loss within 1e-6 and every parameter gradient within
1e-4 relative (‖Δg‖ / ‖g‖, tests/test_api.py's bound).
"""

import dataclasses

import numpy as np
import pytest
import torch

from harts import api
from harts.model.config import load_model_config
from harts.model.model import HybridModel
from tests.fixtures import one_thread  # noqa: F401  (autouse fixture)
from tests.model.helpers import sharp_router_model
from tests.test_api import grpo_sequences, make_batch, rl_fields

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next",
                                 reason="transformers with Qwen3-Next is not installed")


@pytest.fixture(scope="module")
def model():
    config = load_model_config("gdn-tiny")
    config = dataclasses.replace(config, moe=dataclasses.replace(config.moe, aux_loss_coeff=0.0, z_loss_coeff=0.0,
                                                                 balance_statistics=True))
    return sharp_router_model(config, seed=42)


def moe_layers(model):
    return [block.mlp for block in model.blocks if block.is_moe]


def router_logits_alone(model, tokens):
    """Per MoE layer, the router logits [n, E] of `tokens` run alone (differentiable)."""
    records = []
    for moe in moe_layers(model):
        def recorded(x_ND, moe=moe):
            logits = type(moe).router_logits(moe, x_ND)
            records.append(logits)
            return logits
        moe.router_logits = recorded
    try:
        api.logprobs(model, [{"input_ids": torch.as_tensor(tokens)}])
    finally:
        for moe in moe_layers(model):
            del moe.router_logits
    assert len(records) == len(moe_layers(model))
    return records


def transformers_loss(model, pairs, places, batch, use_mask=True, layers=None):
    """transformers' `load_balancing_loss_func` of the padded batch's router logits (padding: random logits) of the
    MoE layers `layers` (default: all)."""
    attention_mask = batch["attention_mask"]
    size = attention_mask.numel()
    num_experts, top_k = model.config.moe.num_experts, model.config.moe.top_k
    generator = torch.Generator().manual_seed(7)
    logits_LNE = [torch.randn(size, num_experts, generator=generator) * 5.0 for _ in moe_layers(model)]
    for (prompt, response), place in zip(pairs, places):
        index = torch.from_numpy(place)
        for layer, logits in enumerate(router_logits_alone(model, prompt + response)):
            logits_LNE[layer] = logits_LNE[layer].index_put((index,), logits)
    chosen = tuple(logits_LNE[layer] for layer in (range(len(logits_LNE)) if layers is None else layers))
    return qwen3_next.load_balancing_loss_func(chosen, num_experts, top_k, attention_mask if use_mask else None)


def gradients(model):
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


CASES = {"left": "left", "right": "right", "two-sided": "verl"}
EXECUTIONS = ("compact", "baseline")


@pytest.mark.parametrize("execution", EXECUTIONS)
@pytest.mark.parametrize("case", CASES)
def test_pooled_balance_is_transformers_load_balancing_loss(model, case, execution):
    rng = np.random.default_rng(3)
    pairs = grpo_sequences(rng, num_prompts=2, samples=4)
    batch, places = make_batch(CASES[case], pairs, rl_fields(rng, pairs, per_token_advantages=False))
    model.zero_grad(set_to_none=True)
    want = transformers_loss(model, pairs, places, batch)
    want.backward()
    want_grads = gradients(model)
    config = dataclasses.replace(api.device_config("cpu"), execution=execution)
    result = api.policy_loss(model, batch, config=config, pooled_balance=True)
    got = result.pooled_balance_loss
    got.backward()
    got, want = float(got.detach()), float(want.detach())
    got_grads = gradients(model)
    if execution == "compact":
        assert result.num_rows < 0.8 * result.num_tokens
    assert abs(got - want) <= 1e-6, (got, want)
    assert set(got_grads) == set(want_grads) and want_grads
    for name, want_grad in want_grads.items():
        error = float((got_grads[name] - want_grad).norm() / want_grad.norm().clamp(min=1e-30))
        assert error <= 1e-4, (name, error)


def test_the_mask_and_the_pooling_matter(model):
    """The comparison sees the bugs it is for: transformers' loss without the attention mask (padding counted), or
    as the mean of each layer's own loss, differs from the pooled one by far more than the tolerance."""
    rng = np.random.default_rng(3)
    pairs = grpo_sequences(rng, num_prompts=2, samples=4)
    batch, places = make_batch("left", pairs, rl_fields(rng, pairs, per_token_advantages=False))
    with torch.no_grad():
        pooled = transformers_loss(model, pairs, places, batch)
        unmasked = transformers_loss(model, pairs, places, batch, use_mask=False)
        per_layer = [transformers_loss(model, pairs, places, batch, layers=[layer])
                     for layer in range(len(moe_layers(model)))]
    assert abs(float(unmasked) - float(pooled)) > 1e-3
    assert abs(sum(float(x) for x in per_layer) / len(per_layer) - float(pooled)) > 1e-3


def test_pooled_balance_needs_the_statistics():
    config = load_model_config("gdn-tiny")
    model = HybridModel(dataclasses.replace(config, moe=dataclasses.replace(config.moe, aux_loss_coeff=0.0)))
    model.init_weights(seed=0)
    batch = [{"input_ids": torch.arange(1, 9), "loss_mask": torch.tensor([0] * 4 + [1] * 4), "advantages": 1.0}]
    with pytest.raises(ValueError, match="did not report their load-balancing statistics"):
        api.policy_loss(model, batch, pooled_balance=True)
