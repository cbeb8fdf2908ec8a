"""KDA over packed independent sequences (the per-trajectory baseline): one chunked call.

`packed_kda(q, k, v, g, beta, cu_seqlens)` runs rows [R, ...] holding whole sequences back to
back, each from the zero state and chunked from its own first row — what a standard trainer
does with varlen `chunk_kda`. Same backends as `compact_kda` (torch anywhere, fla on CUDA);
tested through the model's equivalence tests against the compact execution.
"""

from __future__ import annotations

import torch

from harts.ops.kda.compact import _backend, l2norm


def packed_kda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    cu_seqlens: torch.Tensor, *, chunk_size: int, scale: float | None = None, use_qk_l2norm: bool = False,
    backend: str = "torch",
) -> torch.Tensor:
    """o [R, H, V] for q, k, g [R, H, K], v [R, H, V], beta [R, H] and cu_seqlens [N + 1]."""
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    o, _, _ = _backend(backend)(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
        scale=scale, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
    )
    return o[0]
