"""Reference of the shifted causal conv + SiLU: fp32 taps over zero-padded rows, one rounding.

Legend: P rows, C channels (num_parts · C'), W conv width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_shifted_conv_silu(x_PC: torch.Tensor, weight_CW: torch.Tensor, num_parts: int) -> torch.Tensor:
    """[num_parts, P, C'] = silu(Σ_j weight[:, W−1−j] · x[p − j]) with zero rows before row 0,
    accumulated in fp32 (fp64 for fp64 inputs) and rounded once to x's dtype."""
    num_rows, channels = x_PC.shape
    width = weight_CW.shape[1]
    if channels % num_parts:
        raise ValueError(f"naive_shifted_conv_silu: {channels} channels do not split into {num_parts} parts")
    dtype = torch.promote_types(x_PC.dtype, torch.float32)
    padded = torch.cat([x_PC.new_zeros(width - 1, channels), x_PC]).to(dtype)
    weight = weight_CW.to(dtype)
    out = torch.zeros(num_rows, channels, dtype=dtype, device=x_PC.device)
    for j in range(width):
        out = out + padded[width - 1 - j: width - 1 - j + num_rows] * weight[:, width - 1 - j]
    out = F.silu(out).to(x_PC.dtype)
    return out.view(num_rows, num_parts, channels // num_parts).transpose(0, 1).contiguous()
