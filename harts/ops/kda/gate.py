"""KDA's decay gate in log space, per head and channel: g = −exp(A_log) · softplus(f + dt_bias), or, with a
lower bound b < 0 (the bounded "safe" gate of Ling-3 / BailingHybrid and fla's `lower_bound`),
g = b · sigmoid(exp(A_log) · (f + dt_bias)), in (b, 0).

- `naive_kda_gate`: the PyTorch expression in fp32 (any device; the CPU path and the reference).
- `kda_gate`: fla's fused Triton gate (`fla.ops.kda.gate.fused_kda_gate`: one kernel forward, one
  backward with the A_log and dt_bias gradients reduced per row tile; `lower_bound` selects its bounded
  branch) on CUDA, else the reference.
  Both compute in fp32 from the same inputs; tests/ops/kda/test_gate.py compares them under the Triton
  interpreter on CPU (both branches) and on the GPU.
  On NVIDIA GPUs fla's softplus is log2(1 + 2^x) through the approximate `ex2`/`lg2` instructions:
  an absolute error of a few 1e-7 in softplus (so a large relative one, and 0 below x ≈ −16.6, where
  the exact value is under 6e-8), far below the rounding of the bf16 input f (the GPU test bounds it
  on the initialisation's dt range).

Legend: P rows, H heads, K head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_kda_gate(
    f_PHK: torch.Tensor, A_log_H: torch.Tensor, dt_bias_HK: torch.Tensor, lower_bound: float | None = None,
) -> torch.Tensor:
    """fp32 [P, H, K] = −exp(A_log)[h] · softplus(f + dt_bias), or lower_bound · sigmoid(exp(A_log)[h] ·
    (f + dt_bias)) with a lower bound, for f [P, H, K], dt_bias [H·K]."""
    heads, head_dim = f_PHK.shape[-2:]
    gate = f_PHK.float() + dt_bias_HK.float().view(heads, head_dim)
    decay = A_log_H.float().exp().view(1, -1, 1)
    if lower_bound is None:
        return -decay * F.softplus(gate)
    return lower_bound * torch.sigmoid(decay * gate)


def kda_gate(
    f_PHK: torch.Tensor, A_log_H: torch.Tensor, dt_bias_HK: torch.Tensor, lower_bound: float | None = None,
) -> torch.Tensor:
    """`naive_kda_gate`'s function: fla's fused kernel on CUDA, the reference elsewhere."""
    if f_PHK.is_cuda:
        from fla.ops.kda.gate import fused_kda_gate

        if lower_bound is None:
            return fused_kda_gate(f_PHK, A_log_H, dt_bias_HK, output_dtype=torch.float32)
        return fused_kda_gate(f_PHK, A_log_H, dt_bias_HK, lower_bound=lower_bound, output_dtype=torch.float32)
    return naive_kda_gate(f_PHK, A_log_H, dt_bias_HK, lower_bound)
