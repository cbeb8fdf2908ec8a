"""FlashAttention-4's packed (varlen) causal attention as a torch operator: `flash4_varlen(q, k, v, cu_seqlens_q,
cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, deterministic) -> (out, lse)`, its backward registered as the
operator's autograd formula. The `flash4` MLA backend (harts.ops.attention.groups) runs through it.

Why an operator and not FA4's `flash_attn_varlen_func`: FA4 launches its CuTe kernels from Python inside an
autograd Function, where an activation checkpoint's selective policy cannot see them, so a recomputation would
run them again. As one dispatcher operator the forward is a call that such a policy can keep
(`attention_kernel_ops`). `HybridModel.run_blocks(keep_attention=True)` keeps it through `flash4_attention` and
harts.ops.attention.keep instead, which puts no dispatch mode over the rest of the block.

The operator calls the kernels that `flash_attn_varlen_func(..., causal=True)` of flash-attn-4 4.0.0b36 calls,
with the same arguments (`FlashAttnVarlenFunc`): `flash_attn.cute.interface._flash_attn_fwd` with the
log-sum-exp returned, then `_flash_attn_bwd` with it. Those are FA4's module functions, not its public API: a
different FA4 version may refuse them, and the backend's probe (`groups._flash4_failure`) runs this operator's
forward and backward once per shape before any real call and reports such a failure as a ValueError.
Shapes: q [Tq, H, E], k [Tk, H, E], v [Tk, H, F] -> out [Tq, H, F], lse fp32 [H, Tq] (not differentiable).
Tested against the naive attention on the GPU (tests/ops/attention/test_groups.py), and on the CPU with a
stand-in FA4 module for the autograd formula and for a recomputation that keeps its output.
"""

from __future__ import annotations

import torch
from torch import Tensor

from harts.ops.attention.keep import AttentionKernels, active_keeper, kept_attention


@torch.library.custom_op("harts::flash4_varlen", mutates_args=())
def flash4_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                  max_seqlen_k: int, scale: float, deterministic: bool) -> tuple[Tensor, Tensor]:
    from flash_attn.cute.interface import _flash_attn_fwd

    out, lse, *_ = _flash_attn_fwd(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, softmax_scale=scale, causal=True, return_lse=True,
    )
    return out, lse


@flash4_varlen.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, deterministic):
    return q.new_empty(*q.shape[:2], v.shape[2]), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.lengths, ctx.scale, ctx.deterministic = (max_seqlen_q, max_seqlen_k), scale, deterministic
    ctx.mark_non_differentiable(lse)


def _kernels_backward(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                      deterministic):
    from flash_attn.cute.interface import _flash_attn_bwd

    dq, dk, dv = _flash_attn_bwd(
        q, k, v, out, dout, lse, scale, True, 0.0, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, deterministic=deterministic,
    )
    return dq, dk, dv


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    return (*_kernels_backward(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, *ctx.lengths, ctx.scale,
                               ctx.deterministic), None, None, None, None, None, None)


flash4_varlen.register_autograd(_backward, setup_context=_setup_context)


def flash4_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, scale: float, deterministic: bool) -> Tensor:
    """out [Tq, H, F] of `flash4_varlen`; inside a checkpoint with an active keeper (`keeper_contexts`), its
    kernel runs in the forward only, and the recomputation replays the output."""
    active = active_keeper()
    if active is None or not torch.is_grad_enabled():
        return flash4_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, deterministic)[0]
    options = (max_seqlen_q, max_seqlen_k, scale, deterministic)
    kernels = AttentionKernels(
        lambda q, k, v: flash4_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *options),
        lambda dout, q, k, v, out, lse: _kernels_backward(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k,
                                                          *options),
    )
    return kept_attention(q, k, v, kernels, *active)
