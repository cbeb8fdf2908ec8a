"""SwiGLU's activation on a fused gate/up projection: y = silu(gate) ⊙ up for rows [gate | up].

- `naive_swiglu`: the PyTorch expression (naive.py), what every CPU path runs.
- `fused_swiglu`: one Triton kernel forward and one backward, fp32 inside, one rounding (fused.py,
  CUDA; imported lazily).
- `swiglu`: the fused kernel on CUDA, the PyTorch expression elsewhere.
"""

import torch

from harts.ops import uses_fp32_kernels
from harts.ops.swiglu.naive import naive_swiglu

__all__ = ["fused_swiglu", "naive_swiglu", "swiglu"]


def swiglu(gate_up_RF2: torch.Tensor) -> torch.Tensor:
    """silu(gate) ⊙ up for [..., 2F] = [gate | up] → [..., F]: `fused_swiglu` over the rows on CUDA (fp32
    inside, so not for fp64 rows, the tests' exact mode), else `naive_swiglu`."""
    if uses_fp32_kernels(gate_up_RF2):
        from harts.ops.swiglu.fused import fused_swiglu

        leading = gate_up_RF2.shape[:-1]
        out = fused_swiglu(gate_up_RF2.reshape(-1, gate_up_RF2.shape[-1]))
        return out.view(*leading, out.shape[-1])
    return naive_swiglu(gate_up_RF2)


def __getattr__(name: str):
    if name == "fused_swiglu":
        from harts.ops.swiglu.fused import fused_swiglu

        return fused_swiglu
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
