"""HARTS's layers in BailingHybrid's (Ling-3's) convention against transformers' own modules, one sequence.

- `MLALayer.rotate` with `rope_interleave`: a pair-by-pair rotation written here, and transformers'
  `apply_rotary_pos_emb_interleave` with its `BailingHybridRotaryEmbedding`. Both implementations take the
  angles p·θ^(−2i/E) in fp32 (so does the reference here) and HARTS rotates in fp32 (`apply_rope`), so fp64 inputs
  agree to fp32 rounding: 1e-6.
- `MLALayer` with `output_gate` (and `rope_interleave`, latent eps 1e-6), full-rank or low-rank queries, with and
  without `attention_bias`: transformers' `BailingHybridAttention` (eager, a causal mask) on the same weights,
  fp64 but for that fp32 rotation, 1e-6 of the largest output.
- `KDALayer` with `full_rank_gates` and the bounded gate (`gate_lower_bound`) or the softplus one: transformers'
  `BailingHybridDeltaAttention` (its PyTorch chunked KDA, fp32 inside) on the same weights, 70 rows (past both
  implementations' chunk boundaries), fp32, 1e-5 of the largest output.
Planted mapping or formula errors change the outputs by O(1).
"""

import math

import numpy as np
import pytest
import torch
import transformers
from transformers.models.bailing_hybrid import modeling_bailing_hybrid as bailing

from harts.model.config import KDAConfig, MLAConfig
from harts.model.layers import KDALayer, MLALayer
from harts.runtime.layout import baseline_layout
from tests.trees.helpers import make_step

HIDDEN, HEADS, LENGTH = 48, 4, 70


def transformers_config(**changes) -> transformers.BailingHybridConfig:
    settings = dict(vocab_size=64, hidden_size=HIDDEN, intermediate_size=32, moe_intermediate_size=8,
                    num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=HEADS, kv_lora_rank=24,
                    q_lora_rank=None, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, head_dim=16,
                    layer_group_size=2, first_k_dense_replace=0, num_mtp_layers=0, rope_theta=10000.0,
                    rms_norm_eps=1e-5, pad_token_id=None, eos_token_id=None)
    settings.update(changes)
    config = transformers.BailingHybridConfig(**settings)
    config._attn_implementation = "eager"
    return config


