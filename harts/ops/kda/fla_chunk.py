"""The GPU path: fla's chunked KDA kernels, with differentiable states after requested offsets.

`chunk_kda_fla` has the signature and the semantics of `chunk_kda_torch` (harts.ops.kda.chunk)
and runs one packed varlen call on fla 0.6's Triton kernels. fla's `chunk_kda` returns, and takes
gradients for, only initial and final states; the compact operator also needs states at interior
chunk boundaries of a sequence (where side branches fork off), with their gradients flowing back
into the same call. `ChunkKDAStatesFunction` therefore composes fla's own forward and backward
stages exactly as `fla.ops.kda.chunk.ChunkKDAFunction` does (chunk-local gate cumsum, intra-chunk
WY solve, output, and in the backward dA/dv, WY and intra-chunk gradients), and replaces only the
inter-chunk state pass by the kernels of `harts.ops.kda.triton_state`: the forward also writes
the fp32 state at each requested chunk start, the backward adds each such state's incoming
gradient at that point of its single reverse sweep. No extra call and no extra rows: one forward
and one backward over the same rows as an unsplit `chunk_kda`.

`LinkedCalls` runs every call of a replay schedule as one such call, the states handed over inside
its state kernels (`StateLinks`; README "Linked calls").

Offsets that are not chunk multiples (the no-replay ablation) are formed from the state at the
start of their chunk (a kernel slot, or the initial state) by `chunk_kda_torch` over the first
rows of that chunk — a few rows per request, differentiable through autograd.

Conventions follow `chunk_kda` with use_gate_in_kernel=False (g is the log-space decay),
use_qk_l2norm_in_kernel=False (normalise before: `compact_kda(use_qk_l2norm=True)`), beta after
its sigmoid, H = HV (no grouped values), fp32 initial states, chunk size 32 or 64.
Tested (tests/ops/kda/test_fla_chunk.py) against `chunk_kda_torch`: on CPU under the Triton
interpreter in fp32, and on CUDA in bf16 (GPU-only tests); `harts bench kda-handoff` measures it.
Legend: T packed rows, N sequences, NT chunks, H heads, K key dim, V value dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from fla.ops.gla.chunk import chunk_gla_fwd_o_gk
from fla.ops.kda.chunk_bwd import chunk_kda_bwd_dAv, chunk_kda_bwd_wy_dqkg_fused
from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra, chunk_kda_fwd_intra
from fla.ops.kda.wy_fast import recompute_w_u_fwd
from fla.ops.utils import chunk_local_cumsum, prepare_chunk_indices
from fla.ops.utils.constant import RCP_LN2
from fla.utils import autocast_custom_bwd, autocast_custom_fwd, input_guard

from harts.ops.kda.chunk import check_inputs, check_requests, chunk_kda_torch, index_tensor
from harts.ops.kda.keep import kda_intermediates_kept
from harts.ops.kda.triton_state import StateLinks, state_backward, state_forward
from harts.planning.kda_schedule import KDASchedule

FLA_CHUNK_SIZES = (32, 64)


class ChunkKDAStatesFunction(torch.autograd.Function):
    """(o, final states, slot states) of one varlen call; slot s is the fp32 state at the start of
    the chunk c with state_slot[c] == s. All three outputs are differentiable."""

    @staticmethod
    @input_guard
    @autocast_custom_fwd
    def forward(ctx, q, k, v, g, beta, initial_state, scale, cu_seqlens, chunk_indices, chunk_offsets, state_slot,
                chunk_size, num_chunks, num_slots, keep_intermediates, links=None):
        g_cum = chunk_local_cumsum(g, chunk_size=chunk_size, scale=RCP_LN2, cu_seqlens=cu_seqlens,
                                   chunk_indices=chunk_indices)
        w, u, qg, kg, aqk, akk = chunk_kda_fwd_intra(
            q=q, k=k, v=v, gk=g_cum, beta=beta, scale=scale, cu_seqlens=cu_seqlens,
            chunk_size=chunk_size, chunk_indices=chunk_indices, disable_recompute=keep_intermediates,
        )
        h, v_new, final_state, slot_states = state_forward(
            kg, w, u, g_cum, initial_state, cu_seqlens, chunk_offsets, chunk_size, num_chunks,
            state_slot, num_slots, links,
        )
        o = chunk_gla_fwd_o_gk(q=q, v=v_new, g=g_cum, A=aqk, h=h, scale=scale, cu_seqlens=cu_seqlens,
                               chunk_size=chunk_size, chunk_indices=chunk_indices)
        # Kept (harts.ops.kda.keep): what the backward would otherwise compute again, the same kernels'
        # values (the intra kernel's w, u and gated q/k, the state pass's h and v_new).
        kept = (w, u, qg, kg, h, v_new) if keep_intermediates else ()
        assert all(x is not None for x in kept), "fla's intra kernel hands back the gated q when asked"
        if links is not None and not kept:
            # A linked launch's initial states are its slots: the recomputation in the backward starts from them.
            initial_state = slot_states
        ctx.save_for_backward(q, k, v, g_cum, beta, aqk, akk, initial_state, cu_seqlens, chunk_indices,
                              chunk_offsets, state_slot, *kept)
        ctx.scale, ctx.chunk_size, ctx.num_chunks, ctx.g_dtype = scale, chunk_size, num_chunks, g.dtype
        ctx.links = links
        ctx.set_materialize_grads(False)
        return o.type_as(q), final_state, slot_states

    @staticmethod
    @input_guard
    @autocast_custom_bwd
    def backward(ctx, do, dht, dslots):
        (q, k, v, g_cum, beta, aqk, akk, initial_state, cu_seqlens, chunk_indices, chunk_offsets,
         state_slot, *kept) = ctx.saved_tensors
        scale, chunk_size, num_chunks = ctx.scale, ctx.chunk_size, ctx.num_chunks
        if do is None:
            do = torch.zeros_like(v)
        if kept:
            w, u, qg, kg, h, v_new = kept
        else:
            w, u, qg, kg = recompute_w_u_fwd(k=k, v=v, beta=beta, A=akk, gk=g_cum, q=q, cu_seqlens=cu_seqlens,
                                             chunk_indices=chunk_indices)
            if ctx.links is not None:
                initial_state = ctx.links.initial_states(initial_state, len(cu_seqlens) - 1)
            h, v_new, _, _ = state_forward(kg, w, u, g_cum, initial_state, cu_seqlens, chunk_offsets, chunk_size,
                                           num_chunks)
        daqk, dv = chunk_kda_bwd_dAv(q=q, k=k, v=v_new, do=do, A=aqk, scale=scale, cu_seqlens=cu_seqlens,
                                     chunk_size=chunk_size, chunk_indices=chunk_indices)
        dh, dh0, dv = state_backward(qg, kg, w, g_cum, do, dv, dht, dslots, state_slot, cu_seqlens,
                                     chunk_offsets, chunk_size, num_chunks, scale, ctx.links)
        dq, dk, dv, db, dg, dakk = chunk_kda_bwd_wy_dqkg_fused(
            q=q, k=k, v=v, v_new=v_new, g=g_cum, beta=beta, A=akk, h=h, do=do, dh=dh, dv=dv, scale=scale,
            cu_seqlens=cu_seqlens, chunk_size=chunk_size, chunk_indices=chunk_indices,
        )
        dq, dk, db, dg = chunk_kda_bwd_intra(
            q=q, k=k, g=g_cum, beta=beta, dAqk=daqk, dAkk=dakk, dq=dq, dk=dk, db=db, dg=dg,
            cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, chunk_size=chunk_size,
        )
        dg = chunk_local_cumsum(dg, chunk_size=chunk_size, reverse=True, cu_seqlens=cu_seqlens,
                                chunk_indices=chunk_indices)
        return (dq.to(q), dk.to(k), dv.to(v), dg.to(ctx.g_dtype), db.to(beta), None if ctx.links is not None else dh0,
                None, None, None, None, None, None, None, None, None, None)


def chunk_kda_fla(
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
    r"""`chunk_kda_torch` on fla's kernels (CUDA; the Triton interpreter on CPU for tests).

    Args and returns as `chunk_kda_torch`: q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]``, beta
    ``[B, T, H]``, initial_state ``[N, H, K, V]`` (fp32), cu_seqlens ``[N + 1]``, chunk_size
    32 or 64, requested states by CSR (`state_ptr` ``[N + 1]``, `state_offsets`). Returns
    ``(o in q's dtype, final states or None, requested states fp32 or None)``.

    Example::

        >>> q, k = torch.randn(2, 1, 300, 4, 128, device="cuda", dtype=torch.bfloat16).unbind(0)  # doctest: +SKIP
        >>> v = torch.randn(1, 300, 4, 128, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
        >>> g = -torch.rand(1, 300, 4, 128, device="cuda")  # doctest: +SKIP
        >>> beta = torch.rand(1, 300, 4, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
        >>> o, _, states = chunk_kda_fla(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 100, 300]),
        ...     state_offsets=np.array([64, 128, 200]), state_ptr=np.array([0, 1, 3]))  # doctest: +SKIP
    """
    name = "chunk_kda_fla"
    lengths = check_inputs(name, q, k, v, g, beta, cu_seqlens, initial_state)
    if chunk_size not in FLA_CHUNK_SIZES:
        raise ValueError(f"{name}: fla's KDA kernels take chunk_size 32 or 64, got {chunk_size!r}")
    if q.shape[-1] > 256:
        raise ValueError(f"{name}: fla's KDA kernels take K ≤ 256, got {q.shape[-1]}")
    requests = check_requests(name, state_offsets, state_ptr, lengths)
    call = FlaCall.build(lengths, requests, chunk_size, q.device)
    batch, length = q.shape[:2]
    rows = [x.reshape(1, batch * length, *x.shape[2:]) for x in (q, k, v, g, beta)]
    o, final_state, states = call.run(*rows, scale=scale, initial_state=initial_state)
    return o.reshape(*v.shape[:3], v.shape[-1]), final_state if output_final_state else None, states


@dataclass(frozen=True, eq=False)
class FlaCall:
    """Everything one varlen call needs besides its inputs, on the device, built once: the
    compact execution runs the same calls in every KDA layer and again in recomputation, and
    building these inside a layer would copy host arrays to the device and read device values
    back (fla's chunk indices), each a synchronisation that stalls the GPU between kernels."""

    lengths: np.ndarray
    """int64 [N] sequence lengths (host)."""
    chunk_size: int
    num_chunks: int
    row_start: torch.Tensor
    """int64 [N + 1] cu_seqlens."""
    chunk_offsets: torch.Tensor
    """int64 [N + 1] first chunk of each sequence."""
    chunk_indices: torch.Tensor
    """[NT, 2] (sequence, chunk within it): fla's `prepare_chunk_indices`."""
    state_slot: torch.Tensor | None
    plan: _StatePlan

    @classmethod
    def build(cls, lengths: np.ndarray, requests: tuple[np.ndarray, np.ndarray] | None, chunk_size: int,
              device: torch.device) -> FlaCall:
        """`requests`: (sequence, offset) of each requested state (`check_requests`), or None."""
        lengths = np.asarray(lengths, dtype=np.int64)
        row_start = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        chunk_offsets = np.concatenate([[0], np.cumsum(-(-lengths // chunk_size))]).astype(np.int64)
        num_chunks = int(chunk_offsets[-1])
        plan = _StatePlan.build(requests, lengths, chunk_offsets, chunk_size, num_chunks, device)
        return cls(
            lengths=lengths, chunk_size=chunk_size, num_chunks=num_chunks, row_start=row_start.to(device),
            chunk_offsets=index_tensor(chunk_offsets, device),
            chunk_indices=prepare_chunk_indices(row_start, chunk_size).to(device),
            state_slot=torch.from_numpy(plan.state_slot).to(device) if plan.num_slots else None, plan=plan,
        )

    def run(self, q, k, v, g, beta, *, scale: float | None = None, initial_state: torch.Tensor | None = None):
        """(o in q's dtype, final states fp32 [N, H, K, V], requested states fp32 or None) of
        q, k, g ``[1, T, H, K]``, v ``[1, T, H, V]``, beta ``[1, T, H]`` and the fp32 initial
        states ``[N, H, K, V]`` (None: zero)."""
        _, _, heads, key_dim = q.shape
        value_dim = v.shape[-1]
        assert q.shape[:2] == (1, int(self.lengths.sum())), "the inputs are the call's packed rows"
        if scale is None:
            scale = key_dim**-0.5
        if initial_state is None:
            initial = q.new_zeros(len(self.lengths), heads, key_dim, value_dim, dtype=torch.float32)
        else:
            initial = initial_state.float()
        o, final_state, slot_states = ChunkKDAStatesFunction.apply(
            q, k, v, g, beta, initial, scale, self.row_start, self.chunk_indices, self.chunk_offsets,
            self.state_slot, self.chunk_size, self.num_chunks, self.plan.num_slots, kda_intermediates_kept(),
        )
        states = None
        if self.plan.kind is not None:
            states = self.plan.assemble((q, k, v, g, beta), initial, final_state, slot_states, scale,
                                        self.chunk_size)
        return o, final_state, states


@dataclass(frozen=True, eq=False)
class LinkedCalls:
    """Every call of a replay schedule as one varlen call of all their sequences (in call order), the hand-offs
    inside the state kernels (`StateLinks`): one launch of each fla kernel per KDA layer instead of one per call,
    and the state passes' chain of dependent chunks a root-to-leaf path instead of the calls' longest sequences
    one after another. The same values as running the calls one by one (`FlaCall` per call; the backward adds a
    slot's consumers' gradients in another order)."""

    call: FlaCall
    """All sequences, no requested states."""
    state_slot: torch.Tensor
    """int32 [NT] the slot stored at each chunk start (−1: none)."""
    num_slots: int
    links: StateLinks

    @classmethod
    def build(cls, schedule: KDASchedule, device: torch.device) -> LinkedCalls:
        """The linked form of `schedule` (replay: every hand-off at a chunk start inside its producer; more than
        one call, so at least one hand-off)."""
        assert schedule.replay and schedule.num_calls > 1, "linked calls: a replay schedule of several calls"
        chunk = schedule.chunk_size
        lengths = np.concatenate([np.diff(call.cu_seqlens) for call in schedule.calls])
        first_seq = np.concatenate([[0], np.cumsum([call.num_sequences for call in schedule.calls])])
        call = FlaCall.build(lengths, None, chunk, device)
        chunk_offsets = np.concatenate([[0], np.cumsum(-(-lengths // chunk))])
        source = np.concatenate([c.initial_source for c in schedule.calls])
        consumer_seqs = np.flatnonzero(source[:, 0] >= 0)
        source_chunk = np.empty(len(consumer_seqs), dtype=np.int64)
        for i, seq in enumerate(consumer_seqs):
            producer_call, producer_seq, boundary = (int(x) for x in source[seq])
            offset = int(schedule.calls[producer_call].sequence_boundaries(producer_seq)[boundary])
            producer = first_seq[producer_call] + producer_seq
            assert offset % chunk == 0 and offset < lengths[producer], "a replay hand-off starts a producer's chunk"
            source_chunk[i] = chunk_offsets[producer] + offset // chunk
        chunks, consumer_slots = np.unique(source_chunk, return_inverse=True)
        state_slot = np.full(max(call.num_chunks, 1), -1, dtype=np.int32)
        state_slot[chunks] = np.arange(len(chunks), dtype=np.int32)
        source_slot = np.full(len(lengths), -1, dtype=np.int32)
        source_slot[consumer_seqs] = consumer_slots
        order = np.argsort(consumer_slots, kind="stable")
        consumer_ptr = np.concatenate([[0], np.cumsum(np.bincount(consumer_slots, minlength=len(chunks)))])

        def on_device(index: np.ndarray, dtype=torch.int32) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(index)).to(device=device, dtype=dtype)

        links = StateLinks(
            source_slot=on_device(source_slot), consumer_ptr=on_device(consumer_ptr),
            consumers=on_device(consumer_seqs[order]), consumer_seqs=on_device(consumer_seqs, torch.int64),
            consumer_slots=on_device(consumer_slots, torch.int64),
        )
        return cls(call=call, state_slot=on_device(state_slot), num_slots=len(chunks), links=links)

    def run(self, q, k, v, g, beta, *, scale: float | None = None) -> torch.Tensor:
        """o in q's dtype ``[1, T, H, V]`` of q, k, g ``[1, T, H, K]``, v ``[1, T, H, V]``, beta ``[1, T, H]``:
        the rows of every call back to back."""
        call = self.call
        assert q.shape[:2] == (1, int(call.lengths.sum())), "the inputs are the calls' rows"
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        o, _, _ = ChunkKDAStatesFunction.apply(
            q, k, v, g, beta, None, scale, call.row_start, call.chunk_indices, call.chunk_offsets,
            self.state_slot, call.chunk_size, call.num_chunks, self.num_slots, kda_intermediates_kept(), self.links,
        )
        return o


# Where a requested state comes from (`_StatePlan.kind`).
_INITIAL, _FINAL, _SLOT, _PARTIAL = range(4)


@dataclass(frozen=True, eq=False)
class _PartialChunks:
    """Requests inside a chunk (the no-replay ablation): each state is formed by `chunk_kda_torch`
    over the first rows of its chunk, from the chunk's start state (the initial state or a slot)."""

    from_initial: torch.Tensor
    """Sequences whose initial state starts a request's chunk (chunks at offset 0)."""
    from_slot: torch.Tensor
    """Slots that start the other requests' chunks."""
    start_order: torch.Tensor
    """Request p's position among [from_initial..., from_slot...]."""
    rows: torch.Tensor
    """The call rows of every partial chunk, back to back."""
    cu_seqlens: np.ndarray
    """int64 [P + 1] their boundaries."""


@dataclass(frozen=True, eq=False)
class _StatePlan:
    """Sources of the requested states: the initial state, the final state, a kernel slot (a chunk
    start), or a partial chunk on top of the initial state or a slot; the gather indices are on
    the device (built once per call)."""

    state_slot: np.ndarray
    """int32 [NT] slot of each chunk start (−1: none)."""
    num_slots: int
    kind: np.ndarray | None = None
    """int64 [M] where each request's state comes from (`_INITIAL`, ...); None: no requests."""
    picks: tuple[tuple[int, torch.Tensor], ...] = ()
    """(kind, index into that kind's source tensor) for the initial, final and slot requests."""
    partial: _PartialChunks | None = None
    order: torch.Tensor | None = None
    """Request m's position among the concatenated picks and partial states."""

    @classmethod
    def build(cls, requests, lengths, chunk_offsets, chunk_size, num_chunks, device) -> _StatePlan:
        state_slot = np.full(max(num_chunks, 1), -1, dtype=np.int32)
        if requests is None:
            return cls(state_slot=state_slot, num_slots=0)

        def on_device(index: np.ndarray) -> torch.Tensor:
            return index_tensor(index, device)

        seq, offsets = requests
        base = offsets // chunk_size * chunk_size
        kind = np.full(len(offsets), _PARTIAL, dtype=np.int64)
        kind[offsets % chunk_size == 0] = _SLOT
        kind[offsets == 0] = _INITIAL
        kind[offsets == lengths[seq]] = _FINAL
        needs_slot = (kind == _SLOT) | ((kind == _PARTIAL) & (base > 0))
        chunk = chunk_offsets[seq] + base // chunk_size
        unique = np.unique(chunk[needs_slot])
        state_slot[unique] = np.arange(len(unique), dtype=np.int32)
        slot_of_request = np.where(needs_slot, state_slot[np.minimum(chunk, len(state_slot) - 1)], -1).astype(np.int64)
        picks, owners = [], []
        for source_kind, index in ((_INITIAL, seq), (_FINAL, seq), (_SLOT, slot_of_request)):
            owner = np.flatnonzero(kind == source_kind)
            if len(owner):
                picks.append((source_kind, on_device(index[owner])))
                owners.append(owner)
        partial = None
        mine = np.flatnonzero(kind == _PARTIAL)
        if len(mine):
            from_slot = slot_of_request[mine] >= 0
            row_start = np.concatenate([[0], np.cumsum(lengths)])
            first = row_start[seq[mine]] + base[mine]
            count = offsets[mine] - base[mine]
            partial = _PartialChunks(
                from_initial=on_device(seq[mine[~from_slot]]),
                from_slot=on_device(slot_of_request[mine[from_slot]]),
                start_order=on_device(np.argsort(np.concatenate([np.flatnonzero(~from_slot), np.flatnonzero(from_slot)]))),
                rows=on_device(np.concatenate([np.arange(a, a + n) for a, n in zip(first, count)])),
                cu_seqlens=np.concatenate([[0], np.cumsum(count)]).astype(np.int64),
            )
            owners.append(mine)
        return cls(state_slot=state_slot, num_slots=len(unique), kind=kind, picks=tuple(picks), partial=partial,
                   order=on_device(np.argsort(np.concatenate(owners))) if owners else None)

    def assemble(self, rows, initial, final_state, slot_states, scale, chunk_size) -> torch.Tensor:
        sources = {_INITIAL: initial, _FINAL: final_state, _SLOT: slot_states}
        parts = [sources[kind].index_select(0, index) for kind, index in self.picks]
        if self.partial is not None:
            p = self.partial
            start = torch.cat([initial.index_select(0, p.from_initial), slot_states.index_select(0, p.from_slot)])
            piece = [x.index_select(1, p.rows) for x in rows]
            _, ends, _ = chunk_kda_torch(
                *piece, scale=scale, initial_state=start.index_select(0, p.start_order), output_final_state=True,
                cu_seqlens=p.cu_seqlens, chunk_size=chunk_size,
            )
            parts.append(ends.float())
        if not parts:
            return initial.new_zeros(0, *initial.shape[1:])
        return torch.cat(parts).index_select(0, self.order)
