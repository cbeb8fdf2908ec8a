"""Chunked KDA in pure PyTorch: the CPU execution path and the oracle of the fla path.

`chunk_kda_torch` computes the same function as `naive_recurrent_kda` with the chunked (WY / UT)
algorithm of fla's `chunk_kda`: packed variable-length sequences (`cu_seqlens`), one initial state
per sequence, chunks of B rows aligned at multiples of B from each sequence's first row. Besides
the outputs it returns, differentiably, the state after any requested row offsets of each sequence
(CSR `state_ptr` / `state_offsets`, the layout of `KDACall.boundary_*`): at multiples of B these
are chunk-boundary states of the recurrence; other offsets (the no-replay ablation) are formed
from the state at the start of their chunk and the chunk's first rows.

Algorithm (README.md has the derivation): all sequences are padded into [num_chunks, B] blocks
(pad rows are neutral: k = v = β = g = 0); every intra-chunk quantity — the decayed key/query
products A_kk and A_qk, the unit-lower-triangular solve giving u and w — is computed for all
chunks and heads at once; then the inter-chunk recurrence S ← diag(γ) S + K̃ᵀ (u − w S) runs as a
loop over the chunk index, batched over the sequences still running. Exponents are kept ≤ 0 for
g ≤ 0: diagonal 8-row sub-blocks are formed pairwise, off-diagonal ones factor through the first
row of the query sub-block. States and accumulations are fp32 (fp64 for fp64 inputs).

Invariant (tests/ops/kda/test_chunk.py): outputs, requested states and all gradients equal the
token recurrence (`naive_recurrent_kda`) within 1e-5 relative in fp32 and ~1e-12 in fp64.
Legend: N sequences, NC chunks, B chunk size, BC sub-block, H heads, K key dim, V value dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from harts.ops.kda.naive import compute_dtype

# Rows of a diagonal sub-block whose decays are formed pairwise (exactly); 8 rather than fla's 16
# halves the elementwise work that dominates on CPU, and the off-diagonal factorisation through
# the query sub-block's first row stays within the chunk either way.
SUB_BLOCK = 8
# Elements of the largest pairwise-decay temporary ([chunks, H, B/BC, BC, BC, K]) built at once.
_INTRA_BUDGET = 1 << 24


@dataclass(frozen=True)
class ChunkLayout:
    """Where every row of a packed call sits in the padded [NC, B] chunk blocks."""

    chunk_size: int
    lengths: np.ndarray
    """int64 [N] rows per sequence."""
    num_chunks: np.ndarray
    """int64 [N] ⌈length / B⌉."""
    chunk_start: np.ndarray
    """int64 [N] first chunk id of each sequence (chunks of a sequence are consecutive)."""
    row_of_slot: torch.Tensor
    """int64 [NC·B] the row feeding each padded slot, or the row count for a pad slot."""
    slot_of_row: torch.Tensor
    """int64 [rows] the padded slot of each row."""

    @classmethod
    def build(cls, lengths: np.ndarray, chunk_size: int, device: torch.device) -> ChunkLayout:
        lengths = np.asarray(lengths, dtype=np.int64)
        num_chunks = -(-lengths // chunk_size)
        chunk_start = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(num_chunks[:-1], out=chunk_start[1:])
        row_start = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], out=row_start[1:])
        num_rows = int(lengths.sum())
        chunk_seq = np.repeat(np.arange(len(lengths)), num_chunks)
        offset = ((np.arange(len(chunk_seq)) - chunk_start[chunk_seq]) * chunk_size)[:, None] + np.arange(chunk_size)
        row = row_start[chunk_seq][:, None] + offset
        row_of_slot = np.where(offset < lengths[chunk_seq][:, None], row, num_rows).reshape(-1)
        row_seq = np.repeat(np.arange(len(lengths)), lengths)
        slot_of_row = chunk_start[row_seq] * chunk_size + np.arange(num_rows) - row_start[row_seq]
        return cls(
            chunk_size=chunk_size,
            lengths=lengths,
            num_chunks=num_chunks,
            chunk_start=chunk_start,
            row_of_slot=torch.from_numpy(row_of_slot).to(device),
            slot_of_row=torch.from_numpy(slot_of_row).to(device),
        )

    @property
    def total_chunks(self) -> int:
        return int(self.num_chunks.sum())


def _intra_chunk(q, k, v, g, beta, scale: float):
    """Per chunk [.., B, ..]: (A_qk masked to j ≤ i and scaled, u, w, cumulative log decay)."""
    chunk = q.shape[2]
    block = math.gcd(chunk, SUB_BLOCK)
    num_blocks = chunk // block
    gc = g.cumsum(2)

    qb, kb, gb = (x.unflatten(2, (num_blocks, block)) for x in (q, k, gc))
    causal = torch.ones(block, block, dtype=torch.bool, device=q.device).tril()[..., None]
    pair = torch.where(causal, gb[..., :, None, :] - gb[..., None, :, :], 0.0).exp() * causal
    key_pair = pair * kb[..., None, :, :]
    kk_diag = (kb[..., :, None, :] * key_pair).sum(-1)
    qk_diag = (qb[..., :, None, :] * key_pair).sum(-1)
    eye_blocks = torch.eye(num_blocks, dtype=q.dtype, device=q.device)[:, None, :, None]
    kk = (kk_diag[..., :, :, None, :] * eye_blocks).flatten(-2).flatten(2, 3)
    qk = (qk_diag[..., :, :, None, :] * eye_blocks).flatten(-2).flatten(2, 3)
    if num_blocks > 1:
        reference = gb[..., :, 0, :]
        left = (gb - reference[..., None, :]).exp()
        block_start = torch.arange(num_blocks, device=q.device) * block
        before = (torch.arange(chunk, device=q.device)[None, :] < block_start[:, None])[..., None]
        right = torch.where(before, reference[..., :, None, :] - gc[..., None, :, :], 0.0).exp() * before
        key_right = (k[..., None, :, :] * right).transpose(-1, -2)
        kk = kk + ((kb * left) @ key_right).flatten(2, 3)
        qk = qk + ((qb * left) @ key_right).flatten(2, 3)

    strict = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril(-1)
    system = torch.eye(chunk, dtype=q.dtype, device=q.device) + kk * strict * beta[..., :, None]
    rhs = torch.cat([v, k * gc.exp()], -1) * beta[..., None]
    # Inverting the small unit-triangular systems and multiplying is several times faster on CPU
    # than a batched triangular solve with many right-hand sides (fla forms the inverse too).
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device).expand_as(system)
    solved = torch.linalg.solve_triangular(system, eye, upper=False, unitriangular=True) @ rhs
    u, w = solved.split([v.shape[-1], k.shape[-1]], -1)
    qk = qk * strict.logical_or(torch.eye(chunk, dtype=torch.bool, device=q.device)) * scale
    return qk, u, w, gc


def check_inputs(name: str, q, k, v, g, beta, cu_seqlens, initial_state) -> np.ndarray:
    """Shapes of a chunked-KDA call (ValueError naming `name`); returns the sequence lengths."""
    if q.dim() != 4 or k.shape != q.shape or g.shape != q.shape:
        shapes = ", ".join(str(tuple(x.shape)) for x in (q, k, g))
        raise ValueError(f"{name}: q, k, g must share a [B, T, H, K] shape, got {shapes}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"{name}: v must be [B, T, H, V] matching q, got {tuple(v.shape)}")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"{name}: beta must be [B, T, H], got {tuple(beta.shape)}")
    batch, length = q.shape[:2]
    if cu_seqlens is None:
        lengths = np.full(batch, length, dtype=np.int64)
    else:
        if batch != 1:
            raise ValueError(f"{name}: batch must be 1 with cu_seqlens, got {batch}")
        cu = np.asarray(cu_seqlens.cpu() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens, dtype=np.int64)
        if cu.ndim != 1 or len(cu) < 2 or cu[0] != 0 or cu[-1] != length or (np.diff(cu) < 0).any():
            raise ValueError(f"{name}: cu_seqlens must rise from 0 to T={length}, got {cu.tolist()}")
        lengths = np.diff(cu)
    expected = (len(lengths), q.shape[2], q.shape[3], v.shape[3])
    if initial_state is not None and tuple(initial_state.shape) != expected:
        raise ValueError(
            f"{name}: initial_state must be [N, H, K, V] = {list(expected)}, got {list(initial_state.shape)}"
        )
    return lengths


def check_chunk_size(name: str, chunk_size) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(f"{name}: chunk_size must be a positive integer, got {chunk_size!r}")
    return int(chunk_size)


def chunk_kda_torch(
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
    r"""Chunked KDA over packed sequences, with states after requested row offsets.

    Args:
        q, k: ``[B, T, H, K]``. v: ``[B, T, H, V]``. g: ``[B, T, H, K]`` log-space decay.
        beta: ``[B, T, H]``. scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, H, K, V]``, one per sequence (zeros when omitted).
        output_final_state: also return each sequence's final state ``[N, H, K, V]``.
        cu_seqlens: ``[N + 1]`` cumulative lengths (B must be 1); without it the B rows of
            length T are the sequences.
        chunk_size: B of the chunked form; chunks start at multiples of B of each sequence.
        state_offsets, state_ptr: CSR over sequences (``state_ptr`` ``[N + 1]``): sequence i asks
            for the states after its first ``state_offsets[state_ptr[i]:state_ptr[i + 1]]``
            rows (0 ≤ offset ≤ its length).

    Returns:
        ``(o [B, T, H, V] in q's dtype, final states or None, requested states
        [len(state_offsets), H, K, V] or None)``; states are fp32 (fp64 for fp64 inputs).

    Example::

        >>> q, k = torch.randn(2, 1, 100, 2, 8).unbind(0)
        >>> v, g, beta = torch.randn(1, 100, 2, 4), -torch.rand(1, 100, 2, 8), torch.rand(1, 100, 2)
        >>> o, final, states = chunk_kda_torch(
        ...     q, k, v, g, beta, output_final_state=True, cu_seqlens=torch.tensor([0, 30, 100]),
        ...     chunk_size=16, state_offsets=np.array([16, 30, 32, 40]), state_ptr=np.array([0, 2, 4]))
        >>> o.shape, final.shape, states.shape
        (torch.Size([1, 100, 2, 4]), torch.Size([2, 2, 8, 4]), torch.Size([4, 2, 8, 4]))
    """
    lengths = check_inputs("chunk_kda_torch", q, k, v, g, beta, cu_seqlens, initial_state)
    chunk_size = check_chunk_size("chunk_kda_torch", chunk_size)
    batch, length, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    num_seqs = len(lengths)
    if scale is None:
        scale = key_dim**-0.5
    requests = check_requests("chunk_kda_torch", state_offsets, state_ptr, lengths)
    dtype = compute_dtype(q, k, v, g, beta)
    device = q.device
    layout = ChunkLayout.build(lengths, chunk_size, device)
    total = layout.total_chunks

    def blocks(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(batch * length, *x.shape[2:]).to(dtype)
        padded = torch.cat([rows, rows.new_zeros(1, *rows.shape[1:])]).index_select(0, layout.row_of_slot)
        return padded.unflatten(0, (total, chunk_size)).transpose(1, 2)

    q_c, k_c, v_c, g_c, beta_c = (blocks(x) for x in (q, k, v, g, beta))
    group = max(1, _INTRA_BUDGET // max(1, heads * chunk_size * math.gcd(chunk_size, SUB_BLOCK) * key_dim))
    parts = [
        _intra_chunk(q_c[s : s + group], k_c[s : s + group], v_c[s : s + group], g_c[s : s + group],
                     beta_c[s : s + group], scale)
        for s in range(0, total, group)
    ]
    qk, u, w, gc = (torch.cat(p) for p in zip(*parts)) if parts else (None,) * 4

    state = q.new_zeros(num_seqs, heads, key_dim, value_dim, dtype=dtype)
    if initial_state is not None:
        state = state + initial_state.to(dtype)
    chunk_states, new_values, final_state = _inter_chunk(layout, state, k_c, u, w, gc)

    if total:
        o_c = (q_c * scale * gc.exp()) @ chunk_states + qk @ new_values
        o_rows = o_c.transpose(1, 2).reshape(total * chunk_size, heads, value_dim).index_select(0, layout.slot_of_row)
    else:
        o_rows = q.new_zeros(0, heads, value_dim, dtype=dtype)
    o = o_rows.reshape(batch, length, heads, value_dim).to(q.dtype)
    states = None
    if requests is not None:
        states = _requested_states(layout, requests, chunk_states, final_state, k_c, gc, new_values)
    return o, final_state if output_final_state else None, states


def index_tensor(index: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """int64 index array as a tensor on `device` (schedules and state plans build these once)."""
    return torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64)).to(device)


def check_requests(name: str, state_offsets, state_ptr, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(sequence, offset) of each requested state, or None; ValueError for a bad request."""
    if state_offsets is None and state_ptr is None:
        return None
    if state_offsets is None or state_ptr is None:
        raise ValueError(f"{name}: state_offsets and state_ptr go together")
    offsets = np.asarray(state_offsets, dtype=np.int64)
    ptr = np.asarray(state_ptr, dtype=np.int64)
    if ptr.shape != (len(lengths) + 1,) or ptr[0] != 0 or ptr[-1] != len(offsets) or (np.diff(ptr) < 0).any():
        raise ValueError(f"{name}: state_ptr must be a CSR pointer over {len(lengths)} sequences")
    seq = np.repeat(np.arange(len(lengths)), np.diff(ptr))
    bad = np.flatnonzero((offsets < 0) | (offsets > lengths[seq]))
    if len(bad):
        i = int(bad[0])
        raise ValueError(
            f"{name}: state offset {int(offsets[i])} of sequence {int(seq[i])} is outside 0..{int(lengths[seq[i]])}"
        )
    return seq, offsets