def _fill(module: torch.nn.Module, seed: int) -> None:
    """Matrices with unit-variance outputs, biases and norms near their scale, latents small (so the latent
    norms' eps matters), decays spread."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 4, generator=generator).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=generator) - 2)
            elif "conv" in name:
                p.copy_(torch.rand(p.shape, generator=generator) - 0.5)
            elif p.dim() == 1:
                p.copy_((1 if "norm" in name else 0) + 0.3 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(p.shape[-1]))


def _layout(length: int, chunk_size: int = 16):
    step = make_step([list(range(length))])
    return baseline_layout(step, np.arange(1), conv_size=4, chunk_size=chunk_size)


def _causal_mask(length: int, dtype) -> torch.Tensor:
    blocked = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)
    return torch.zeros(length, length, dtype=dtype).masked_fill(blocked, float("-inf"))[None, None]


def test_interleaved_rope_rotates_adjacent_pairs():
    config = transformers_config()
    layer = MLALayer(HIDDEN, MLAConfig(num_heads=HEADS, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8,
                                       v_head_dim=10, rope_theta=10000.0, rope_interleave=True), 1e-5).double()
    generator = torch.Generator().manual_seed(42)
    x = torch.randn(LENGTH, HEADS, 8, generator=generator, dtype=torch.float64)
    positions = torch.randint(0, 5000, (LENGTH,), generator=generator)
    actual = layer.rotate(x, positions)

    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    angles = (positions.float()[:, None] * inv_freq).double()
    pairs = []
    for i in range(4):
        angle = angles[:, i:i + 1]
        a, b = x[..., 2 * i], x[..., 2 * i + 1]
        pairs.append((a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()))
    expected = torch.stack([p[0] for p in pairs] + [p[1] for p in pairs], dim=-1)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)

    rotary = bailing.BailingHybridRotaryEmbedding(config)
    cos, sin = rotary(x.transpose(0, 1)[None], positions[None])
    theirs, _ = bailing.apply_rotary_pos_emb_interleave(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(actual, theirs[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    halves = MLALayer(HIDDEN, layer.config.__class__(**{**layer.config.__dict__, "rope_interleave": False}), 1e-5)
    assert not torch.allclose(halves.double().rotate(x, positions), actual)


def _copy_mla(ours: MLALayer, theirs: bailing.BailingHybridAttention) -> None:
    with torch.no_grad():
        if ours.config.q_lora_rank:
            ours.q_proj[0].weight.copy_(theirs.q_a_proj.weight)
            if theirs.q_a_proj.bias is not None:
                ours.q_proj[0].bias.copy_(theirs.q_a_proj.bias)
            ours.q_proj[1].weight.copy_(theirs.q_a_layernorm.weight)
            ours.q_proj[2].weight.copy_(theirs.q_b_proj.weight)
        else:
            ours.q_proj.weight.copy_(theirs.q_proj.weight)
        for mine, other in ((ours.kv_a_proj, theirs.kv_a_proj_with_mqa), (ours.o_proj, theirs.o_proj)):
            mine.weight.copy_(other.weight)
            if other.bias is not None:
                mine.bias.copy_(other.bias)
        ours.kv_norm.weight.copy_(theirs.kv_a_layernorm.weight)
        ours.kv_b_proj.weight.copy_(theirs.kv_b_proj.weight)
        ours.g_proj.weight.copy_(theirs.g_proj.weight)


MLA_CASES = {"full-query": dict(q_lora_rank=None), "low-rank-query": dict(q_lora_rank=16),
             "low-rank-query-bias": dict(q_lora_rank=16, attention_bias=True)}


@pytest.mark.parametrize("case", MLA_CASES)
def test_gated_mla_matches_transformers(case):
    settings = MLA_CASES[case]
    config = transformers_config(**settings)
    theirs = bailing.BailingHybridAttention(config, layer_idx=1).double().eval()
    _fill(theirs, seed=42)
    with torch.no_grad():  # small latents: the latent norms' eps (1e-6 there) changes the output
        theirs.kv_a_proj_with_mqa.weight[:24] *= 3e-3
        if settings["q_lora_rank"]:
            theirs.q_a_proj.weight.mul_(3e-3)
            if theirs.q_a_proj.bias is not None:
                theirs.q_a_proj.bias.mul_(3e-3)
    mla = MLAConfig(num_heads=HEADS, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
                    q_lora_rank=settings["q_lora_rank"], rope_theta=10000.0, latent_norm_eps=1e-6,
                    rope_interleave=True, output_gate=True, attention_bias=settings.get("attention_bias", False))
    ours = MLALayer(HIDDEN, mla, norm_eps=1e-5).double()
    _copy_mla(ours, theirs)
    x = torch.randn(LENGTH, HIDDEN, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    positions = torch.arange(LENGTH)[None]
    with torch.no_grad():
        cos_sin = bailing.BailingHybridRotaryEmbedding(config)(x[None], positions)
        expected, _ = theirs(x[None], cos_sin, _causal_mask(LENGTH, torch.float64))
        actual = ours(x, _layout(LENGTH))
    scale = float(expected.abs().max())
    assert float((actual - expected[0]).abs().max()) <= 1e-6 * scale
    with torch.no_grad():  # the gate matters
        ours.g_proj = None
        assert float((ours(x, _layout(LENGTH)) - expected[0]).abs().max()) > 1e-2 * scale


def _copy_kda(ours: KDALayer, theirs: bailing.BailingHybridDeltaAttention) -> None:
    channels = ours.num_heads * ours.head_dim
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "b_proj", "o_proj", "g_proj"):
            getattr(ours, name).weight.copy_(getattr(theirs, name).weight)
        conv = theirs.conv1d.weight[:, 0]
        ours.q_conv.copy_(conv[:channels])
        ours.k_conv.copy_(conv[channels:2 * channels])
        ours.v_conv.copy_(conv[2 * channels:])
        ours.f_proj.weight.copy_(theirs.forget_gate.f_proj.weight)
        ours.A_log.copy_(theirs.forget_gate.A_log)
        ours.dt_bias.copy_(theirs.forget_gate.dt_bias)
        ours.o_norm.weight.copy_(theirs.o_norm.weight)


@pytest.mark.parametrize("safe_gate", [True, False], ids=["bounded-gate", "softplus-gate"])
def test_full_rank_kda_matches_transformers(safe_gate):
    config = transformers_config(kda_safe_gate=safe_gate, kda_lower_bound=-5.0)
    theirs = bailing.BailingHybridDeltaAttention(config, layer_idx=0).eval()
    _fill(theirs, seed=42)
    kda = KDAConfig(num_heads=HEADS, head_dim=16, conv_size=4, chunk_size=16, output_gate_bias=False,
                    full_rank_gates=True, gate_lower_bound=-5.0 if safe_gate else None)
    ours = KDALayer(HIDDEN, kda, norm_eps=1e-5)
    _copy_kda(ours, theirs)
    x = torch.randn(LENGTH, HIDDEN, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = theirs(x[None])[0]
        actual = ours(x, _layout(LENGTH))
        scale = float(expected.abs().max())
        assert float((actual - expected).abs().max()) <= 1e-5 * scale
        ours.gate_lower_bound = None if safe_gate else -5.0  # the other gate is another function
        assert float((ours(x, _layout(LENGTH)) - expected).abs().max()) > 1e-2 * scale
