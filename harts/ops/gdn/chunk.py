"""The gated delta rule as KDA with a per-head gate: chunked form, boundary states with gradients.

Gated DeltaNet's decay is one scalar per head and row, KDA's one per head, row and key channel; with
g_KDA[t, h, c] = g_GDN[t, h] for every channel c, KDA's update S ← diag(exp g_t)·S; S ← S + β k ⊗ (v − Sᵀk)
is GDN's S ← exp(g_t)·S; ... (the same S: diag of a constant is the constant). Grouped values (HV value heads
over H query/key heads) become H = HV heads once q and k are repeated over each head's value group. So
`kda_form(q, k, v, g, beta)` turns a GDN call into a KDA call of the same function, and every KDA operator —
`chunk_kda_torch` (states after any requested offsets, differentiable), the fla Triton path with boundary-state
gradients (`chunk_kda_fla`), the compact execution of a `KDASchedule` — runs GDN unchanged. The gradients of the
repeated q, k and the broadcast gate sum back over the copies (autograd's backward of repeat and expand).

`chunk_gdn_torch` is `chunk_kda_torch` of the KDA form: the CPU path and the oracle of the compact GDN.
Tested against `naive_recurrent_gdn` (the paper's recurrence, written without the KDA code) in fp64: outputs,
final and requested states and every gradient (tests/ops/gdn/test_chunk.py).
Legend: B batch, T time (or R rows without B), H query/key heads, HV value heads, K key dim, V value dim.
"""

from __future__ import annotations

import numpy as np
import torch

from harts.ops.gdn.naive import check_gdn_shapes
from harts.ops.kda.chunk import chunk_kda_torch


def kda_form(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             ) -> tuple[torch.Tensor, ...]:
    """(q, k repeated to HV heads, v, g broadcast over the K key channels, beta): the KDA call of the same
    function, for q, k ``[..., H, K]``, v ``[..., HV, V]``, g and beta ``[..., HV]`` (value head j reads
    query/key head j // (HV / H))."""
    group = v.shape[-2] // q.shape[-2]
    if group > 1:
        q, k = q.repeat_interleave(group, dim=-2), k.repeat_interleave(group, dim=-2)
    return q, k, v, g.unsqueeze(-1).expand(*g.shape, q.shape[-1]).contiguous(), beta


def chunk_gdn_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | np.ndarray | None = None,
    chunk_size: int = 64,
    state_offsets: np.ndarray | None = None,
    state_ptr: np.ndarray | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    r"""Chunked gated delta rule over packed sequences, with states after requested row offsets.

    Args:
        q, k: ``[B, T, H, K]``. v: ``[B, T, HV, V]``. g: ``[B, T, HV]`` log decay (≤ 0). beta: ``[B, T, HV]``.
        scale, initial_state ``[N, HV, K, V]``, output_final_state, cu_seqlens, chunk_size, state_offsets,
        state_ptr: as `chunk_kda_torch` (chunks start at multiples of ``chunk_size`` of each sequence).

    Returns:
        ``(o [B, T, HV, V], final states [N, HV, K, V] or None, requested states or None)``; states fp32
        (fp64 for fp64 inputs).

    Example::

        >>> q, k = torch.randn(2, 1, 100, 2, 8).unbind(0)
        >>> v, g, beta = torch.randn(1, 100, 4, 6), -torch.rand(1, 100, 4), torch.rand(1, 100, 4)
        >>> o, final, states = chunk_gdn_torch(
        ...     q, k, v, g, beta, output_final_state=True, cu_seqlens=torch.tensor([0, 30, 100]),
        ...     chunk_size=16, state_offsets=np.array([16, 30, 32]), state_ptr=np.array([0, 2, 3]))
        >>> o.shape, final.shape, states.shape
        (torch.Size([1, 100, 4, 6]), torch.Size([2, 4, 8, 6]), torch.Size([3, 4, 8, 6]))
    """
    check_gdn_shapes("chunk_gdn_torch", q, k, v, g, beta)
    return chunk_kda_torch(*kda_form(q, k, v, g, beta), scale=scale, initial_state=initial_state,
                           output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                           state_offsets=state_offsets, state_ptr=state_ptr)
