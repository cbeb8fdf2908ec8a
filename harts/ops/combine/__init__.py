"""The MoE combine: each row's weighted sum of its k expert outputs, out_ND = Σ_k p_NK · y_NKD.

- `naive_combine`: one batched [1, k] × [k, D] product in the weights' precision (naive.py).
- `fused_combine`: one Triton kernel each way for fp32 weights and bf16/fp16 outputs (fused.py,
  CUDA; imported lazily).
- `combine`: the fused kernel on CUDA for fp32 weights and half-precision outputs, else the reference.
- `gather_combine`: the same sum (or the plain sum over k) with the k outputs of row n at rows y[rows[n, k]],
  optionally plus an addend and rounded once to an output dtype (`fused_gather_combine` on CUDA,
  `naive_gather_combine` elsewhere); not differentiable.
"""

import torch

from harts.ops.combine.naive import naive_combine, naive_gather_combine

__all__ = [
    "combine", "fused_combine", "fused_gather_combine", "gather_combine", "naive_combine", "naive_gather_combine",
]


def combine(probs_NK: torch.Tensor, y_NKD: torch.Tensor) -> torch.Tensor:
    """Σ_k p · y in p's precision: `fused_combine` on CUDA (fp32 p, bf16/fp16 y), else `naive_combine`."""
    if y_NKD.is_cuda and y_NKD.dtype in (torch.bfloat16, torch.float16) and probs_NK.dtype == torch.float32:
        from harts.ops.combine.fused import fused_combine

        return fused_combine(probs_NK, y_NKD)
    return naive_combine(probs_NK, y_NKD)


def gather_combine(probs_NK: torch.Tensor | None, y_RD: torch.Tensor, rows_NK: torch.Tensor,
                   add_ND: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Σ_k p[n, k] · y[rows[n, k]] in p's precision (plus `add_ND`, rounded once to `out_dtype`), or without p the
    plain sum in y's dtype: the fused kernel on CUDA for half-precision y (and fp32 p), else the reference."""
    if y_RD.is_cuda and y_RD.dtype in (torch.bfloat16, torch.float16) and (
            probs_NK is None or probs_NK.dtype == torch.float32):
        from harts.ops.combine.fused import fused_gather_combine

        return fused_gather_combine(probs_NK, y_RD, rows_NK, add_ND, out_dtype)
    return naive_gather_combine(probs_NK, y_RD, rows_NK, add_ND, out_dtype)


def __getattr__(name: str):
    if name in ("fused_combine", "fused_gather_combine"):
        from harts.ops.combine import fused

        return getattr(fused, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
