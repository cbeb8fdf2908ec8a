"""The KDA layer's output gate: RMSNorm(o)·w · sigmoid(gate), per head over the head dim.

- `naive_norm_gate`: the PyTorch expression (naive.py), what every CPU path runs (and fp64 rows anywhere).
- `fused_norm_gate`: one Triton kernel forward and one backward, fp32 inside, one rounding; keeps o, the gate
  and 1/rms for the backward instead of the norm's output and the sigmoid (fused.py, CUDA; imported lazily).
- `norm_gate`: the fused kernel on CUDA, the PyTorch expression elsewhere.
"""

import torch

from harts.ops import uses_fp32_kernels
from harts.ops.norm_gate.naive import naive_norm_gate

__all__ = ["fused_norm_gate", "naive_norm_gate", "norm_gate"]


def norm_gate(o_NHD: torch.Tensor, gate_NHD: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(o)·w · sigmoid(gate) over the last dim: `fused_norm_gate` on CUDA (not for fp64 rows), else
    `naive_norm_gate`."""
    if uses_fp32_kernels(o_NHD):
        from harts.ops.norm_gate.fused import fused_norm_gate

        return fused_norm_gate(o_NHD, gate_NHD, weight_D, eps)
    return naive_norm_gate(o_NHD, gate_NHD, weight_D, eps)


def __getattr__(name: str):
    if name == "fused_norm_gate":
        from harts.ops.norm_gate import fused

        return fused.fused_norm_gate
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
