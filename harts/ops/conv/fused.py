"""The shifted causal conv + SiLU as one Triton kernel forward and one backward.

Forward: each program loads W shifted [BR, BC] tiles of x (neighbouring rows, mostly cache hits),
accumulates the taps in fp32, applies SiLU and writes each channel to its part's contiguous
tensor — one read and one write of the rows instead of W multiply-add passes, a SiLU pass and the
parts' copies. Backward recomputes the pre-activation of rows p … p + W − 1 from x (no saved
activation) and computes
  dpre[s] = dy[s] · silu'(pre[s]),  dx[p] = Σ_j w[:, W−1−j] · dpre[p + j],
  dw[:, W−1−j] = Σ_p dpre[p] · x[p − j]
with the weight gradient summed per row tile in fp32 and the tiles summed afterwards (no atomics:
deterministic). `fused_gathered_conv_silu` computes given rows from an explicit tap table with the
same fused multiply-adds in the same order (the rows whose predecessors are not the previous rows:
a row's value must not depend on which kernel computed it, or the two executions would differ).
`fused_conv_silu` runs both as one autograd node: the gathered rows written into the shifted output in
place, skipped by the shifted backward (a row mask) and their taps' gradients added at their rows, with
none of the full-size copies of composing the two nodes with `index_copy` (tested equal to that
composition in every value, under the interpreter).
Tested against `naive_shifted_conv_silu` under the Triton interpreter on CPU (fp32) and on CUDA
(bf16), both executions bitwise equal at every semantic position: tests/ops/conv/test_conv.py.

Legend: P rows, C channels (num_parts · C'), W conv width, BR/BC the tile's rows/channels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tiles as (rows, channels, warps). The backward holds W pre-activation tiles and their tap tiles: smaller
# tiles and two warps keep them in registers. H200, 65,536 × 6,144 bf16, W = 4 (nine tiles timed as
# `harts bench conv-tiles` does, before the command existed): backward 3.4 ms here against 4.8 ms at the
# forward's 32 × 128 × 4 warps; the forward is fastest at 32 × 128, 0.57 ms. The per-tile weight-gradient
# sums double with the smaller tiles: P/16 × C × W fp32, 384 MiB at that shape, freed after the backward.
FORWARD_TILE = (32, 128, 4)
BACKWARD_TILE = (16, 64, 2)


@triton.jit
def _tap_tile(x, rows, o_c, m_c, P, C):
    m = (rows >= 0) & (rows < P)
    offsets = rows[:, None].to(tl.int64) * C + o_c[None, :]
    return tl.load(x + offsets, mask=m[:, None] & m_c[None, :], other=0.0).to(tl.float32)


@triton.jit
def _add_tap(acc, tile, w, o_c, m_c, j, W: tl.constexpr):
    # One explicit fused multiply-add per tap, so the shifted and the gathered kernels round alike.
    b_w = tl.load(w + o_c * W + (W - 1 - j), mask=m_c, other=0.0).to(tl.float32)
    return tl.fma(tile, b_w[None, :], acc)


@triton.jit
def _pre_activation(x, w, rows, o_c, m_c, P, C, W: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    acc = tl.zeros([BR, BC], dtype=tl.float32)
    for j in tl.static_range(W):
        acc = _add_tap(acc, _tap_tile(x, rows - j, o_c, m_c, P, C), w, o_c, m_c, j, W)
    return acc


@triton.jit
def _part_offsets(rows, o_c, P, CP):
    part, channel = o_c // CP, o_c % CP
    return part[None, :].to(tl.int64) * P * CP + rows[:, None].to(tl.int64) * CP + channel[None, :]


@triton.jit
def _conv_silu_forward_kernel(x, w, y, P, C, CP, W: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    o_c = tl.program_id(1) * BC + tl.arange(0, BC)
    m_c = o_c < C
    pre = _pre_activation(x, w, o_r, o_c, m_c, P, C, W, BR, BC)
    out = pre * tl.sigmoid(pre)
    m = (o_r < P)[:, None] & m_c[None, :]
    tl.store(y + _part_offsets(o_r, o_c, P, CP), out.to(y.dtype.element_ty), mask=m)


@triton.jit
def _conv_silu_gathered_forward_kernel(
    x, w, taps, y, N, P, C, CP, W: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
):
    o_i = tl.program_id(0) * BR + tl.arange(0, BR)
    m_i = o_i < N
    o_c = tl.program_id(1) * BC + tl.arange(0, BC)
    m_c = o_c < C
    acc = tl.zeros([BR, BC], dtype=tl.float32)
    for j in tl.static_range(W):
        rows = tl.load(taps + o_i.to(tl.int64) * W + j, mask=m_i, other=P)
        acc = _add_tap(acc, _tap_tile(x, rows, o_c, m_c, P, C), w, o_c, m_c, j, W)
    out = acc * tl.sigmoid(acc)
    tl.store(y + _part_offsets(o_i, o_c, N, CP), out.to(y.dtype.element_ty), mask=m_i[:, None] & m_c[None, :])


@triton.jit
def _conv_silu_backward_kernel(
    x, w, dy, dx, dw_tiles, skip, P, C, CP, W: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
    HAS_SKIP: tl.constexpr,
):
    i_r = tl.program_id(0)
    o_r = i_r * BR + tl.arange(0, BR)
    o_c = tl.program_id(1) * BC + tl.arange(0, BC)
    m_c = o_c < C
    dx_acc = tl.zeros([BR, BC], dtype=tl.float32)
    for i in tl.static_range(W):
        rows = o_r + i
        pre = _pre_activation(x, w, rows, o_c, m_c, P, C, W, BR, BC)
        m = (rows < P)[:, None] & m_c[None, :]
        b_dy = tl.load(dy + _part_offsets(rows, o_c, P, CP), mask=m, other=0.0).to(tl.float32)
        if HAS_SKIP:
            # Rows another kernel computed (the exception rows): their gradient is not this conv's.
            b_skip = tl.load(skip + rows, mask=rows < P, other=0)
            b_dy = tl.where(b_skip[:, None] != 0, 0.0, b_dy)
        sig = tl.sigmoid(pre)
        dpre = b_dy * sig * (1.0 + pre * (1.0 - sig))
        b_w = tl.load(w + o_c * W + (W - 1 - i), mask=m_c, other=0.0).to(tl.float32)
        dx_acc += dpre * b_w[None, :]
        if i == 0:
            for j in tl.static_range(W):
                b_dw = tl.sum(dpre * _tap_tile(x, o_r - j, o_c, m_c, P, C), axis=0)
                tl.store(dw_tiles + (i_r.to(tl.int64) * C + o_c) * W + (W - 1 - j), b_dw, mask=m_c)
    m = (o_r < P)[:, None] & m_c[None, :]
    tl.store(dx + o_r[:, None].to(tl.int64) * C + o_c[None, :], dx_acc.to(dx.dtype.element_ty), mask=m)


def _grid(num_rows: int, channels: int, rows: int, columns: int) -> tuple[int, int]:
    return triton.cdiv(num_rows, rows), triton.cdiv(channels, columns)


def shifted_conv_silu_forward(
    x_PC: torch.Tensor, weight_CW: torch.Tensor, num_parts: int, tile: tuple[int, int, int] = FORWARD_TILE,
) -> torch.Tensor:
    """The forward kernel over contiguous rows at `tile` = (rows, channels, warps); every tile gives the same
    bits (each element's taps are summed in the same order). `harts bench conv-tiles` times the tiles."""
    num_rows, channels = x_PC.shape
    y = x_PC.new_empty(num_parts, num_rows, channels // num_parts)
    if num_rows:
        rows, columns, warps = tile
        _conv_silu_forward_kernel[_grid(num_rows, channels, rows, columns)](
            x_PC, weight_CW, y, num_rows, channels, channels // num_parts, W=weight_CW.shape[1], BR=rows,
            BC=columns, num_warps=warps,
        )
    return y


def shifted_conv_silu_backward(
    x_PC: torch.Tensor, weight_CW: torch.Tensor, dy: torch.Tensor, tile: tuple[int, int, int] = BACKWARD_TILE,
    skip_P: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, fp32 dw) of the backward kernel at `tile`: dx has the same bits at every tile; dw sums the tiles'
    partial sums, so its rounding follows the tile's rows. `skip_P` (bool [P]): rows whose dy is taken as 0
    (the same bits as zeroing those rows of dy first)."""
    num_rows, channels = x_PC.shape
    width = weight_CW.shape[1]
    rows, columns, warps = tile
    grid = _grid(num_rows, channels, rows, columns)
    dx = torch.empty_like(x_PC)
    dw_tiles = torch.empty(grid[0], channels, width, dtype=torch.float32, device=x_PC.device)
    if num_rows:
        _conv_silu_backward_kernel[grid](
            x_PC, weight_CW, dy.contiguous(), dx, dw_tiles, skip_P, num_rows, channels, channels // dy.shape[0],
            W=width, BR=rows, BC=columns, HAS_SKIP=skip_P is not None, num_warps=warps,
        )
    return dx, dw_tiles.sum(dim=0)


class _ShiftedConvSiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_PC, weight_CW, num_parts):
        x_PC, weight_CW = x_PC.contiguous(), weight_CW.contiguous()
        ctx.save_for_backward(x_PC, weight_CW)
        return shifted_conv_silu_forward(x_PC, weight_CW, num_parts)

    @staticmethod
    def backward(ctx, dy):
        x_PC, weight_CW = ctx.saved_tensors
        dx, dw = shifted_conv_silu_backward(x_PC, weight_CW, dy)
        return dx, dw.to(weight_CW.dtype), None


def gathered_conv_silu_forward(x_PC: torch.Tensor, weight_CW: torch.Tensor, taps_NW: torch.Tensor,
                               num_parts: int) -> torch.Tensor:
    """[num_parts, N, C'] of the gathered kernel (contiguous x, weight and taps)."""
    num_rows, channels = x_PC.shape
    y = x_PC.new_empty(num_parts, taps_NW.shape[0], channels // num_parts)
    if taps_NW.shape[0]:
        rows, columns, warps = FORWARD_TILE
        _conv_silu_gathered_forward_kernel[_grid(taps_NW.shape[0], channels, rows, columns)](
            x_PC, weight_CW, taps_NW, y, taps_NW.shape[0], num_rows, channels, channels // num_parts,
            W=weight_CW.shape[1], BR=rows, BC=columns, num_warps=warps,
        )
    return y


def gathered_conv_silu_backward(x_PC, weight_CW, taps_NW, distinct_T, slot_NW, dy):
    """(rows, their fp32 gradient sums [n, C], fp32 dw) of the gathered rows for dy [num_parts, N, C']: the taps'
    gradients summed per distinct row in fp32 (the reference formula over the tap rows only: a few rows)."""
    num_rows, channels = x_PC.shape
    inside = taps_NW < num_rows
    x_NWC = x_PC[taps_NW.clamp(max=num_rows - 1)].float() * inside[..., None]
    weight_WC = weight_CW.float().flip(1).T
    pre = (x_NWC * weight_WC).sum(dim=1)
    sig = torch.sigmoid(pre)
    d_pre = dy.permute(1, 0, 2).reshape(-1, channels).float() * sig * (1 + pre * (1 - sig))
    sums = torch.zeros(len(distinct_T), channels, dtype=torch.float32, device=x_PC.device)
    sums.index_add_(0, slot_NW.reshape(-1), (d_pre[:, None, :] * weight_WC).reshape(-1, channels))
    real = distinct_T < num_rows
    dw = (d_pre[:, None, :] * x_NWC).sum(dim=0).T.flip(1)
    return distinct_T[real], sums[real], dw


class _GatheredConvSiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_PC, weight_CW, taps_NW, num_parts, distinct_T, slot_NW):
        x_PC, weight_CW, taps_NW = x_PC.contiguous(), weight_CW.contiguous(), taps_NW.contiguous()
        ctx.save_for_backward(x_PC, weight_CW, taps_NW, distinct_T, slot_NW)
        return gathered_conv_silu_forward(x_PC, weight_CW, taps_NW, num_parts)

    @staticmethod
    def backward(ctx, dy):
        x_PC, weight_CW, taps_NW, distinct_T, slot_NW = ctx.saved_tensors
        rows, sums, dw = gathered_conv_silu_backward(x_PC, weight_CW, taps_NW, distinct_T, slot_NW, dy)
        dx = torch.zeros_like(x_PC).index_copy_(0, rows, sums.to(x_PC.dtype))
        return dx, dw.to(weight_CW.dtype), None, None, None, None


class _ConvSiLU(torch.autograd.Function):
    """The shifted kernel over all rows with the exception rows' values from the gathered kernel written into its
    output in place; the backward skips those rows in the shifted kernel and adds their taps' gradients to its dx
    at their rows. The values of `_ShiftedConvSiLU` + `index_copy` + `_GatheredConvSiLU` (dx and dw: the same
    bf16 additions; only a zero's sign may differ), without their full-size passes: the out-of-place copy of y,
    the copy of dy with the exception rows zeroed, the zero dx of the gathered rows and the sum of the two dx."""

    @staticmethod
    def forward(ctx, x_PC, weight_CW, num_parts, rows_N, taps_NW, distinct_T, slot_NW):
        x_PC, weight_CW, taps_NW = x_PC.contiguous(), weight_CW.contiguous(), taps_NW.contiguous()
        y = shifted_conv_silu_forward(x_PC, weight_CW, num_parts)
        y.index_copy_(1, rows_N, gathered_conv_silu_forward(x_PC, weight_CW, taps_NW, num_parts))
        ctx.save_for_backward(x_PC, weight_CW, rows_N, taps_NW, distinct_T, slot_NW)
        return y

    @staticmethod
    def backward(ctx, dy):
        x_PC, weight_CW, rows_N, taps_NW, distinct_T, slot_NW = ctx.saved_tensors
        skip_P = torch.zeros(x_PC.shape[0], dtype=torch.bool, device=x_PC.device).index_fill_(0, rows_N, True)
        dx, dw = shifted_conv_silu_backward(x_PC, weight_CW, dy, skip_P=skip_P)
        rows, sums, dw_rows = gathered_conv_silu_backward(x_PC, weight_CW, taps_NW, distinct_T, slot_NW,
                                                          dy.index_select(1, rows_N))
        dx.index_put_((rows,), dx[rows] + sums.to(dx.dtype))
        return dx, dw.to(weight_CW.dtype) + dw_rows.to(weight_CW.dtype), None, None, None, None, None


def fused_gathered_conv_silu(
    x_PC: torch.Tensor, weight_CW: torch.Tensor, taps_NW: torch.Tensor, num_parts: int,
    distinct: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """[num_parts, N, C'] = silu(Σ_j weight[:, W−1−j] · x[taps[n, j]]) for N rows given by their taps
    (column 0 the row itself, column j its j-th predecessor; P = a zero row), with the arithmetic of
    `fused_shifted_conv_silu` (the same fused multiply-adds in the same order): a row gets the same
    bits from either. For the few rows whose predecessors are not the previous rows.

    `distinct` = `torch.unique(taps, return_inverse=True)`, by which the backward sums the taps'
    gradients per row; computed here when not given (its size is data-dependent: on CUDA a host
    synchronisation, which a caller with fixed taps pays once by passing it)."""
    if x_PC.shape[1] % num_parts or taps_NW.dim() != 2 or taps_NW.shape[1] != weight_CW.shape[1]:
        raise ValueError(f"fused_gathered_conv_silu: {x_PC.shape[1]} channels in {num_parts} parts, taps "
                         f"{tuple(taps_NW.shape)} for width {weight_CW.shape[1]}")
    distinct_T, slot_NW = torch.unique(taps_NW, return_inverse=True) if distinct is None else distinct
    return _GatheredConvSiLU.apply(x_PC, weight_CW, taps_NW, num_parts, distinct_T, slot_NW)


def fused_shifted_conv_silu(x_PC: torch.Tensor, weight_CW: torch.Tensor, num_parts: int) -> torch.Tensor:
    """[num_parts, P, C'] = silu(Σ_j weight[:, W−1−j] · x[p − j]), x[p − j] = 0 before row 0, in fp32
    with one rounding to x's dtype; differentiable in x and weight.

    Args:
        x_PC: rows [P, C] (C = num_parts · C').
        weight_CW: depthwise weights [C, W]; column W − 1 multiplies the row itself.
        num_parts: how many contiguous channel blocks the output is split into (KDA: q, k, v).

    Example:
        >>> q, k, v = fused_shifted_conv_silu(x, weight, 3).unbind(0)  # x [P, 3·H·K] on CUDA
    """
    if x_PC.shape[1] % num_parts:
        raise ValueError(f"fused_shifted_conv_silu: {x_PC.shape[1]} channels do not split into {num_parts} parts")
    return _ShiftedConvSiLU.apply(x_PC, weight_CW, num_parts)


def fused_conv_silu(
    x_PC: torch.Tensor, weight_CW: torch.Tensor, num_parts: int,
    exceptions: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`fused_shifted_conv_silu` with the rows `exceptions` = (rows [N], their taps [N, W], and
    `torch.unique(taps, return_inverse=True)`) computed from their taps as `fused_gathered_conv_silu` does,
    in one autograd node (`_ConvSiLU`): the same values as writing the gathered rows into the shifted output."""
    if exceptions is None or not len(exceptions[0]):
        return fused_shifted_conv_silu(x_PC, weight_CW, num_parts)
    rows_N, taps_NW, distinct_T, slot_NW = exceptions
    if x_PC.shape[1] % num_parts or taps_NW.shape != (len(rows_N), weight_CW.shape[1]):
        raise ValueError(f"fused_conv_silu: {x_PC.shape[1]} channels in {num_parts} parts, taps "
                         f"{tuple(taps_NW.shape)} for {len(rows_N)} rows of width {weight_CW.shape[1]}")
    return _ConvSiLU.apply(x_PC, weight_CW, num_parts, rows_N, taps_NW, distinct_T, slot_NW)
