"""KDA over the compact rows of a segment tree, one packed chunked call per planned call.

`compact_kda(q, k, v, g, beta, schedule)` executes a `KDASchedule` (harts.planning.kda_schedule)
over compact rows [C, ...]: for each call it gathers the rows of its sequences (replay rows are
ancestors' compact rows), takes each sequence's initial state from the boundary state an earlier
call returned (zero for a root sequence), runs the chunked operator once with `cu_seqlens`, keeps
the boundary states the call must return, and writes the outputs of its computed (non-replay)
rows to their compact rows. Every compact row is computed exactly once, so the result is a
permutation of the calls' computed outputs; replay outputs are discarded.

The handed-off states are ordinary autograd values: their gradients flow back into the call that
produced them (the torch backend through the graph of `chunk_kda_torch`; the fla backend through
`chunk_kda_fla`, whose backward injects boundary-state gradients into its state recursion).

Invariant (tests/ops/kda/test_compact.py): with a replay schedule the outputs and all gradients
equal per-trajectory execution (each trajectory its own sequence from position 0, chunked from
there) gathered through the compact map m — the chunk boundaries are the same, so fp64 agrees to
~1e-12. With a no-replay schedule they equal the exact recurrence, chunked differently.
Legend: C compact rows, R rows of a call, n sequences of a call, H heads, K key dim, V value dim.
"""

from __future__ import annotations

from typing import Callable, Literal

import numpy as np
import torch

from harts.ops.kda.chunk import chunk_kda_torch
from harts.planning.kda_schedule import KDASchedule


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σ x² + eps) over the last dim, in fp32 at least (fla's `l2norm`)."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = x.to(dtype)
    return (y * torch.rsqrt((y * y).sum(-1, keepdim=True) + eps)).to(x.dtype)


def _backend(name: str) -> Callable:
    if name == "torch":
        return chunk_kda_torch
    if name == "fla":
        from harts.ops.kda.fla_chunk import chunk_kda_fla

        return chunk_kda_fla
    raise ValueError(f"compact_kda: unknown backend {name!r} (expected 'torch' or 'fla')")


def compact_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    schedule: KDASchedule,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    backend: Literal["torch", "fla"] = "torch",
) -> torch.Tensor:
    r"""KDA over compact rows, executing `schedule`'s calls in order.

    Args:
        q, k: ``[C, H, K]``. v: ``[C, H, V]``. g: ``[C, H, K]`` log-space decay. beta: ``[C, H]``.
        schedule: the call plan of these C rows (`plan_kda_calls(tree, B, replay=...)`); its
            chunk size is the B of every call.
        scale: defaults to ``K ** -0.5``.
        use_qk_l2norm: L2-normalise q and k per row first (once per compact row).
        backend: ``"torch"`` (`chunk_kda_torch`, any device) or ``"fla"`` (`chunk_kda_fla`:
            CUDA, B ∈ {32, 64}).

    Returns:
        o ``[C, H, V]``.

    Example::

        >>> from harts.trees.step import Step  # doctest: +SKIP
        >>> tree = PrefixIndex.from_step(step).segment_tree()  # doctest: +SKIP
        >>> schedule = plan_kda_calls(tree, 64)  # doctest: +SKIP
        >>> o = compact_kda(q, k, v, g, beta, schedule, use_qk_l2norm=True)  # doctest: +SKIP
    """
    num_rows = schedule.num_compact_tokens
    if q.dim() != 3 or q.shape[0] != num_rows or k.shape != q.shape or g.shape != q.shape:
        shapes = ", ".join(str(tuple(x.shape)) for x in (q, k, g))
        raise ValueError(f"compact_kda: q, k, g must be [C={num_rows}, H, K], got {shapes}")
    if v.dim() != 3 or v.shape[:2] != q.shape[:2] or beta.shape != q.shape[:2]:
        raise ValueError(f"compact_kda: v must be [C, H, V] and beta [C, H], got {tuple(v.shape)}, {tuple(beta.shape)}")
    run = _backend(backend)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    device = q.device
    heads, key_dim, value_dim = q.shape[1], q.shape[2], v.shape[2]
    returned: list[torch.Tensor] = []
    outputs, destinations = [], []
    for call in schedule.calls:
        rows = torch.from_numpy(call.rows).to(device)
        inputs = [x.index_select(0, rows).unsqueeze(0) for x in (q, k, v, g, beta)]
        initial = _initial_states(schedule, call.initial_source, returned, heads, key_dim, value_dim, device)
        o, _, states = run(
            *inputs,
            scale=scale,
            initial_state=initial,
            cu_seqlens=torch.from_numpy(call.cu_seqlens).to(device),
            chunk_size=schedule.chunk_size,
            state_offsets=call.boundary_offsets,
            state_ptr=call.boundary_ptr,
        )
        returned.append(states)
        computed = np.flatnonzero(~call.is_replay)
        outputs.append(o[0].index_select(0, torch.from_numpy(computed).to(device)))
        destinations.append(call.rows[computed])
    destination = np.concatenate(destinations) if destinations else np.zeros(0, dtype=np.int64)
    assert len(destination) == num_rows, "the schedule computes every compact row exactly once"
    order = torch.from_numpy(np.argsort(destination, kind="stable")).to(device)
    if not outputs:
        return v.new_zeros(0, heads, value_dim)
    return torch.cat(outputs).index_select(0, order)


def _initial_states(schedule, source, returned, heads, key_dim, value_dim, device) -> torch.Tensor | None:
    """[n, H, K, V] initial states of a call's sequences, or None when all start from zero."""
    handed = np.flatnonzero(source[:, 0] >= 0)
    if not len(handed):
        return None
    parts, owners = [], []
    for producer in np.unique(source[handed, 0]):
        mine = handed[source[handed, 0] == producer]
        call = schedule.calls[int(producer)]
        flat = call.boundary_ptr[source[mine, 1]] + source[mine, 2]
        parts.append(returned[int(producer)].index_select(0, torch.from_numpy(flat).to(device)))
        owners.append(mine)
    roots = np.flatnonzero(source[:, 0] < 0)
    if len(roots):
        parts.append(parts[0].new_zeros(len(roots), heads, key_dim, value_dim))
        owners.append(roots)
    order = torch.from_numpy(np.argsort(np.concatenate(owners))).to(device)
    return torch.cat(parts).index_select(0, order)
