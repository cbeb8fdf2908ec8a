"""FlashAttention-4's kernels over rows in place with the DFS tree mask: the `flash4_tree` MLA backend's calls.

`flash4_tree_attention(q, k, v, plan, scale)` runs FA4's forward and backward over the rows as one sequence (a batch
of one), reading K and V where they are, with the tree mask (query row r sees key row c iff c <= r <
subtree_end[c]; harts.ops.attention.tree_blocks) given as FA4's block sparsity and a CuTe mask_mod: the tile pairs
no query row of which sees a key row are skipped, full ones run unmasked, partial ones call the mask_mod, which
reads the subtree ends as FA4's aux tensor. `flash4_tree_plan` holds a layout's tiles in FA4's form, from
FlexAttention's `BlockMask` of the tile lists (`tree_blocks.tree_block_sparsity`): by query tile for the forward, by
key tile (the transpose) for the backward, once per layout, tile shape and device.
The kernels are flash-attn-4 4.0.0b36's module functions `_flash_attn_fwd` (log-sum-exp returned) and
`_flash_attn_bwd` with these arguments, as torch's FlexAttention FLASH backend calls them from the code it generates;
called directly, not through a compiled `flex_attention`, nothing compiles but FA4's kernels (once per head dims,
dtype and tiles), and inside an activation checkpoint with harts.ops.attention.keep's keeper the recomputation
replays the forward's output (keep_attention).
Tested on the CPU with a stand-in FA4 module that applies the block sparsity and the mask_mod as FA4 defines them
(tests/ops/attention/test_flash4_tree.py: forward, lse and the three gradients against the naive attention, the
keeper), and on the GPU against the naive attention (tests/ops/attention/test_groups.py).
Legend: R rows, H heads, E query/key head dim, F value head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor

from harts.ops.attention.keep import AttentionKernels, keepable_attention
from harts.ops.attention.query_groups import AttentionGroups
from harts.ops.attention.tree_blocks import tree_block_sparsity


@dataclass(frozen=True, eq=False)
class Flash4TreePlan:
    """A layout's tree mask in FA4's block-sparse form on a device (int32; heads and batch broadcast, of size 1)."""

    block_size: tuple[int, int]
    """(query rows, key rows) of a tile."""
    subtree_end: Tensor
    """[R]: the mask_mod's aux tensor."""
    by_query: tuple[Tensor, Tensor, Tensor, Tensor]
    """The forward's: partial key tiles' counts [1, 1, Mq] and indices [1, 1, Mq, Mk], then the full ones'."""
    by_key: tuple[Tensor, Tensor, Tensor, Tensor]
    """The backward's: partial query tiles' counts [1, 1, Mk] and indices [1, 1, Mk, Mq], then the full ones'."""


def flash4_tree_plan(groups: AttentionGroups, block_q: int, block_k: int, device: torch.device | str) -> Flash4TreePlan:
    """The tiles of `groups`'s tree mask in FA4's form, from the block mask of `tree_block_sparsity` (ValueError
    when the groups are not the tree mask)."""
    block_mask, ends = tree_block_sparsity(groups, block_q, block_k, device)
    by_query = (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
                block_mask.full_kv_indices)
    by_key = (block_mask.q_num_blocks, block_mask.q_indices, block_mask.full_q_num_blocks, block_mask.full_q_indices)
    return Flash4TreePlan(block_size=(block_q, block_k), subtree_end=ends,
                          by_query=tuple(t.contiguous() for t in by_query),
                          by_key=tuple(t.contiguous() for t in by_key))


@cache
def _cute_tree_mask():
    """The tree mask as a CuTe mask_mod (FA4 calls it with single-element index vectors, the sequence's lengths
    and the aux tensors; the key indices of a tile reaching past R come wrapped, and are masked by FA4)."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import utils

    @cute.jit
    def tree_mask(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        kv_end = utils.scalar_to_ssa(aux_tensors[0][kv_idx[0]], cutlass.Int32)
        return (kv_idx <= q_idx) & (q_idx < kv_end)

    return tree_mask


def _sparsity(plan: Flash4TreePlan, lists: tuple[Tensor, Tensor, Tensor, Tensor]):
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    return BlockSparseTensorsTorch(*lists, block_size=plan.block_size)


def flash4_tree_forward(q: Tensor, k: Tensor, v: Tensor, plan: Flash4TreePlan, scale: float) -> tuple[Tensor, Tensor]:
    """(out [R, H, F] in q's dtype, lse fp32 [H, R]) of the tree attention."""
    from flash_attn.cute.interface import _flash_attn_fwd

    out, lse, *_ = _flash_attn_fwd(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), softmax_scale=scale, mask_mod=_cute_tree_mask(),
        block_sparse_tensors=_sparsity(plan, plan.by_query), aux_tensors=[plan.subtree_end], return_lse=True,
    )
    return out.squeeze(0), lse.squeeze(0)


def flash4_tree_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                         plan: Flash4TreePlan, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) from the forward's out and lse."""
    from flash_attn.cute.interface import _flash_attn_bwd

    dq, dk, dv = _flash_attn_bwd(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), out.unsqueeze(0), dout.unsqueeze(0), lse.unsqueeze(0),
        softmax_scale=scale, mask_mod=_cute_tree_mask(), aux_tensors=[plan.subtree_end],
        block_sparse_tensors=_sparsity(plan, plan.by_key), deterministic=False,
    )
    return dq.squeeze(0), dk.squeeze(0), dv.squeeze(0)


def flash4_tree_attention(q_RHE: Tensor, k_RHE: Tensor, v_RHF: Tensor, plan: Flash4TreePlan, scale: float) -> Tensor:
    """Softmax attention of rows in DFS preorder under the tree mask of `plan` (`flash4_tree_plan`), differentiable
    in q, k and v: out [R, H, F]. q, k, v: [R, H, E], [R, H, E], [R, H, F] in bf16 or fp16 on a GPU that FA4 runs
    on. Inside a checkpoint with an active keeper (`keeper_contexts`) the forward kernel runs in the forward only."""
    if torch.are_deterministic_algorithms_enabled():
        raise ValueError("attention backend 'flash4_tree' has no deterministic backward (FlashAttention-4's block-"
                         "sparse one needs write orders of dQ that harts does not build); use triton_tree")
    kernels = AttentionKernels(lambda q, k, v: flash4_tree_forward(q, k, v, plan, scale),
                               lambda dout, q, k, v, out, lse: flash4_tree_backward(dout, q, k, v, out, lse, plan,
                                                                                    scale))
    return keepable_attention(q_RHE, k_RHE, v_RHF, kernels)
