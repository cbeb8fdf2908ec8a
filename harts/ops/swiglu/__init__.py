"""SwiGLU's activation on a fused gate/up projection: y = silu(gate) ⊙ up for rows [gate | up], optionally
clipped after the activation: min(silu(gate), L) ⊙ clamp(up, −L, L) (BailingHybrid's SwiGLU limits).

- `naive_swiglu`: the PyTorch expression (naive.py), what every CPU path runs.
- `fused_swiglu`: one Triton kernel forward and one backward, fp32 inside, one rounding (fused.py,
  CUDA; imported lazily).
- `swiglu`: the fused kernel on CUDA, the PyTorch expression elsewhere.
- `weighted_swiglu_backward`: the closed-form backward of weight_R · swiglu(gate_up) (the lean MoE
  experts'): `fused_weighted_swiglu_backward` (one Triton kernel) on CUDA, else
  `naive_weighted_swiglu_backward`; both tested against autograd of the expression.
"""

import torch

from harts.ops import uses_fp32_kernels
from harts.ops.swiglu.naive import naive_swiglu, naive_weighted_swiglu_backward

__all__ = [
    "fused_swiglu",
    "fused_weighted_swiglu_backward",
    "naive_swiglu",
    "naive_weighted_swiglu_backward",
    "swiglu",
    "weighted_swiglu_backward",
]


def swiglu(gate_up_RF2: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(gate) ⊙ up for [..., 2F] = [gate | up] → [..., F] (each factor clipped to `limit` when one is given):
    `fused_swiglu` over the rows on CUDA (fp32 inside, so not for fp64 rows, the tests' exact mode), else
    `naive_swiglu`."""
    if uses_fp32_kernels(gate_up_RF2):
        from harts.ops.swiglu.fused import fused_swiglu

        leading = gate_up_RF2.shape[:-1]
        out = fused_swiglu(gate_up_RF2.reshape(-1, gate_up_RF2.shape[-1]), limit)
        return out.view(*leading, out.shape[-1])
    return naive_swiglu(gate_up_RF2, limit)


def weighted_swiglu_backward(
    gate_up_RF2: torch.Tensor, weight_R: torch.Tensor, grad_RF: torch.Tensor, limit: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d gate_up, d weight, weight · swiglu(gate_up, limit)) for out = weight[:, None] · swiglu(gate_up, limit)
    and grad = d out: the fused kernel on CUDA (not for fp64 rows), else the PyTorch closed form."""
    if uses_fp32_kernels(gate_up_RF2):
        from harts.ops.swiglu.fused import fused_weighted_swiglu_backward

        return fused_weighted_swiglu_backward(gate_up_RF2, weight_R, grad_RF, limit)
    return naive_weighted_swiglu_backward(gate_up_RF2, weight_R, grad_RF, limit)


def __getattr__(name: str):
    if name in ("fused_swiglu", "fused_weighted_swiglu_backward"):
        from harts.ops.swiglu import fused

        return getattr(fused, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
