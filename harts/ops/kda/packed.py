"""KDA over packed independent sequences (the per-trajectory baseline): one chunked call.

`packed_kda(q, k, v, g, beta, cu_seqlens)` runs rows [R, ...] holding whole sequences back to
back, each from the zero state and chunked from its own first row — what a standard trainer
does. Backends: "torch" (`chunk_kda_torch`, any device) and "fla" (fla's own varlen
`chunk_kda` with the L2 norm fused in the kernel: the strong baseline a user would run on GPU;
through `harts.ops.kda.fla_packed`, its stages bit for bit without keeping the unused gate input).
Tested through the model's equivalence tests (torch), the interpreter (fla_packed vs fla's
`chunk_kda`) and the GPU tests (fla vs torch).
"""

from __future__ import annotations

import torch

from harts.ops.kda.chunk import chunk_kda_torch
from harts.ops.kda.compact import check_kda_backend, l2norm
from harts.ops.kda.keep import kda_intermediates_kept


def packed_kda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    cu_seqlens: torch.Tensor, *, chunk_size: int, scale: float | None = None, use_qk_l2norm: bool = False,
    backend: str = "torch", cu_seqlens_cpu: torch.Tensor | None = None,
) -> torch.Tensor:
    """o [R, H, V] for q, k, g [R, H, K], v [R, H, V], beta [R, H] and cu_seqlens [N + 1]
    (`cu_seqlens_cpu`: their host copy, which spares fla a device-to-host read)."""
    check_kda_backend(backend, chunk_size, packed=True)
    # fla's kernels take rows past cu_seqlens[-1] and return NaN there (fla issue, 2026): refused instead. The host
    # copy (a layout's) spares a device-to-host read.
    last = int((cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens)[-1])
    if last != q.shape[0]:
        raise ValueError(f"packed_kda: cu_seqlens ends at row {last} but there are {q.shape[0]} rows (every row must "
                         "belong to a sequence)")
    if backend == "fla":
        from harts.ops.kda.fla_packed import packed_chunk_kda

        o = packed_chunk_kda(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0).float(), beta.unsqueeze(0).float(),
            cu_seqlens.long(), chunk_size=chunk_size, scale=scale, use_qk_l2norm=use_qk_l2norm,
            cu_seqlens_cpu=None if cu_seqlens_cpu is None else cu_seqlens_cpu.long(),
            keep_intermediates=kda_intermediates_kept(),
        )
        return o[0]
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    o, _, _ = chunk_kda_torch(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
        scale=scale, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
    )
    return o[0]
