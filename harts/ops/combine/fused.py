"""The MoE combine as one Triton kernel each way: fp32 weights, bf16/fp16 expert outputs.

Forward: out[n] = Σ_k p[n, k] · y[n, k] in fp32 (each output read once, no fp32 copy of y).
Backward, from g = d out (fp32): dy[n, k] = p[n, k] · g[n] rounded once to y's dtype, and
dp[n, k] = Σ_d y[n, k, d] · g[n, d] accumulated in fp32 over the row's D in tiles — one read of y
and g and one write of dy, where batched GEMMs ran [1, k] × [k, D] products through cuBLAS/MAGMA
kernels that are slow at this shape. Tested against `naive_combine` in fp64 under the Triton
interpreter on CPU and in bf16 on CUDA (tests/ops/combine/test_combine.py).

The two forward kernels compile without multiply-add contraction (`enable_fp_fusion=False`): the k products are
rounded and summed in order, as the interpreter computes them, so that the sums of `fused_combine`, of
`fused_gather_combine` and of its addend variant are the same bits (with contraction the addend's add fused with
the product at k = 1: an H100 measured it).

`fused_gather_combine` is the forward read through a row index (the lean MoE experts' outputs stay in
expert order: no permuted copy), weighted or plain (the routed rows' input gradients summed per row); the
weighted sum can take an addend (the shared expert's output) and round once to the layer's dtype.

Legend: N rows, K experts per row, D hidden size, R = N·K routed rows; BK/BD the tile's experts/columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harts.ops.combine.naive import check_addend

BLOCK_COLUMNS = 512
FORWARD_OPTIONS = {"enable_fp_fusion": False}
"""The forward kernels' compile options: no multiply-add contraction (module docstring)."""