def _inter_chunk(layout: ChunkLayout, state, k_c, u, w, gc):
    """The recurrence over chunk index: (state at every chunk start [NC], new values u − w S, final states)."""
    total = layout.total_chunks
    if total == 0:
        return None, None, state
    device = state.device
    # Sequences by decreasing chunk count, so the ones still running at a position are a prefix,
    # and chunks in position-major order, so each position reads one contiguous slice.
    order = np.argsort(-layout.num_chunks, kind="stable")
    running = layout.num_chunks[order]
    active = [int((running > position).sum()) for position in range(int(running[0]))]
    step_chunks = torch.from_numpy(
        np.concatenate([layout.chunk_start[order[:count]] + position for position, count in enumerate(active)])
    ).to(device)
    u_s, w_s = u.index_select(0, step_chunks), w.index_select(0, step_chunks)
    gc_s = gc.index_select(0, step_chunks)
    gamma_last = gc_s[:, :, -1, :].exp()[..., None]
    key_decayed = (k_c.index_select(0, step_chunks) * (gc_s[:, :, -1:, :] - gc_s).exp()).transpose(-1, -2)
    state = state.index_select(0, torch.from_numpy(order).to(device))
    starts, values = [], []
    first = 0
    for count in active:
        span = slice(first, first + count)
        current = state[:count]
        new_value = u_s[span] - w_s[span] @ current
        starts.append(current)
        values.append(new_value)
        advanced = gamma_last[span] * current + key_decayed[span] @ new_value
        state = torch.cat([advanced, state[count:]]) if count < len(order) else advanced
        first += count
    back = torch.argsort(step_chunks)
    inverse = torch.from_numpy(np.argsort(order)).to(device)
    return (torch.cat(starts).index_select(0, back), torch.cat(values).index_select(0, back),
            state.index_select(0, inverse))


