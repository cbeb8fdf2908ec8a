"""Depthwise causal convolution + SiLU over rows (the KDA short conv), split into channel parts.

- `naive_shifted_conv_silu`: the fp32 reference (naive.py).
- `fused_shifted_conv_silu`: one Triton kernel forward and one backward (fused.py, CUDA; imported
  lazily: Triton is only needed where it runs).

Both compute y[part, p, c'] = silu(Σ_j w[c, W−1−j] · x[p − j, c]) (x[p − j] = 0 before row 0,
c = part·C' + c') in fp32 with one rounding, the parts (KDA's q, k, v) written as separate
contiguous tensors. Rows whose predecessors are not the previous rows (paths' starts, forks, call
boundaries) are computed from their taps by a gathered kernel with the same arithmetic; `fused.fused_conv_silu`
does both in one autograd node (`harts.runtime.layout.Layout.causal_conv_silu` calls it).
"""

from harts.ops.conv.naive import naive_shifted_conv_silu

__all__ = ["fused_shifted_conv_silu", "naive_shifted_conv_silu"]


def __getattr__(name: str):
    if name == "fused_shifted_conv_silu":
        from harts.ops.conv.fused import fused_shifted_conv_silu

        return fused_shifted_conv_silu
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
