"""Tensor-parallel cuts, without processes: the ranks' sharded layers add up to the unsharded layer.

A tensor-parallel region sums its ranks' outputs (forward all-reduce of the row-parallel output
projection) and their input gradients (backward all-reduce at the entry). So for every layer and
tp, in fp64 on a compact layout of a random tree: Σ_r layer_r(x) = layer(x); Σ_r ∂/∂x = ∂/∂x;
every cut parameter's gradient is the slice (by its ShardSpec) of the full gradient; every whole
parameter is listed as partial and its gradients over ranks add up to the full gradient.
Rows are fp64, but the layers keep some internals in fp32 (RMSNorm, KDA's decay gate), so the
sums are compared to 1e-5 relative (measured: up to 7e-6 on the 4 decay-gate values A_log at
tp = 4, whose gradients cancel; a wrong cut is off by O(1)).
"""

import copy
from dataclasses import replace

import numpy as np
import pytest
import torch

from harts.model.config import GatedAttentionConfig, GDNConfig, load_model_config
from harts.model.gdn import GatedAttentionLayer, GDNLayer
from harts.model.layers import KDALayer, MLALayer, SwiGLU
from harts.parallel.gdn import shard_gated_attention, shard_gdn
from harts.parallel.tensor import Sharder, shard_kda, shard_mla, shard_swiglu
from harts.runtime.layout import compact_layout
from harts.trees.trie import PrefixIndex
from tests.objective.helpers import random_tree_step

CONFIG = load_model_config("cpu-small")
TOLERANCE = 1e-5


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    relative = float((actual - expected).norm() / expected.norm().clamp(min=1e-30))
    assert relative <= TOLERANCE, (what, relative)


def _layer(kind: str, generator: torch.Generator):
    hidden = CONFIG.hidden_size
    if kind in ("kda", "kda-kimi"):
        # Kimi-Linear's output gate has no bias (harts.model.hf loads checkpoints that way).
        kda = replace(CONFIG.kda, head_dim=16, chunk_size=16, output_gate_bias=kind == "kda")
        layer = KDALayer(hidden, kda, CONFIG.norm_eps)
        layer.reset_kda_parameters(generator)
    elif kind == "kda-bailing":
        # BailingHybrid's KDA: full-rank gates without bias, the bounded decay gate.
        kda = replace(CONFIG.kda, head_dim=16, chunk_size=16, gate_rank=None, output_gate_bias=False,
                      full_rank_gates=True, gate_lower_bound=-5.0)
        layer = KDALayer(hidden, kda, CONFIG.norm_eps)
        layer.reset_kda_parameters(generator)
    elif kind == "mla":
        layer = MLALayer(hidden, replace(CONFIG.mla, q_lora_rank=48), CONFIG.norm_eps)
    elif kind == "mla-gated":
        # BailingHybrid's gated MLA: a per-head output gate, interleaved RoPE.
        layer = MLALayer(hidden, replace(CONFIG.mla, q_lora_rank=48, output_gate=True, rope_interleave=True),
                         CONFIG.norm_eps)
    elif kind == "mla-full-query":
        layer = MLALayer(hidden, CONFIG.mla, CONFIG.norm_eps)
    elif kind == "gdn":
        # Grouped values (8 value heads over 4 key heads) and K != V, so a cut that mixes up the parts shows.
        gdn = GDNConfig(num_key_heads=4, num_value_heads=8, key_head_dim=8, value_head_dim=6, chunk_size=16)
        layer = GDNLayer(hidden, gdn, CONFIG.norm_eps)
        layer.reset_gdn_parameters(generator)
    elif kind == "gqa":
        gqa = GatedAttentionConfig(num_heads=8, num_kv_heads=4, head_dim=8, rotary_dim=4)
        layer = GatedAttentionLayer(hidden, gqa, CONFIG.norm_eps, zero_centered=True)
    else:
        layer = SwiGLU(hidden, CONFIG.dense_hidden_size)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.dim() >= 2 or name.endswith(".bias") or name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=generator) * (0.1 if p.dim() >= 2 else 1.0))
    return layer.double()