def _requested_states(layout: ChunkLayout, requests, chunk_states, final_state, k_c, gc, new_values):
    seq, offsets = requests
    device = final_state.device
    chunk_size = layout.chunk_size
    within, rest = offsets // chunk_size, offsets % chunk_size
    aligned = rest == 0
    at_start = aligned & (within < layout.num_chunks[seq])
    at_end = aligned & ~at_start
    mid = ~aligned
    index = []
    parts = []
    if at_start.any():
        ids = torch.from_numpy(layout.chunk_start[seq[at_start]] + within[at_start]).to(device)
        parts.append(chunk_states.index_select(0, ids))
        index.append(np.flatnonzero(at_start))
    if at_end.any():
        parts.append(final_state.index_select(0, torch.from_numpy(seq[at_end]).to(device)))
        index.append(np.flatnonzero(at_end))
    if mid.any():
        ids = torch.from_numpy(layout.chunk_start[seq[mid]] + within[mid]).to(device)
        count = torch.from_numpy(rest[mid]).to(device)
        g_ids = gc.index_select(0, ids)
        last = g_ids.gather(2, (count - 1)[:, None, None, None].expand(-1, g_ids.shape[1], 1, g_ids.shape[3]))
        taken = (torch.arange(chunk_size, device=device)[None, :] < count[:, None])[:, None, :, None]
        key_decayed = k_c.index_select(0, ids) * torch.where(taken, last - g_ids, 0.0).exp() * taken
        parts.append(last.squeeze(2).exp()[..., None] * chunk_states.index_select(0, ids)
                     + key_decayed.transpose(-1, -2) @ new_values.index_select(0, ids))
        index.append(np.flatnonzero(mid))
    if not parts:
        return final_state.new_zeros(0, *final_state.shape[1:])
    where = torch.from_numpy(np.argsort(np.concatenate(index))).to(device)
    return torch.cat(parts).index_select(0, where)
