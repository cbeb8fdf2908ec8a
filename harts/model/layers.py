"""Layers of the hybrid model, written over rows and a row layout.

Every layer maps rows x_RD to rows y_RD. What makes rows "packed trajectories" (the baseline)
or "compact rows of a tree" (HARTS) is the `Layout` (harts.runtime.layout) passed in: it owns
the path positions, the causal-conv predecessor index, the KDA call execution and the attention
query groups. Per-row work (projections, norms, gates, MLPs) is identical in both executions, so
the same weights compute the same function (tests/model/test_equivalence.py).

- `KDALayer`: q/k/v projections, short causal conv (width 4) + SiLU on each, low-rank decay gate
  g = -exp(A_log)·softplus(f(x) + dt_bias) (per channel, log space), β = sigmoid(b(x)), KDA with
  L2-normalised q/k, output gate + RMSNorm (o = RMSNorm(o)·sigmoid(gate)), output projection;
  the gate's full-rank projection has a bias unless `output_gate_bias` is off (Kimi-Linear).
  BailingHybrid's variant: f and g each one full-rank projection (`full_rank_gates`), and the bounded
  gate g = b·sigmoid(exp(A_log)·(f(x) + dt_bias)) (`gate_lower_bound` b).
- `MLALayer`: DeepSeek-V2 multi-head latent attention: optional low-rank query, KV compressed
  to `kv_lora_rank` + a shared decoupled RoPE key; RoPE on the original path positions (or
  NoPE when qk_rope_head_dim = 0, or with `use_rope` off: Kimi-Linear keeps the decoupled part
  but never rotates it), of the halves or of adjacent pairs (`rope_interleave`); BailingHybrid's gated
  MLA scales each head's output by sigmoid(x·g_h) (`output_gate`) and may carry biases (`attention_bias`).
- `SwiGLU`: the dense MLP of the first layers.
On CUDA the KDA layer's short conv + SiLU (`Layout.causal_conv_silu`), its decay gate
(`harts.ops.kda.gate.kda_gate`: fla's kernel), its output gate (`harts.ops.norm_gate`) and every SwiGLU
activation (`harts.ops.swiglu`) run as fused Triton kernels (fp32 inside, one rounding); elsewhere as PyTorch
expressions, their references.
- `RMSNorm`: fp32 inside, one rounding (`rms_norm_reference`); on CUDA with x and weight of one
  dtype (bf16 parameters) torch's fused kernel, tested against the reference on the GPU.
Legend: R rows, P KDA rows (harts.runtime.layout), D hidden, H heads, K/V KDA head dims, E = qk
head dim, F = v head dim of MLA.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from harts.model.config import KDAConfig, MLAConfig
from harts.ops.kda.gate import kda_gate
from harts.ops.norm_gate import norm_gate
from harts.ops.swiglu import swiglu
from harts.runtime.layout import Layout


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) · weight over the last dim, computed in fp32 and rounded once to x's dtype."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, fused: bool | None = None) -> torch.Tensor:
    """`rms_norm_reference`'s function through `F.rms_norm`, which on CUDA is torch's fused kernel
    (one pass, fp32 inside, one rounding) instead of seven elementwise kernels over fp32 copies.
    `fused=None`: fused on CUDA when x and weight have one dtype (bf16 parameters), else the reference."""
    if fused is None:
        fused = x.is_cuda and weight.dtype == x.dtype
    if fused:
        return F.rms_norm(x, (x.shape[-1],), weight, eps).to(x.dtype)
    return rms_norm_reference(x, weight, eps)


class RMSNorm(nn.Module):
    """x / rms(x) · w, or with `zero_centered` x / rms(x) · (1 + w) in fp32 with w starting at 0 (Qwen3-Next's
    convention, `ModelConfig.norm_zero_centered`)."""

    def __init__(self, dim: int, eps: float, *, zero_centered: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.zero_centered:
            return rms_norm(x, 1.0 + self.weight.float(), self.eps)
        return rms_norm(x, self.weight, self.eps)


def apply_rope(x_RHE: torch.Tensor, positions_R: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (half-split convention) at the given path positions, computed in fp32."""
    dim = x_RHE.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=x_RHE.device, dtype=torch.float32) / dim))
    angles = positions_R.float().unsqueeze(-1) * inv_freq
    cos = angles.cos().unsqueeze(1)
    sin = angles.sin().unsqueeze(1)
    x32 = x_RHE.float()
    first, second = x32[..., : dim // 2], x32[..., dim // 2 :]
    rotated = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    return rotated.to(x_RHE.dtype)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(swiglu(self.gate_up(x)))


class KDALayer(nn.Module):
    def __init__(self, hidden: int, config: KDAConfig, norm_eps: float) -> None:
        super().__init__()
        heads, head_dim = config.num_heads, config.head_dim
        rank = config.gate_rank or head_dim
        self.num_heads, self.head_dim = heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        # Depthwise causal conv weights [channels, width]; the last column multiplies the row itself.
        self.q_conv = nn.Parameter(torch.empty(heads * head_dim, config.conv_size))
        self.k_conv = nn.Parameter(torch.empty(heads * head_dim, config.conv_size))
        self.v_conv = nn.Parameter(torch.empty(heads * head_dim, config.conv_size))
        if config.full_rank_gates:
            self.f_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        else:
            self.f_proj = nn.Sequential(nn.Linear(hidden, rank, bias=False),
                                        nn.Linear(rank, heads * head_dim, bias=False))
        self.A_log = nn.Parameter(torch.empty(heads))
        self.dt_bias = nn.Parameter(torch.empty(heads * head_dim))
        self.gate_lower_bound = config.gate_lower_bound
        self.b_proj = nn.Linear(hidden, heads, bias=False)
        if config.full_rank_gates:
            self.g_proj = nn.Linear(hidden, heads * head_dim, bias=config.output_gate_bias)
        else:
            self.g_proj = nn.Sequential(
                nn.Linear(hidden, rank, bias=False), nn.Linear(rank, heads * head_dim, bias=config.output_gate_bias)
            )
        self.o_norm = RMSNorm(head_dim, norm_eps)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    @torch.no_grad()
    def reset_kda_parameters(self, generator: torch.Generator) -> None:
        """Conv, decay and dt initialisation in place, from a generator on the parameters' device."""
        for conv in (self.q_conv, self.k_conv, self.v_conv):
            bound = 1.0 / math.sqrt(conv.shape[1])
            conv.uniform_(-bound, bound, generator=generator)
        self.A_log.uniform_(1, 16, generator=generator).log_()
        # dt in [1e-3, 1e-1] log-uniformly, stored as its softplus inverse.
        dt = self.dt_bias.uniform_(math.log(1e-3), math.log(1e-1), generator=generator).exp()
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def decay(self, x_PD: torch.Tensor) -> torch.Tensor:
        """fp32 [P, H, K] log-space decay gate of the rows (`kda_gate`, bounded with `gate_lower_bound`)."""
        f_PHK = self.f_proj(x_PD).view(x_PD.shape[0], self.num_heads, self.head_dim)
        return kda_gate(f_PHK, self.A_log, self.dt_bias, self.gate_lower_bound)

    def forward(self, x_RD: torch.Tensor, layout: Layout) -> torch.Tensor:
        # Everything up to the output projection runs on the KDA calls' rows (the compact
        # execution repeats its few replay rows there), so only x and the output move.
        x_PD = layout.kda_rows(x_RD)
        rows = x_PD.shape[0]
        shape = (rows, self.num_heads, self.head_dim)
        # q, k and v as one GEMM and one conv over their concatenated channels (the same function
        # as three: every channel has its own weights), a third of the kernels.
        qkv_weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        conv_weight = torch.cat([self.q_conv, self.k_conv, self.v_conv])
        q, k, v = (part.reshape(shape) for part in layout.causal_conv_silu(F.linear(x_PD, qkv_weight), conv_weight, 3))
        if torch.is_grad_enabled():
            # The KDA call keeps v for its backward but q and k only as their L2-normalised copies: v as its
            # own tensor lets the conv's q and k go after the call instead of living on as v's siblings in
            # one buffer (8 KB a row per kept KDA layer at 16 x 128 in bf16; the copy is 4 KB a row).
            v = v.clone()
        g = self.decay(x_PD)
        beta = torch.sigmoid(self.b_proj(x_PD).float())
        o = layout.linear_attention(q, k, v, g, beta)
        o = norm_gate(o, self.g_proj(x_PD).view(shape), self.o_norm.weight, self.o_norm.eps)
        return layout.from_kda_rows(self.o_proj(o.reshape(rows, -1).to(x_RD.dtype)))


class MLALayer(nn.Module):
    def __init__(self, hidden: int, config: MLAConfig, norm_eps: float) -> None:
        super().__init__()
        self.config = config
        heads = config.num_heads
        self.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        latent_eps = norm_eps if config.latent_norm_eps is None else config.latent_norm_eps
        bias = config.attention_bias
        if config.q_lora_rank:
            self.q_proj = nn.Sequential(
                nn.Linear(hidden, config.q_lora_rank, bias=bias),
                RMSNorm(config.q_lora_rank, latent_eps),
                nn.Linear(config.q_lora_rank, heads * self.qk_head_dim, bias=False),
            )
        else:
            self.q_proj = nn.Linear(hidden, heads * self.qk_head_dim, bias=False)
        self.kv_a_proj = nn.Linear(hidden, config.kv_lora_rank + config.qk_rope_head_dim, bias=bias)
        self.kv_norm = RMSNorm(config.kv_lora_rank, latent_eps)
        self.kv_b_proj = nn.Linear(
            config.kv_lora_rank, heads * (config.qk_nope_head_dim + config.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(heads * config.v_head_dim, hidden, bias=bias)
        self.g_proj = nn.Linear(hidden, heads, bias=False) if config.output_gate else None
        self.scale = self.qk_head_dim ** -0.5

    def rotate(self, x_RHE: torch.Tensor, positions_R: torch.Tensor) -> torch.Tensor:
        """RoPE of the decoupled part at the given positions: the halves rotated, or with `rope_interleave` the
        adjacent pairs (the halves' rotation of the de-interleaved x)."""
        if self.config.rope_interleave:
            x_RHE = torch.cat([x_RHE[..., 0::2], x_RHE[..., 1::2]], dim=-1)
        return apply_rope(x_RHE, positions_R, self.config.rope_theta)

    def gate_output(self, o_RHF: torch.Tensor, x_RD: torch.Tensor) -> torch.Tensor:
        """o with each head scaled by sigmoid(x·g_h) (computed in fp32, rounded to o's dtype) when `output_gate`."""
        if self.g_proj is None:
            return o_RHF
        return o_RHF * torch.sigmoid(self.g_proj(x_RD).float()).to(o_RHF.dtype).unsqueeze(-1)

    def forward(self, x_RD: torch.Tensor, layout: Layout) -> torch.Tensor:
        config = self.config
        rows, heads = x_RD.shape[0], config.num_heads
        q = self.q_proj(x_RD).view(rows, heads, self.qk_head_dim)
        compressed, k_rope = self.kv_a_proj(x_RD).split([config.kv_lora_rank, config.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_norm(compressed)).view(rows, heads, config.qk_nope_head_dim + config.v_head_dim)
        k_nope, v = kv.split([config.qk_nope_head_dim, config.v_head_dim], dim=-1)
        if config.qk_rope_head_dim:
            k_rope = k_rope.unsqueeze(1)
            if config.use_rope:
                q_nope, q_rope = q.split([config.qk_nope_head_dim, config.qk_rope_head_dim], dim=-1)
                q = torch.cat([q_nope, self.rotate(q_rope, layout.positions)], dim=-1)
                k_rope = self.rotate(k_rope, layout.positions)
            k = torch.cat([k_nope, k_rope.expand(-1, heads, -1)], dim=-1)
        else:
            k = k_nope
        o = self.gate_output(layout.attention(q, k, v, self.scale), x_RD)
        return self.o_proj(o.reshape(rows, heads * config.v_head_dim))