SHARD = {"kda": shard_kda, "kda-kimi": shard_kda, "kda-bailing": shard_kda, "mla": shard_mla,
         "mla-full-query": shard_mla, "mla-gated": shard_mla, "swiglu": shard_swiglu, "gdn": shard_gdn,
         "gqa": shard_gated_attention}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("kind", list(SHARD))
def test_sharded_layers_add_up(kind, tp):
    generator = torch.Generator().manual_seed(42)
    layer = _layer(kind, generator)
    step = random_tree_step(np.random.default_rng(42), num=5, max_len=40, vocab=3).step
    layout = compact_layout(step, PrefixIndex.from_step(step), np.arange(step.num_trajectories),
                            conv_size=CONFIG.kda.conv_size, chunk_size=16)
    rows = layout.num_rows
    x = torch.randn(rows, CONFIG.hidden_size, generator=generator, dtype=torch.float64)
    upstream = torch.randn(rows, CONFIG.hidden_size, generator=generator, dtype=torch.float64)
    call = (lambda m, h: m(h)) if kind == "swiglu" else (lambda m, h: m(h, layout))

    ranks = [copy.deepcopy(layer) for _ in range(tp)]
    x_full = x.clone().requires_grad_()
    out_full = call(layer, x_full)
    (out_full * upstream).sum().backward()
    full_grads = {name: p.grad for name, p in layer.named_parameters()}
    full_values = {name: p.detach() for name, p in layer.named_parameters()}

    out_sum = torch.zeros_like(out_full)
    x_grad_sum = torch.zeros_like(x)
    partial_sums = {}
    for rank, part in enumerate(ranks):
        sharder = Sharder(part)
        partial = set(SHARD[kind](sharder, part, rank, tp))
        x_rank = x.clone().requires_grad_()
        out = call(part, x_rank)
        (out * upstream).sum().backward()
        out_sum += out.detach()
        x_grad_sum += x_rank.grad
        for name, p in part.named_parameters():
            spec = sharder.specs.get(name)
            if spec is not None:
                assert name not in partial
                assert torch.equal(p.detach(), full_values[name].index_select(spec.dim, spec.index)), name
                _assert_close(p.grad, full_grads[name].index_select(spec.dim, spec.index), name)
            else:
                assert name in partial, f"{name} is neither cut nor partial"
                partial_sums[name] = partial_sums.get(name, 0) + p.grad
    _assert_close(out_sum, out_full.detach(), "output")
    _assert_close(x_grad_sum, x_full.grad, "input gradient")
    for name, total in partial_sums.items():
        _assert_close(total, full_grads[name], name)


@pytest.mark.parametrize("kind", ["kda", "gdn", "gqa"])
def test_specs_reassemble_every_cut_parameter(kind):
    layer = _layer(kind, torch.Generator().manual_seed(42))
    tp = 2
    rebuilt = {name: torch.full_like(p, float("nan")) for name, p in layer.named_parameters()}
    for rank in range(tp):
        part = copy.deepcopy(layer)
        sharder = Sharder(part)
        SHARD[kind](sharder, part, rank, tp)
        for name, p in part.named_parameters():
            spec = sharder.specs.get(name)
            if spec is None:
                rebuilt[name] = p.detach()
            else:
                assert spec.full_shape == tuple(rebuilt[name].shape)
                rebuilt[name].index_copy_(spec.dim, spec.index, p.detach())
    for name, p in layer.named_parameters():
        assert torch.equal(rebuilt[name], p.detach()), name


def test_mla_with_attention_bias_is_refused():
    """o_proj is row-parallel: its bias would be added once per rank, so the cut is refused by name."""
    layer = MLALayer(CONFIG.hidden_size, replace(CONFIG.mla, q_lora_rank=48, attention_bias=True), CONFIG.norm_eps)
    with pytest.raises(ValueError, match=r"tensor parallelism \(2\) of an MLA layer with mla.attention_bias"):
        shard_mla(Sharder(layer), layer, 0, 2)
