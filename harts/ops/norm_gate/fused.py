"""The KDA output gate as one Triton kernel each way: y = RMSNorm(o)·w · sigmoid(gate) over rows of the head
dim (the rows of o [N, H, D] flattened to N·H), fp32 inside and one rounding.

PyTorch ran it as a norm kernel, a sigmoid and a product, and kept the norm's output and the sigmoid for the
backward besides o; here the forward reads o and the gate once, writes y and each row's fp32 1/rms, and the
autograd node keeps o, the gate and 1/rms. The backward recomputes n = o/rms and s = sigmoid(gate) and writes,
from dy,
  d gate = dy · n·w · s·(1 − s),   dn = dy · s · w,   d o = (dn − n · mean(dn · n)) / rms,
and each program's fp32 partial sum of dy · s · n over its rows for dw (summed in order afterwards). Every
row's values are computed by the same tile code whatever the number of rows, so a row gets the same bits in
both executions. Tested against `naive_norm_gate` in fp64 under the Triton interpreter on CPU and in bf16 on
CUDA (tests/ops/norm_gate/test_norm_gate.py).

Legend: N rows (tokens · heads), D head dim, BN/BD the tile's rows/columns (BD ≥ D, a power of two).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 16


@triton.jit
def _rows(N, D, BN: tl.constexpr, BD: tl.constexpr):
    o_n = tl.program_id(0) * BN + tl.arange(0, BN)
    o_d = tl.arange(0, BD)
    return o_n, o_n[:, None].to(tl.int64) * D + o_d[None, :], (o_n < N)[:, None] & (o_d < D)[None, :], o_d < D


@triton.jit
def _norm_gate_forward_kernel(o, gate, w, y, rstd, N, D, eps, BN: tl.constexpr, BD: tl.constexpr):
    o_n, offsets, m, m_d = _rows(N, D, BN, BD)
    b_o = tl.load(o + offsets, mask=m, other=0.0).to(tl.float32)
    b_g = tl.load(gate + offsets, mask=m, other=0.0).to(tl.float32)
    b_w = tl.load(w + tl.arange(0, BD), mask=m_d, other=0.0).to(tl.float32)
    b_r = 1.0 / tl.sqrt(tl.sum(b_o * b_o, axis=1) / D + eps)
    out = b_o * b_r[:, None] * b_w[None, :] * tl.sigmoid(b_g)
    tl.store(y + offsets, out.to(y.dtype.element_ty), mask=m)
    tl.store(rstd + o_n, b_r, mask=o_n < N)


@triton.jit
def _norm_gate_backward_kernel(o, gate, w, rstd, dy, do, dgate, dw_partial, N, D, BN: tl.constexpr,
                               BD: tl.constexpr):
    o_n, offsets, m, m_d = _rows(N, D, BN, BD)
    b_o = tl.load(o + offsets, mask=m, other=0.0).to(tl.float32)
    b_g = tl.load(gate + offsets, mask=m, other=0.0).to(tl.float32)
    b_dy = tl.load(dy + offsets, mask=m, other=0.0).to(tl.float32)
    b_w = tl.load(w + tl.arange(0, BD), mask=m_d, other=0.0).to(tl.float32)
    b_r = tl.load(rstd + o_n, mask=o_n < N, other=0.0)
    n = b_o * b_r[:, None]
    s = tl.sigmoid(b_g)
    d_gate = b_dy * n * b_w[None, :] * s * (1.0 - s)
    dn = b_dy * s * b_w[None, :]
    d_o = (dn - n * (tl.sum(dn * n, axis=1) / D)[:, None]) * b_r[:, None]
    tl.store(do + offsets, d_o.to(do.dtype.element_ty), mask=m)
    tl.store(dgate + offsets, d_gate.to(dgate.dtype.element_ty), mask=m)
    tl.store(dw_partial + tl.program_id(0).to(tl.int64) * BD + tl.arange(0, BD), tl.sum(b_dy * s * n, axis=0))


class _NormGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o_ND, gate_ND, weight_D, eps):
        num_rows, dim = o_ND.shape
        block = triton.next_power_of_2(dim)
        y = torch.empty_like(o_ND)
        rstd = o_ND.new_empty(num_rows, dtype=torch.float32)
        if num_rows:
            _norm_gate_forward_kernel[(triton.cdiv(num_rows, BLOCK_ROWS),)](
                o_ND, gate_ND, weight_D, y, rstd, num_rows, dim, eps, BN=BLOCK_ROWS, BD=block,
            )
        ctx.save_for_backward(o_ND, gate_ND, weight_D, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        o_ND, gate_ND, weight_D, rstd = ctx.saved_tensors
        num_rows, dim = o_ND.shape
        block = triton.next_power_of_2(dim)
        programs = triton.cdiv(num_rows, BLOCK_ROWS)
        d_o, d_gate = torch.empty_like(o_ND), torch.empty_like(gate_ND)
        partial = o_ND.new_empty(programs, block, dtype=torch.float32)
        if num_rows:
            _norm_gate_backward_kernel[(programs,)](
                o_ND, gate_ND, weight_D, rstd, dy.contiguous(), d_o, d_gate, partial, num_rows, dim,
                BN=BLOCK_ROWS, BD=block,
            )
        d_weight = partial[:, :dim].sum(0).to(weight_D.dtype)
        return d_o, d_gate, d_weight, None


def fused_norm_gate(o_NHD: torch.Tensor, gate_NHD: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(o)·w · sigmoid(gate) over the last dim of o and gate [..., D] (one shape), fp32 inside, rounded
    once to o's dtype; differentiable in o, gate and w.

    Example:
        >>> o = fused_norm_gate(o_PHD, gate_PHD, o_norm.weight, o_norm.eps)  # bf16 on CUDA
    """
    if o_NHD.shape != gate_NHD.shape or weight_D.shape != o_NHD.shape[-1:]:
        raise ValueError(f"fused_norm_gate: o {tuple(o_NHD.shape)}, gate {tuple(gate_NHD.shape)} and weight "
                         f"{tuple(weight_D.shape)} do not match")
    dim = o_NHD.shape[-1]
    y = _NormGate.apply(o_NHD.reshape(-1, dim).contiguous(), gate_NHD.reshape(-1, dim).contiguous(),
                        weight_D.contiguous(), float(eps))
    return y.view(o_NHD.shape)
