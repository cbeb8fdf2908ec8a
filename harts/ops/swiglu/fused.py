"""SwiGLU's activation as one Triton kernel each way, on the gate/up projection's own layout.

The PyTorch expression reads the [R, 2F] projection through two strided halves (torch's slow
non-vectorised path), rounds the SiLU to the input dtype, multiplies, and its backward writes the
halves' gradients separately and concatenates them. Here the forward reads each row's halves and
writes silu(gate)·up once (fp32 inside, one rounding); the backward reads the projection and dy and
writes d[gate | up] into one [R, 2F] tensor:
  dgate = dy · up · σ(g)·(1 + g·(1 − σ(g))),  dup = dy · silu(g).
The weighted backward (the lean MoE experts, whose combine weight w of each routed row is moved onto
its activation: out = w · swiglu(gate_up)) reads the projection and the unweighted gradient once per
row and writes d[gate | up] for dy = w · grad, dw = Σ_f swiglu(gate_up) · grad in fp32, and
w · swiglu(gate_up) (the down projection's weight-gradient operand): one pass where PyTorch made
five.
With a clipping limit L (`HAS_LIMIT`, a compile-time branch: without one the kernels are the unclipped ones)
the activation is min(silu(gate), L) · clamp(up, −L, L) and each factor's gradient passes inside its bound
(bounds included), as `naive_swiglu`'s autograd.
Tested against the fp32 reference under the Triton interpreter on CPU and in bf16 on CUDA
(tests/ops/swiglu/test_swiglu.py), with and without a limit.

Legend: R rows, F the expert (intermediate) size, BR/BF the tile's rows/columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS, BLOCK_COLUMNS = 16, 256


@triton.jit
def _tile(R, F, BR: tl.constexpr, BF: tl.constexpr):
    """This program's rows (int64, as a column), columns and mask."""
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    o_f = tl.program_id(1) * BF + tl.arange(0, BF)
    return o_r[:, None].to(tl.int64), o_f[None, :], (o_r < R)[:, None] & (o_f < F)[None, :]


