"""Layers of the Gated DeltaNet family (Qwen3-Next, Qwen3.5), written over rows and a row layout like
harts.model.layers: per-row work is the same in both executions, the layout owns the sequence mixing.

- `GDNLayer`: one input projection to q, k, v (the short causal conv + SiLU over their concatenated channels),
  the output gate z, β = sigmoid(b) and the decay input a; per-head decay g = −exp(A_log)·softplus(a + dt_bias);
  the gated delta rule with L2-normalised q/k over the linear-attention rows (`Layout.gated_delta_rule`:
  harts.ops.gdn, HV value heads over H query/key heads); o = RMSNorm(o)·w · silu(z) per value head; the output
  projection. `in_proj`'s rows are [q (H·K) | k (H·K) | v (HV·V) | z (HV·V) | b (HV) | a (HV)], heads in order;
  `conv` [2·H·K + HV·V, W], its last column multiplying the row itself.
- `GatedAttentionLayer`: grouped-query attention over the layout's query groups (as `MLALayer`: the original
  path positions, the compact tree attention), the query projection doubled for a per-head sigmoid output gate
  (`q_proj`'s rows per head: the query's head_dim, then the gate's), RMSNorm of each query and key head, RoPE
  (half-split) on their first `rotary_dim` dimensions, scale head_dim^-1/2; o · sigmoid(gate), then `o_proj`.
This is transformers' `Qwen3NextGatedDeltaNet` / `Qwen3_5GatedDeltaNet` and `Qwen3NextAttention` (the tensor
layouts map in harts.model.hf.qwen3_next; tests/model/test_hf_qwen3_next.py compares the logits).
What runs where: everything per row is PyTorch on every device (no fused kernels yet: the conv + SiLU takes
`Layout.causal_conv_silu`'s fused kernel on CUDA); the gated delta rule runs as harts.ops.gdn says (the baseline:
on CUDA fla's `chunk_gated_delta_rule`, or with `gdn_kernel` kda fla's KDA kernels on the broadcast gate; the
compact calls: fla's KDA kernels on the broadcast gate).
Legend: R rows, P linear-attention rows (harts.runtime.layout), D hidden, H query/key (or attention) heads,
HV value heads, K/V GDN head dims, E attention head dim, G KV heads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from harts.model.config import GatedAttentionConfig, GDNConfig
from harts.model.layers import RMSNorm, apply_rope
from harts.runtime.layout import Layout


def gdn_decay(a_PH: torch.Tensor, A_log_H: torch.Tensor, dt_bias_H: torch.Tensor) -> torch.Tensor:
    """fp32 [P, HV] = −exp(A_log) · softplus(a + dt_bias): the log decay per row and value head."""
    return -A_log_H.float().exp() * F.softplus(a_PH.float() + dt_bias_H.float())


def norm_silu_gate(o_PHV: torch.Tensor, z_PHV: torch.Tensor, weight_V: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(o)·w · silu(z) over the last dim, in fp32, rounded once to o's dtype (Qwen3-Next's gated norm)."""
    o32 = o_PHV.float()
    normed = o32 * torch.rsqrt(o32.square().mean(-1, keepdim=True) + eps) * weight_V.float()
    return (normed * F.silu(z_PHV.float())).to(o_PHV.dtype)


