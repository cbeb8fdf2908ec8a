"""Incremental decoding of the Gated DeltaNet family's layers (harts.model.decode's caches and steps for
`GDNLayer` and `GatedAttentionLayer`): one token per rollout per call, batched over rollouts.

- GDN layer: the recurrent state [B, HV, K, V] (fla's orientation; fp32, fp64 for fp64 weights) advanced by the
  token recurrence (S ← exp(g)·S; S ← S + β k ⊗ (v − Sᵀk); o = Sᵀ(q/√K), q and k L2-normalised and repeated
  over the value groups), and the short conv's window: the [q | k | v] projections of the last W − 1 positions, most
  recent first (zeros before the first position, as the training path's conv reads a zero row there);
- gated GQA layer: the cache of the normalised, rotated keys and the values of every position [B, T, G, E]; each
  step attends over the rollout's cached positions with the KV heads repeated to the query heads.
The per-row work (projections, conv taps in the training path's arithmetic, decay, gates, norms) is the training
forward's on the B rows, so decoding gives its logits (tests/model/test_decode.py, gdn-tiny). Not a training
path: no autograd.
Legend: B rollouts, T cache capacity, D hidden, H query/key heads, HV value heads, K/V GDN head dims, C conv
channels, W conv width, G KV heads, E attention head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from harts.model.gdn import GatedAttentionLayer, GDNLayer, gdn_decay, norm_silu_gate, rotate_partial
from harts.ops import uses_fp32_kernels
from harts.ops.kda.compact import l2norm
from harts.runtime.layout import conv_taps


@dataclass(eq=False)
class GDNCache:
    state_BHKV: torch.Tensor
    """Recurrent state after the rollout's last position, [B, HV, K, V]."""
    window_BWC: torch.Tensor
    """[B, W − 1, C]: the [q | k | v] projections of the previous W − 1 positions, most recent first."""

    @classmethod
    def empty(cls, layer: GDNLayer, batch_size: int, state_dtype: torch.dtype) -> GDNCache:
        c = layer.config
        weight = layer.in_proj.weight
        state = torch.zeros(batch_size, c.num_value_heads, c.key_head_dim, c.value_head_dim, device=weight.device,
                            dtype=state_dtype)
        window = torch.zeros(batch_size, c.conv_size - 1, layer.conv_width, device=weight.device, dtype=weight.dtype)
        return cls(state, window)

    def select(self, rows: torch.Tensor) -> GDNCache:
        return GDNCache(self.state_BHKV.index_select(0, rows), self.window_BWC.index_select(0, rows))


@dataclass(eq=False)
class GQACache:
    keys_BTGE: torch.Tensor
    """Normalised, rotated keys of each cached position."""
    values_BTGE: torch.Tensor

    @classmethod
    def empty(cls, layer: GatedAttentionLayer, batch_size: int, capacity: int) -> GQACache:
        c = layer.config
        weight = layer.k_proj.weight
        shape = (batch_size, capacity, c.num_kv_heads, c.head_dim)
        return cls(torch.zeros(shape, device=weight.device, dtype=weight.dtype),
                   torch.zeros(shape, device=weight.device, dtype=weight.dtype))

    def select(self, rows: torch.Tensor) -> GQACache:
        return GQACache(self.keys_BTGE.index_select(0, rows), self.values_BTGE.index_select(0, rows))


def gdn_step(layer: GDNLayer, x_BD: torch.Tensor, cache: GDNCache) -> torch.Tensor:
    c = layer.config
    batch = x_BD.shape[0]
    weight = layer.in_proj.weight
    projected = F.linear(x_BD, weight[: layer.conv_width])
    window = cache.window_BWC
    # On CUDA the training path's conv accumulates in fp32 and rounds once (harts.ops.conv): so here.
    conv_dtype = torch.float32 if uses_fp32_kernels(projected) else projected.dtype
    mixed = F.silu(conv_taps(projected.to(conv_dtype), window.to(conv_dtype), layer.conv)).to(projected.dtype)
    if window.shape[1]:
        cache.window_BWC = torch.cat([projected.unsqueeze(1), window[:, :-1]], dim=1)
    q, k, v = mixed.split([layer.key_width, layer.key_width, layer.value_width], dim=-1)
    z, b, a = F.linear(x_BD, weight[layer.conv_width :]).split(
        [layer.value_width, c.num_value_heads, c.num_value_heads], dim=-1)
    g = gdn_decay(a, layer.A_log, layer.dt_bias)
    beta = torch.sigmoid(b.float())

    dtype = cache.state_BHKV.dtype
    group = c.num_value_heads // c.num_key_heads
    q, k = (l2norm(t.reshape(batch, c.num_key_heads, c.key_head_dim)).to(dtype).repeat_interleave(group, dim=1)
            for t in (q, k))
    v = v.reshape(batch, c.num_value_heads, c.value_head_dim)
    state = cache.state_BHKV * g.to(dtype).exp()[..., None, None]
    error = v.to(dtype) - (k.unsqueeze(-1) * state).sum(-2)
    state = state + (beta.to(dtype).unsqueeze(-1) * k).unsqueeze(-1) * error.unsqueeze(-2)
    cache.state_BHKV = state
    o = ((q * c.key_head_dim**-0.5).unsqueeze(-1) * state).sum(-2).to(v.dtype)
    o = norm_silu_gate(o, z.reshape(batch, c.num_value_heads, c.value_head_dim), layer.o_norm.weight,
                       layer.o_norm.eps)
    return layer.o_proj(o.reshape(batch, -1).to(x_BD.dtype))


def gqa_step(layer: GatedAttentionLayer, x_BD: torch.Tensor, cache: GQACache, positions_B: torch.Tensor,
             length: int) -> torch.Tensor:
    """`length`: cached positions to attend over (the longest rollout's, this token included)."""
    c = layer.config
    batch = x_BD.shape[0]
    rows = torch.arange(batch, device=x_BD.device)
    q, gate = layer.q_proj(x_BD).view(batch, c.num_heads, 2 * c.head_dim).split(c.head_dim, dim=-1)
    q = rotate_partial(layer.q_norm(q), positions_B, c.rotary_dim, c.rope_theta)
    k = layer.k_norm(layer.k_proj(x_BD).view(batch, c.num_kv_heads, c.head_dim))
    cache.keys_BTGE[rows, positions_B] = rotate_partial(k, positions_B, c.rotary_dim, c.rope_theta)
    cache.values_BTGE[rows, positions_B] = layer.v_proj(x_BD).view(batch, c.num_kv_heads, c.head_dim)
    group = c.num_heads // c.num_kv_heads
    keys = cache.keys_BTGE[:, :length].repeat_interleave(group, dim=2)
    values = cache.values_BTGE[:, :length].repeat_interleave(group, dim=2)
    scores = torch.einsum("bhe,bthe->bht", q, keys).float() * layer.scale
    visible = torch.arange(length, device=x_BD.device).unsqueeze(0) <= positions_B.unsqueeze(1)
    weights = torch.softmax(scores.masked_fill(~visible.unsqueeze(1), float("-inf")), dim=-1)
    o = torch.einsum("bht,bthe->bhe", weights.to(values.dtype), values).reshape(batch, -1)
    return layer.o_proj(o * torch.sigmoid(gate.reshape(batch, -1)))
