"""The baseline's packed KDA call on fla's kernels, keeping for the backward only what fla's backward reads.

`packed_chunk_kda(q, k, v, g, beta, cu_seqlens, ...)` is fla 0.6's `chunk_kda` for the call the
per-trajectory baseline makes (zero initial states, no final state, the decay g precomputed in log space,
beta after its sigmoid, optionally the L2 norm of q and k in the kernel): the same stages as
`fla.ops.kda.chunk.ChunkKDAFunction` (`l2norm_fwd`, `chunk_kda_fwd`, `chunk_kda_bwd`, `l2norm_bwd`) with
the same arguments, so the same kernels compute the same bits. It differs in what it keeps: fla's Function
also saves its gate input g (fp32 [R, H, K], 8 KB a row at ling3-tiny's 16 × 128), which its backward reads
only for g's dtype when the gate is not computed in the kernel. Nothing else keeps g alive (fla's fused gate
keeps its own input), so a KDA layer whose activations are kept for the backward holds 8 KB a row less, 0.5 GB
at T = 65,536.

Tested (tests/ops/kda/test_packed.py) against fla's `chunk_kda` under the Triton interpreter on CPU: the
output and every gradient bit for bit, and the tensors each keeps (g among fla's, not among these).
Legend: R packed rows, H heads, K key dim, V value dim.
"""

from __future__ import annotations

import torch
from fla.modules.norm.l2norm import l2norm_bwd, l2norm_fwd
from fla.ops.kda.chunk_bwd import chunk_kda_bwd
from fla.ops.kda.chunk_fwd import chunk_kda_fwd
from fla.ops.utils.index import prepare_chunk_indices
from fla.utils import autocast_custom_bwd, autocast_custom_fwd, input_guard


class PackedChunkKDAFunction(torch.autograd.Function):
    """o [1, R, H, V] of one varlen call from zero states; gradients for q, k, v, g and beta."""

    @staticmethod
    @input_guard
    @autocast_custom_fwd
    def forward(ctx, q, k, v, g, beta, scale, cu_seqlens, cu_seqlens_cpu, chunk_size, use_qk_l2norm,
                keep_intermediates):
        q_rstd = k_rstd = None
        if use_qk_l2norm:
            q, q_rstd = l2norm_fwd(q)
            k, k_rstd = l2norm_fwd(k)
        chunk_indices = prepare_chunk_indices(cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                                              cu_seqlens_cpu=cu_seqlens_cpu)
        o, _, g_cumsum, aqk, akk, w, u, qg, kg, v_new, h, initial_state = chunk_kda_fwd(
            q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=None, output_final_state=False,
            cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices, chunk_size=chunk_size,
            disable_recompute=keep_intermediates,
        )
        intermediates = (w, u, qg, kg, v_new, h)
        # fla hands its intermediates back exactly when asked to keep them; else its backward recomputes them.
        assert all((x is not None) == keep_intermediates for x in intermediates), "fla's intermediates"
        ctx.save_for_backward(q, q_rstd, k, k_rstd, v, g_cumsum, beta, aqk, akk, initial_state, cu_seqlens,
                              chunk_indices, *(intermediates if keep_intermediates else ()))
        ctx.scale, ctx.chunk_size, ctx.use_qk_l2norm, ctx.g_dtype = scale, chunk_size, use_qk_l2norm, g.dtype
        ctx.keep_intermediates = keep_intermediates
        return o.type_as(q)

    @staticmethod
    @input_guard
    @autocast_custom_bwd
    def backward(ctx, do):
        (q, q_rstd, k, k_rstd, v, g_cumsum, beta, aqk, akk, initial_state, cu_seqlens, chunk_indices,
         *intermediates) = ctx.saved_tensors
        kept = dict(zip(("w", "u", "qg", "kg", "v_new", "h"), intermediates))
        dq, dk, dv, db, dg, _, _, _ = chunk_kda_bwd(
            q=q, k=k, v=v, beta=beta, Aqk=aqk, Akk=akk, scale=ctx.scale, initial_state=initial_state, do=do,
            dht=None, g=g_cumsum, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, chunk_size=ctx.chunk_size,
            disable_recompute=ctx.keep_intermediates, **kept,
        )
        if ctx.use_qk_l2norm:
            dq = l2norm_bwd(q, q_rstd, dq)
            dk = l2norm_bwd(k, k_rstd, dk)
        return dq.to(q), dk.to(k), dv.to(v), dg.to(ctx.g_dtype), db.to(beta), None, None, None, None, None, None


def packed_chunk_kda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    cu_seqlens: torch.Tensor, *, chunk_size: int = 64, scale: float | None = None, use_qk_l2norm: bool = False,
    cu_seqlens_cpu: torch.Tensor | None = None, keep_intermediates: bool = False,
) -> torch.Tensor:
    """o [1, R, H, V] of fla's `chunk_kda(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel=use_qk_l2norm,
    cu_seqlens, cu_seqlens_cpu, disable_recompute=keep_intermediates)` for q, k, g [1, R, H, K], v [1, R, H, V],
    beta [1, R, H] (fp32 g and beta), int64 cu_seqlens [N + 1] (`cu_seqlens_cpu`: its host copy).
    `keep_intermediates` (harts.ops.kda.keep): the backward reads the forward's WY factors, gated q/k, states and
    corrected values (at 16 × 128 in bf16, 20 KB a row and 512 KiB a chunk) instead of computing them again."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return PackedChunkKDAFunction.apply(q, k, v, g, beta, scale, cu_seqlens, cu_seqlens_cpu, chunk_size,
                                        use_qk_l2norm, keep_intermediates)