class GDNLayer(nn.Module):
    def __init__(self, hidden: int, config: GDNConfig, norm_eps: float) -> None:
        super().__init__()
        self.config = config
        heads, value_heads = config.num_key_heads, config.num_value_heads
        self.key_width = heads * config.key_head_dim
        self.value_width = value_heads * config.value_head_dim
        self.conv_width = 2 * self.key_width + self.value_width
        self.in_proj = nn.Linear(hidden, self.conv_width + self.value_width + 2 * value_heads, bias=False)
        self.conv = nn.Parameter(torch.empty(self.conv_width, config.conv_size))
        self.A_log = nn.Parameter(torch.empty(value_heads))
        self.dt_bias = nn.Parameter(torch.empty(value_heads))
        self.o_norm = RMSNorm(config.value_head_dim, norm_eps)
        self.o_proj = nn.Linear(self.value_width, hidden, bias=False)

    @torch.no_grad()
    def reset_gdn_parameters(self, generator: torch.Generator) -> None:
        """Conv, decay and dt initialisation in place (as KDA's: conv U(±1/√W), A in [1, 16], dt log-uniform in
        [1e-3, 1e-1] stored as its softplus inverse), from a generator on the parameters' device."""
        bound = 1.0 / math.sqrt(self.conv.shape[1])
        self.conv.uniform_(-bound, bound, generator=generator)
        self.A_log.uniform_(1, 16, generator=generator).log_()
        dt = self.dt_bias.uniform_(math.log(1e-3), math.log(1e-1), generator=generator).exp()
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def forward(self, x_RD: torch.Tensor, layout: Layout) -> torch.Tensor:
        c = self.config
        # As KDALayer: everything up to the output projection on the linear-attention rows.
        x_PD = layout.kda_rows(x_RD)
        rows = x_PD.shape[0]
        weight = self.in_proj.weight
        (mixed,) = layout.causal_conv_silu(F.linear(x_PD, weight[: self.conv_width]), self.conv, 1)
        q, k, v = mixed.split([self.key_width, self.key_width, self.value_width], dim=-1)
        q = q.reshape(rows, c.num_key_heads, c.key_head_dim)
        k = k.reshape(rows, c.num_key_heads, c.key_head_dim)
        v = v.reshape(rows, c.num_value_heads, c.value_head_dim)
        z, b, a = F.linear(x_PD, weight[self.conv_width :]).split(
            [self.value_width, c.num_value_heads, c.num_value_heads], dim=-1)
        g = gdn_decay(a, self.A_log, self.dt_bias)
        beta = torch.sigmoid(b.float())
        o = layout.gated_delta_rule(q, k, v, g, beta)
        o = norm_silu_gate(o, z.reshape(rows, c.num_value_heads, c.value_head_dim), self.o_norm.weight,
                           self.o_norm.eps)
        return layout.from_kda_rows(self.o_proj(o.reshape(rows, -1).to(x_RD.dtype)))


def rotate_partial(x_RHE: torch.Tensor, positions_R: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """RoPE (half-split) on the first `rotary_dim` dimensions of each head, the rest unchanged."""
    if not rotary_dim:
        return x_RHE
    rotated, kept = x_RHE.split([rotary_dim, x_RHE.shape[-1] - rotary_dim], dim=-1)
    return torch.cat([apply_rope(rotated, positions_R, theta), kept], dim=-1)


class GatedAttentionLayer(nn.Module):
    def __init__(self, hidden: int, config: GatedAttentionConfig, norm_eps: float, *, zero_centered: bool) -> None:
        super().__init__()
        self.config = config
        heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_proj = nn.Linear(hidden, heads * 2 * dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * dim, bias=False)
        self.q_norm = RMSNorm(dim, norm_eps, zero_centered=zero_centered)
        self.k_norm = RMSNorm(dim, norm_eps, zero_centered=zero_centered)
        self.o_proj = nn.Linear(heads * dim, hidden, bias=False)
        self.scale = dim**-0.5

    def forward(self, x_RD: torch.Tensor, layout: Layout) -> torch.Tensor:
        c = self.config
        rows = x_RD.shape[0]
        q, gate = self.q_proj(x_RD).view(rows, c.num_heads, 2 * c.head_dim).split(c.head_dim, dim=-1)
        q = rotate_partial(self.q_norm(q), layout.positions, c.rotary_dim, c.rope_theta)
        k = self.k_norm(self.k_proj(x_RD).view(rows, c.num_kv_heads, c.head_dim))
        k = rotate_partial(k, layout.positions, c.rotary_dim, c.rope_theta)
        v = self.v_proj(x_RD).view(rows, c.num_kv_heads, c.head_dim)
        group = c.num_heads // c.num_kv_heads
        if group > 1:
            # Query head i reads KV head i // group (transformers' repeat_kv).
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        o = layout.attention(q, k, v, self.scale).reshape(rows, c.num_heads * c.head_dim)
        return self.o_proj(o * torch.sigmoid(gate.reshape(rows, -1)))