@triton.jit
def _swiglu_forward_kernel(a, y, R, F, limit, BR: tl.constexpr, BF: tl.constexpr, HAS_LIMIT: tl.constexpr):
    row, col, m = _tile(R, F, BR, BF)
    gate = tl.load(a + row * (2 * F) + col, mask=m, other=0.0).to(tl.float32)
    up = tl.load(a + row * (2 * F) + F + col, mask=m, other=0.0).to(tl.float32)
    if HAS_LIMIT:
        act = tl.minimum(gate * tl.sigmoid(gate), limit) * tl.minimum(tl.maximum(up, -limit), limit)
        tl.store(y + row * F + col, act.to(y.dtype.element_ty), mask=m)
    else:
        tl.store(y + row * F + col, (gate * tl.sigmoid(gate) * up).to(y.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_backward_kernel(a, dy, da, R, F, limit, BR: tl.constexpr, BF: tl.constexpr, HAS_LIMIT: tl.constexpr):
    row, col, m = _tile(R, F, BR, BF)
    gate = tl.load(a + row * (2 * F) + col, mask=m, other=0.0).to(tl.float32)
    up = tl.load(a + row * (2 * F) + F + col, mask=m, other=0.0).to(tl.float32)
    grad = tl.load(dy + row * F + col, mask=m, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    if HAS_LIMIT:
        silu = gate * sig
        d_gate = tl.where(silu <= limit, grad * tl.minimum(tl.maximum(up, -limit), limit) * sig *
                          (1.0 + gate * (1.0 - sig)), 0.0)
        d_up = tl.where((up >= -limit) & (up <= limit), grad * tl.minimum(silu, limit), 0.0)
    else:
        d_gate = grad * up * sig * (1.0 + gate * (1.0 - sig))
        d_up = grad * gate * sig
    tl.store(da + row * (2 * F) + col, d_gate.to(da.dtype.element_ty), mask=m)
    tl.store(da + row * (2 * F) + F + col, d_up.to(da.dtype.element_ty), mask=m)


@triton.jit
def _weighted_backward_kernel(a, w, grad, da, dw, wy, R, F, limit, BR: tl.constexpr, BF: tl.constexpr,
                              HAS_LIMIT: tl.constexpr):
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    m_r = o_r < R
    row = o_r[:, None].to(tl.int64)
    b_w = tl.load(w + o_r, mask=m_r, other=0.0).to(tl.float32)
    acc = tl.zeros([BR], dtype=tl.float32)
    for start in range(0, F, BF):
        col = start + tl.arange(0, BF)[None, :]
        m = m_r[:, None] & (col < F)
        gate = tl.load(a + row * (2 * F) + col, mask=m, other=0.0).to(tl.float32)
        up = tl.load(a + row * (2 * F) + F + col, mask=m, other=0.0).to(tl.float32)
        b_g = tl.load(grad + row * F + col, mask=m, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        scaled = b_g * b_w[:, None]
        if HAS_LIMIT:
            silu = gate * sig
            clipped_silu = tl.minimum(silu, limit)
            clipped_up = tl.minimum(tl.maximum(up, -limit), limit)
            act = clipped_silu * clipped_up
            d_gate = tl.where(silu <= limit, scaled * clipped_up * sig * (1.0 + gate * (1.0 - sig)), 0.0)
            d_up = tl.where((up >= -limit) & (up <= limit), scaled * clipped_silu, 0.0)
            tl.store(da + row * (2 * F) + col, d_gate.to(da.dtype.element_ty), mask=m)
            tl.store(da + row * (2 * F) + F + col, d_up.to(da.dtype.element_ty), mask=m)
        else:
            act = gate * sig * up
            tl.store(da + row * (2 * F) + col,
                     (scaled * up * sig * (1.0 + gate * (1.0 - sig))).to(da.dtype.element_ty), mask=m)
            tl.store(da + row * (2 * F) + F + col, (scaled * gate * sig).to(da.dtype.element_ty), mask=m)
        acc += tl.sum(act * b_g, axis=1)
        tl.store(wy + row * F + col, (act * b_w[:, None]).to(wy.dtype.element_ty), mask=m)
    tl.store(dw + o_r, acc.to(dw.dtype.element_ty), mask=m_r)


def _grid(num_rows: int, columns: int) -> tuple[int, int]:
    return triton.cdiv(num_rows, BLOCK_ROWS), triton.cdiv(columns, BLOCK_COLUMNS)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up_RF2, limit):
        gate_up_RF2 = gate_up_RF2.contiguous()
        num_rows, columns = gate_up_RF2.shape[0], gate_up_RF2.shape[1] // 2
        y = gate_up_RF2.new_empty(num_rows, columns)
        if num_rows:
            _swiglu_forward_kernel[_grid(num_rows, columns)](
                gate_up_RF2, y, num_rows, columns, _limit_value(limit), BR=BLOCK_ROWS, BF=BLOCK_COLUMNS,
                HAS_LIMIT=limit is not None,
            )
        ctx.save_for_backward(gate_up_RF2)
        ctx.limit = limit
        return y

    @staticmethod
    def backward(ctx, dy):
        (gate_up_RF2,) = ctx.saved_tensors
        num_rows, columns = gate_up_RF2.shape[0], gate_up_RF2.shape[1] // 2
        d_gate_up = torch.empty_like(gate_up_RF2)
        if num_rows:
            _swiglu_backward_kernel[_grid(num_rows, columns)](
                gate_up_RF2, dy.contiguous(), d_gate_up, num_rows, columns, _limit_value(ctx.limit), BR=BLOCK_ROWS,
                BF=BLOCK_COLUMNS, HAS_LIMIT=ctx.limit is not None,
            )
        return d_gate_up, None


def _limit_value(limit: float | None) -> float:
    """The kernels' `limit` argument: unused (a placeholder) without a limit, whose branch is compiled out."""
    return 0.0 if limit is None else float(limit)


def fused_swiglu(gate_up_RF2: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """[R, F] = silu(gate) ⊙ up for rows [R, 2F] = [gate | up] (each factor clipped to `limit` when one is
    given), fp32 inside and one rounding to the input dtype; differentiable.

    Example:
        >>> y = fused_swiglu(torch._grouped_mm(x, gate_up_proj, offs=ends))  # [R, 2F] bf16 on CUDA
    """
    if gate_up_RF2.dim() != 2 or gate_up_RF2.shape[1] % 2:
        raise ValueError(f"fused_swiglu: expected rows [R, 2F], got {tuple(gate_up_RF2.shape)}")
    return _SwiGLU.apply(gate_up_RF2, limit)


def fused_weighted_swiglu_backward(
    gate_up_RF2: torch.Tensor, weight_R: torch.Tensor, grad_RF: torch.Tensor, limit: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of out = weight[:, None] · swiglu(gate_up, limit) from grad = d out, one Triton kernel, fp32
    inside: (d gate_up in its dtype, d weight in the weight's dtype, weight · swiglu(gate_up, limit) in gate_up's
    dtype). Tested against `naive_weighted_swiglu_backward`."""
    if gate_up_RF2.dim() != 2 or gate_up_RF2.shape[1] % 2:
        raise ValueError(f"fused_weighted_swiglu_backward: expected rows [R, 2F], got {tuple(gate_up_RF2.shape)}")
    num_rows, columns = gate_up_RF2.shape[0], gate_up_RF2.shape[1] // 2
    if weight_R.shape != (num_rows,) or grad_RF.shape != (num_rows, columns):
        raise ValueError(f"fused_weighted_swiglu_backward: weight {tuple(weight_R.shape)} and gradient "
                         f"{tuple(grad_RF.shape)} do not match rows {tuple(gate_up_RF2.shape)}")
    gate_up_RF2, weight_R, grad_RF = gate_up_RF2.contiguous(), weight_R.contiguous(), grad_RF.contiguous()
    d_gate_up = torch.empty_like(gate_up_RF2)
    d_weight = torch.empty_like(weight_R)
    weighted = gate_up_RF2.new_empty(num_rows, columns)
    if num_rows:
        _weighted_backward_kernel[(triton.cdiv(num_rows, BLOCK_ROWS),)](
            gate_up_RF2, weight_R, grad_RF, d_gate_up, d_weight, weighted, num_rows, columns, _limit_value(limit),
            BR=BLOCK_ROWS, BF=BLOCK_COLUMNS, HAS_LIMIT=limit is not None,
        )
    return d_gate_up, d_weight, weighted