@triton.jit
def _row_tile(D, K: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
    """This program's row n (int64), its K expert slots and this program's columns, with their masks."""
    o_k = tl.arange(0, BK)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    return tl.program_id(0).to(tl.int64), o_k, o_k < K, o_d, o_d < D


@triton.jit
def _combine_forward_kernel(p, y, out, D, K: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
    n, o_k, m_k, o_d, m_d = _row_tile(D, K, BK, BD)
    b_p = tl.load(p + n * K + o_k, mask=m_k, other=0.0)
    b_y = tl.load(y + (n * K + o_k[:, None]) * D + o_d[None, :], mask=m_k[:, None] & m_d[None, :], other=0.0)
    tl.store(out + n * D + o_d, tl.sum(b_p[:, None] * b_y.to(tl.float32), axis=0), mask=m_d)


@triton.jit
def _gather_combine_kernel(p, y, rows, add, out, D, K: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
                           WEIGHTED: tl.constexpr, ADD: tl.constexpr):
    n, o_k, m_k, o_d, m_d = _row_tile(D, K, BK, BD)
    b_r = tl.load(rows + n * K + o_k, mask=m_k, other=0)
    b_y = tl.load(y + b_r[:, None] * D + o_d[None, :], mask=m_k[:, None] & m_d[None, :], other=0.0)
    if WEIGHTED:
        b_p = tl.load(p + n * K + o_k, mask=m_k, other=0.0)
        total = tl.sum(b_p[:, None] * b_y.to(tl.float32), axis=0)
    else:
        total = tl.sum(b_y.to(tl.float32), axis=0)
    if ADD:
        total += tl.load(add + n * D + o_d, mask=m_d, other=0.0).to(tl.float32)
    tl.store(out + n * D + o_d, total.to(out.dtype.element_ty), mask=m_d)


@triton.jit
def _combine_backward_kernel(p, y, g, dp, dy, D, K: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    b_p = tl.load(p + n * K + o_k, mask=m_k, other=0.0)
    acc = tl.zeros([BK], dtype=tl.float32)
    for start in range(0, D, BD):
        o_d = start + tl.arange(0, BD)
        m_d = o_d < D
        m = m_k[:, None] & m_d[None, :]
        b_g = tl.load(g + n * D + o_d, mask=m_d, other=0.0)
        offsets = (n * K + o_k[:, None]) * D + o_d[None, :]
        b_y = tl.load(y + offsets, mask=m, other=0.0).to(tl.float32)
        acc += tl.sum(b_y * b_g[None, :], axis=1)
        tl.store(dy + offsets, (b_p[:, None] * b_g[None, :]).to(dy.dtype.element_ty), mask=m)
    tl.store(dp + n * K + o_k, acc, mask=m_k)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, probs_NK, y_NKD):
        probs_NK, y_NKD = probs_NK.contiguous(), y_NKD.contiguous()
        num_rows, top_k, hidden = y_NKD.shape
        out = torch.empty(num_rows, hidden, dtype=torch.float32, device=y_NKD.device)
        if num_rows:
            _combine_forward_kernel[(num_rows, triton.cdiv(hidden, BLOCK_COLUMNS))](
                probs_NK, y_NKD, out, hidden, K=top_k, BK=triton.next_power_of_2(top_k), BD=BLOCK_COLUMNS,
                **FORWARD_OPTIONS,
            )
        ctx.save_for_backward(probs_NK, y_NKD)
        return out

    @staticmethod
    def backward(ctx, grad_ND):
        probs_NK, y_NKD = ctx.saved_tensors
        num_rows, top_k, hidden = y_NKD.shape
        grad_probs = torch.empty_like(probs_NK)
        grad_y = torch.empty_like(y_NKD)
        if num_rows:
            _combine_backward_kernel[(num_rows,)](
                probs_NK, y_NKD, grad_ND.float().contiguous(), grad_probs, grad_y, hidden, K=top_k,
                BK=triton.next_power_of_2(top_k), BD=BLOCK_COLUMNS,
            )
        return grad_probs, grad_y


def fused_combine(probs_NK: torch.Tensor, y_NKD: torch.Tensor) -> torch.Tensor:
    """fp32 [N, D] = Σ_k probs[:, k] · y[:, k] for fp32 probs [N, K] and bf16/fp16 y [N, K, D];
    differentiable in both (dy in y's dtype, dprobs fp32).

    Example:
        >>> out = fused_combine(routing.probs_NK, y_RD.view(num_rows, top_k, -1))  # on CUDA
    """
    if probs_NK.dtype != torch.float32 or y_NKD.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"fused_combine: expected fp32 weights and bf16/fp16 outputs, got {probs_NK.dtype} "
                         f"and {y_NKD.dtype}")
    if y_NKD.dim() != 3 or probs_NK.shape != y_NKD.shape[:2]:
        raise ValueError(f"fused_combine: weights {tuple(probs_NK.shape)} do not match outputs {tuple(y_NKD.shape)}")
    return _Combine.apply(probs_NK, y_NKD)


def fused_gather_combine(probs_NK: torch.Tensor | None, y_RD: torch.Tensor, rows_NK: torch.Tensor,
                         add_ND: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Σ_k probs[n, k] · y[rows[n, k]] for bf16/fp16 y in expert order, read through the row index (no [N, K, D]
    copy): fp32 [N, D] with fp32 weights, the forward `fused_combine` computes on y[rows] bit for bit; without
    weights, the plain sum rounded once to y's dtype. With weights, `add_ND` [N, D] is added to the fp32 sum and
    `out_dtype` rounds the result once (the MoE's shared expert and its cast, without an fp32 [N, D] pass each):
    bit for bit `(Σ + add.float()).to(out_dtype)`. Not differentiable (the lean experts' node is)."""
    if y_RD.dtype not in (torch.bfloat16, torch.float16) or (probs_NK is not None and probs_NK.dtype != torch.float32):
        raise ValueError(f"fused_gather_combine: expected bf16/fp16 rows and fp32 weights, got {y_RD.dtype} and "
                         f"{None if probs_NK is None else probs_NK.dtype}")
    if rows_NK.dim() != 2 or (probs_NK is not None and probs_NK.shape != rows_NK.shape) or y_RD.dim() != 2:
        raise ValueError(f"fused_gather_combine: rows {tuple(rows_NK.shape)}, weights "
                         f"{None if probs_NK is None else tuple(probs_NK.shape)} and outputs {tuple(y_RD.shape)} "
                         "do not match")
    num_rows, top_k = rows_NK.shape
    hidden = y_RD.shape[1]
    check_addend(probs_NK, add_ND, out_dtype, (num_rows, hidden), "fused_gather_combine")
    if out_dtype is None:
        out_dtype = y_RD.dtype if probs_NK is None else torch.float32
    y_RD, rows_NK = y_RD.contiguous(), rows_NK.contiguous()
    out = torch.empty(num_rows, hidden, dtype=out_dtype, device=y_RD.device)
    if num_rows:
        _gather_combine_kernel[(num_rows, triton.cdiv(hidden, BLOCK_COLUMNS))](
            y_RD if probs_NK is None else probs_NK.contiguous(), y_RD, rows_NK,
            y_RD if add_ND is None else add_ND.contiguous(), out, hidden, K=top_k,
            BK=triton.next_power_of_2(top_k), BD=BLOCK_COLUMNS, WEIGHTED=probs_NK is not None, ADD=add_ND is not None,
            **FORWARD_OPTIONS,
        )
    return out

