"""The gated delta rule over packed independent sequences (the per-trajectory baseline): one chunked call.

`packed_gdn(q, k, v, g, beta, cu_seqlens)` runs rows [R, ...] holding whole sequences back to back, each from
the zero state and chunked from its own first row — what a standard trainer of a Gated DeltaNet model does.
Backends: "torch" (`chunk_gdn_torch`, any device) and "fla" (CUDA: fla's own varlen `chunk_gated_delta_rule`,
grouped values and the L2 norm of q and k in its kernels — the strong baseline a Qwen3-Next / Qwen3.5 trainer
runs). Tested: the torch backend against `naive_recurrent_gdn` (tests/ops/gdn/test_packed.py); the fla backend
against it under the Triton interpreter on CPU (tests/ops/gdn/interpreter.py) — not yet on a GPU.
Legend: R packed rows, H query/key heads, HV value heads, K key dim, V value dim.
"""

from __future__ import annotations

import torch

from harts.ops.gdn.chunk import chunk_gdn_torch
from harts.ops.kda.compact import check_kda_backend, l2norm


def packed_gdn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    cu_seqlens: torch.Tensor, *, chunk_size: int, scale: float | None = None, use_qk_l2norm: bool = False,
    backend: str = "torch", cu_seqlens_cpu: torch.Tensor | None = None,
) -> torch.Tensor:
    """o [R, HV, V] for q, k [R, H, K], v [R, HV, V], g and beta [R, HV] and cu_seqlens [N + 1]
    (`cu_seqlens_cpu`: their host copy, which spares fla a device-to-host read)."""
    check_kda_backend(backend, chunk_size, packed=True)
    last = int((cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens)[-1])
    if last != q.shape[0]:
        raise ValueError(f"packed_gdn: cu_seqlens ends at row {last} but there are {q.shape[0]} rows (every row must "
                         "belong to a sequence)")
    if backend == "fla":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        o, _ = chunk_gated_delta_rule(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0).float(), beta.unsqueeze(0).float(),
            scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm, cu_seqlens=cu_seqlens.long(),
            cu_seqlens_cpu=None if cu_seqlens_cpu is None else cu_seqlens_cpu.long(),
        )
        return o[0]
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    o, _, _ = chunk_gdn_torch(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
                              scale=scale, cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    return o[0]
