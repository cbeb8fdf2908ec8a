"""Expert selection as one Triton kernel: each program loads BN rows of selection scores once and picks, in
registers, the rows' best groups and then their top-k experts, where the reference composes sorts, top-k's,
a scatter and a masked fill over [N, E] tensors (about ten kernels per MoE layer).

Each pick is an argmax that takes the lowest index among equal maxima, so that the result equals
`naive_select_experts` (stable sorts) exactly, ties included; the scores are compared in fp32, which orders
bf16/fp16 values as they are, and a group's score (the sum of its two best) is rounded to the scores' dtype as
the reference's sum is. Tested against `naive_select_experts` under the Triton interpreter on CPU and on CUDA
(tests/ops/routing/test_select.py).

Legend: N rows, E experts (EP: the next power of two), G groups of GS = E/G experts (GP: the next power of
two), TG groups a row keeps, K experts a row picks, BN rows per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harts.ops.routing.naive import check_selection

BLOCK_ROWS = 16
NOT_FREE = tl.constexpr(-2**31 + 1)
"""Below every order key: what an entry that may not be picked compares as."""


@triton.jit
def _order_keys(x):
    """int32 keys that order fp32 values as the reference's sort does: −0 as +0, every NaN above +inf."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(x != x, 0x7FC00000, tl.where(x == 0, 0, bits))
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _key_values(keys):
    """The fp32 values of order keys."""
    return tl.where(keys < 0, keys ^ 0x7FFFFFFF, keys).to(tl.float32, bitcast=True)


@triton.jit
def _argmax_lowest(keys, free, o_x, WIDTH: tl.constexpr):
    """Per row: the largest free key and the lowest index holding it, as [BN] int32 each."""
    best = tl.max(tl.where(free, keys, NOT_FREE), axis=1)
    return best, tl.min(tl.where(free & (keys == best[:, None]), o_x[None, :], WIDTH), axis=1)


@triton.jit
def _select_experts_kernel(
    selection, experts, N, E: tl.constexpr, EP: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
    TG: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
):
    o_n = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    m_n = o_n < N
    o_e = tl.arange(0, EP)
    free = m_n[:, None] & (o_e < E)[None, :]
    b_x = tl.load(selection + o_n[:, None] * E + o_e[None, :], mask=free, other=0.0)
    dtype = b_x.dtype
    b_key = _order_keys(b_x.to(tl.float32))
    if G > 1:
        group = o_e // (E // G)
        o_g = tl.arange(0, GP)
        b_group_key = tl.full([BN, GP], NOT_FREE, tl.int32)
        for g in tl.static_range(G):
            in_g = free & (group == g)[None, :]
            best, first = _argmax_lowest(b_key, in_g, o_e, EP)
            second = tl.max(tl.where(in_g & (o_e[None, :] != first[:, None]), b_key, NOT_FREE), axis=1)
            # the sum of the two best, rounded to the scores' dtype as the reference's sum is
            total = (_key_values(best) + _key_values(second)).to(dtype).to(tl.float32)
            b_group_key = tl.where(o_g[None, :] == g, _order_keys(total)[:, None], b_group_key)
        free_g = m_n[:, None] & (o_g < G)[None, :]
        allowed = tl.zeros([BN, EP], dtype=tl.int1)
        for _ in tl.static_range(TG):
            _, kept = _argmax_lowest(b_group_key, free_g, o_g, GP)
            free_g = free_g & (o_g[None, :] != kept[:, None])
            allowed = allowed | (group[None, :] == kept[:, None])
        free = free & allowed  # not a −inf fill: that would tie with a −inf score
    for j in tl.static_range(K):
        _, pick = _argmax_lowest(b_key, free, o_e, EP)
        free = free & (o_e[None, :] != pick[:, None])
        tl.store(experts + o_n * K + j, pick.to(tl.int64), mask=m_n)


def fused_select_experts(
    selection_NE: torch.Tensor, top_k: int, num_groups: int = 1, topk_groups: int = 1
) -> torch.Tensor:
    """`naive_select_experts` as one kernel (module docstring): int64 [N, top_k]."""
    check_selection(selection_NE, top_k, num_groups, topk_groups)
    selection_NE = selection_NE.contiguous()
    rows, num_experts = selection_NE.shape
    experts = torch.empty(rows, top_k, dtype=torch.int64, device=selection_NE.device)
    if rows:
        _select_experts_kernel[(triton.cdiv(rows, BLOCK_ROWS),)](
            selection_NE, experts, rows, E=num_experts, EP=triton.next_power_of_2(num_experts), G=num_groups,
            GP=triton.next_power_of_2(num_groups), TG=topk_groups, K=top_k, BN=BLOCK_ROWS,
        )
    return experts
