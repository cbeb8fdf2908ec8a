"""The KDA output gate in PyTorch: RMSNorm(o)·w · sigmoid(gate) per head over the head dim, rounded as the
model wrote it before the fused kernel (and still runs on CPU): the norm in fp32 rounded to o's dtype
(`harts.model.layers.rms_norm_reference`'s arithmetic), the sigmoid in the gate's dtype, their product in o's
dtype, bit for bit for fp32 and bf16 input. fp64 input stays fp64 throughout (the fused kernel's reference;
`rms_norm_reference` computes in fp32 even then)."""

from __future__ import annotations

import torch


def naive_norm_gate(o_NHD: torch.Tensor, gate_NHD: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = torch.promote_types(o_NHD.dtype, torch.float32)  # fp32 inside; fp64 stays fp64
    o = o_NHD.to(dtype)
    normed = (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * weight_D.to(dtype)).to(o_NHD.dtype)
    return normed * torch.sigmoid(gate_NHD).to(o_NHD.dtype)
