"""Triton kernels for the inter-chunk state pass of chunked KDA, with boundary states in and out.

fla's `chunk_gated_delta_rule_fwd_h` / `_bwd_dhu` run the chunk-level state recursion but expose
only the initial and final states in fp32 (the per-chunk states h are stored in the input dtype).
These two kernels compute the same recursion over the same inputs (fla's chunk-local quantities
kg, w, u, log2-cumulative gates, and in the backward qg, do, dv) and add one feature each:

- `state_forward` also stores, in fp32, the state at the start of every chunk c with
  `state_slot[c] ≥ 0` into `slot_states[state_slot[c]]` — the exact accumulator the recursion
  carries, not a rounded copy of h.
- `state_backward` adds `slot_grads[state_slot[c]]` to the running state gradient when the
  reverse sweep reaches the start of chunk c, so gradients of handed-off boundary states flow
  into every earlier chunk of the sequence (and into dh0) within the same single sweep.

Linked (`StateLinks`): the sequences of several dependent calls in one launch. A sequence whose
initial state is a slot of an earlier sequence waits (spinning on a flag per slot, head and value
tile) until that slot is stored, then starts from it; in the backward a producer waits at the
slot until each consumer has stored its initial-state gradient (dh0), and adds them in the
consumers' fixed order (so the sums are deterministic). Tiles take their work in the order their
CTAs start (an atomic ticket: forward in sequence order, backward in reverse), so a tile only
waits for tiles that have started, and the wait cannot deadlock. The chain of dependent chunks is
then a root-to-leaf path of the tree, not the calls' longest sequences one after another.

Recursion per sequence, head and chunk t (S_t: state at the chunk's start, γ_t = 2^{gk of its
last row}): v_new = u − w·S_t; S_{t+1} = diag(γ_t)·S_t + kgᵀ·v_new. Backward, with dS the gradient
of the state at the end of chunk t: dh[t] = dS; dv += kg·dS; dS ← diag(γ_t)·dS + scale·qgᵀ·do −
wᵀ·dv (+ injected slot gradient at S_t). Same layouts as fla: rows [1, T, H, ·], h/dh [1, NT, H,
K, V] indexed by global chunk id, chunk_offsets[i] the first chunk of sequence i.

Tested against PyTorch (tests/ops/kda/test_fla_chunk.py) on CPU under the Triton interpreter and
on CUDA by the GPU tests. K ≤ 256, chunk size a power of two ≥ 16.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MIN_BV = 32
"""The smallest value tile of the autotuned configs: the flags are laid out for it."""


@dataclass(frozen=True, eq=False)
class StateLinks:
    """Which sequence of a launch starts from which slot: the hand-offs of a linked launch (device tensors)."""

    source_slot: torch.Tensor
    """int32 [N] the slot each sequence's initial state is (-1: the zero state)."""
    consumer_ptr: torch.Tensor
    """int32 [S + 1] CSR over slots into `consumers` ..."""
    consumers: torch.Tensor
    """int32: ... the sequences starting from each slot, ascending."""
    consumer_seqs: torch.Tensor
    """int64: the sequences with a source slot ..."""
    consumer_slots: torch.Tensor
    """int64: ... and their slots (`initial_states`)."""

    def initial_states(self, slot_states: torch.Tensor, num_seqs: int) -> torch.Tensor:
        """fp32 [N, H, K, V]: each sequence's initial state (its slot's state, or zero)."""
        initial = slot_states.new_zeros(num_seqs, *slot_states.shape[1:])
        return initial.index_copy_(0, self.consumer_seqs, slot_states.index_select(0, self.consumer_slots))


def _sync_tensors(linked: bool, num_slots: int, heads: int, value_dim: int,
                  device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ticket int32 [1], flags int32 [slots x heads x value tiles]) zeroed; the autotuner zeroes them again
    before each timing run and before the run it keeps. An unlinked launch never reads them: it gets one zeroed
    tensor of the device, not a new one per call (and not one holding data, which the autotuner would zero)."""
    if not linked:
        return _unused_sync(torch.device(device))
    sync = torch.zeros(1 + num_slots * heads * triton.cdiv(value_dim, MIN_BV), dtype=torch.int32, device=device)
    return sync[:1], sync[1:]


@functools.cache
def _unused_sync(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    sync = torch.zeros(2, dtype=torch.int32, device=device)
    return sync[:1], sync[1:]


def _configs():
    return [triton.Config({"BV": bv}, num_warps=warps) for bv in (32, 64) for warps in (2, 4)]


@triton.autotune(configs=_configs(), key=["H", "K", "V", "BT"], reset_to_zero=["ticket", "flags"])
@triton.jit
def _state_forward_kernel(
    kg, w, u, gk, h, v_new, h0, ht, slot_states, state_slot, cu_seqlens, chunk_offsets, ticket, flags, source_slot,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, STORE_SLOTS: tl.constexpr, LINKED: tl.constexpr,
):
    NV = tl.cdiv(V, BV)
    if LINKED:
        # Tiles in the order their CTAs start: every tile a later one waits for has started, so none waits forever.
        pid = tl.atomic_add(ticket, 1)
    else:
        pid = tl.program_id(0)
    i_v, i_nh = pid % NV, pid // NV
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = eos - bos
    NT = tl.cdiv(T, BT)
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]
    if LINKED:
        source = tl.load(source_slot + i_n).to(tl.int64)
        if source >= 0:
            while tl.atomic_add(flags + (source * H + i_h) * NV + i_v, 0, sem="acquire", scope="gpu") == 0:
                pass
            b_h = tl.load(slot_states + (source * H + i_h) * K * V + o_kv, mask=m_kv, other=0.0,
                          cache_modifier=".cg")
        else:
            b_h = tl.zeros([BK, BV], dtype=tl.float32)
    else:
        b_h = tl.load(h0 + i_nh.to(tl.int64) * K * V + o_kv, mask=m_kv, other=0.0).to(tl.float32)

    for i_t in range(0, NT):
        i_c = boh + i_t
        tl.store(h + (i_c * H + i_h) * K * V + o_kv, b_h.to(h.dtype.element_ty), mask=m_kv)
        if STORE_SLOTS:
            slot = tl.load(state_slot + i_c).to(tl.int64)
            if slot >= 0:
                tl.store(slot_states + (slot * H + i_h) * K * V + o_kv, b_h, mask=m_kv)
                if LINKED:
                    # Every thread's part of the tile is written before the flag says so.
                    tl.debug_barrier()
                    tl.atomic_xchg(flags + (slot * H + i_h) * NV + i_v, 1, sem="release", scope="gpu")
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        row = bos + o_t
        b_w = tl.load(w + (row[:, None] * H + i_h) * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        p_u = (row[:, None] * H + i_h) * V + o_v[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_v = tl.load(u + p_u, mask=m_tv, other=0.0).to(tl.float32) - tl.dot(b_w, b_h.to(b_w.dtype))
        tl.store(v_new + p_u, b_v.to(v_new.dtype.element_ty), mask=m_tv)
        last = bos + tl.minimum(i_t * BT + BT, T) - 1
        b_gl = tl.load(gk + (last * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_kg = tl.load(kg + (row[None, :] * H + i_h) * K + o_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.0)
        b_h = b_h * tl.math.exp2(b_gl)[:, None] + tl.dot(b_kg, b_v.to(b_kg.dtype))

    tl.store(ht + i_nh.to(tl.int64) * K * V + o_kv, b_h, mask=m_kv)


@triton.autotune(configs=_configs(), key=["H", "K", "V", "BT"], reset_to_zero=["ticket", "flags"])
@triton.jit
def _state_backward_kernel(
    qg, kg, w, gk, do, dv, dv2, dh, dht, dh0, slot_grads, state_slot, cu_seqlens, chunk_offsets, scale,
    ticket, flags, source_slot, consumer_ptr, consumers, num_seqs,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, USE_FINAL_GRADIENT: tl.constexpr, INJECT: tl.constexpr, LINKED: tl.constexpr,
    AT_SLOTS: tl.constexpr,
):
    NV = tl.cdiv(V, BV)
    if LINKED:
        # Sequences in reverse, so a producer's tile starts after its consumers' (whose initial-state gradients it
        # waits for), and every tile a later one waits for has started.
        pid = num_seqs * H * NV - 1 - tl.atomic_add(ticket, 1)
    else:
        pid = tl.program_id(0)
    i_v, i_nh = pid % NV, pid // NV
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = eos - bos
    NT = tl.cdiv(T, BT)
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_FINAL_GRADIENT:
        b_dh += tl.load(dht + i_nh.to(tl.int64) * K * V + o_kv, mask=m_kv, other=0.0).to(tl.float32)

    for i_r in range(0, NT):
        i_t = NT - 1 - i_r
        i_c = boh + i_t
        tl.store(dh + (i_c * H + i_h) * K * V + o_kv, b_dh.to(dh.dtype.element_ty), mask=m_kv)
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        row = bos + o_t
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        p_v = (row[:, None] * H + i_h) * V + o_v[None, :]
        b_kg = tl.load(kg + (row[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
        b_dv = tl.dot(b_kg, b_dh.to(b_kg.dtype)) + tl.load(dv + p_v, mask=m_tv, other=0.0).to(tl.float32)
        tl.store(dv2 + p_v, b_dv.to(dv2.dtype.element_ty), mask=m_tv)
        last = bos + tl.minimum(i_t * BT + BT, T) - 1
        b_gl = tl.load(gk + (last * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        p_kt = (row[None, :] * H + i_h) * K + o_k[:, None]
        m_kt = m_k[:, None] & m_t[None, :]
        b_qg = tl.load(qg + p_kt, mask=m_kt, other=0.0)
        b_wt = tl.load(w + p_kt, mask=m_kt, other=0.0)
        b_do = tl.load(do + p_v, mask=m_tv, other=0.0)
        b_dh = (b_dh * tl.math.exp2(b_gl)[:, None] + tl.dot(b_qg, b_do.to(b_qg.dtype)) * scale
                - tl.dot(b_wt, b_dv.to(b_wt.dtype)))
        if AT_SLOTS:
            slot = tl.load(state_slot + i_c).to(tl.int64)
            if slot >= 0:
                if INJECT:
                    b_dh += tl.load(slot_grads + (slot * H + i_h) * K * V + o_kv, mask=m_kv, other=0.0)
                if LINKED:
                    # The state's consumers' initial-state gradients, summed in their fixed order.
                    first = tl.load(consumer_ptr + slot)
                    stop = tl.load(consumer_ptr + slot + 1)
                    while tl.atomic_add(flags + (slot * H + i_h) * NV + i_v, 0, sem="acquire",
                                        scope="gpu") < stop - first:
                        pass
                    for i_m in range(first, stop):
                        consumer = tl.load(consumers + i_m).to(tl.int64)
                        b_dh += tl.load(dh0 + (consumer * H + i_h) * K * V + o_kv, mask=m_kv, other=0.0,
                                        cache_modifier=".cg")

    tl.store(dh0 + i_nh.to(tl.int64) * K * V + o_kv, b_dh, mask=m_kv)
    if LINKED:
        source = tl.load(source_slot + i_n).to(tl.int64)
        if source >= 0:
            tl.debug_barrier()
            tl.atomic_add(flags + (source * H + i_h) * NV + i_v, 1, sem="release", scope="gpu")


def _block_k(key_dim: int) -> int:
    if key_dim > 256:
        raise ValueError(f"KDA state kernels support K ≤ 256, got {key_dim}")
    return max(16, triton.next_power_of_2(key_dim))


def state_forward(
    kg: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    gk: torch.Tensor,
    initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk_offsets: torch.Tensor,
    chunk_size: int,
    num_chunks: int,
    state_slot: torch.Tensor | None = None,
    num_slots: int = 0,
    links: StateLinks | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h [1, NT, H, K, V] in kg's dtype, v_new like u, final states fp32 [N, H, K, V], slot
    states fp32 [num_slots, H, K, V]); `state_slot` int32 [NT] (−1: no slot); NT = num_chunks.
    With `links` the initial states are the linked slots (and zero), `initial_state` is unused."""
    _, _, heads, key_dim = kg.shape
    value_dim = u.shape[-1]
    num_seqs = len(cu_seqlens) - 1
    h = kg.new_empty(1, num_chunks, heads, key_dim, value_dim)
    v_new = torch.empty_like(u)
    final_state = kg.new_empty(num_seqs, heads, key_dim, value_dim, dtype=torch.float32)
    slot_states = kg.new_empty(num_slots, heads, key_dim, value_dim, dtype=torch.float32)
    store_slots = state_slot is not None and num_slots > 0
    assert links is None or store_slots, "a linked launch hands over slots"
    ticket, flags = _sync_tensors(links is not None, num_slots, heads, value_dim, kg.device)
    grid = lambda meta: (triton.cdiv(value_dim, meta["BV"]) * num_seqs * heads,)  # noqa: E731
    _state_forward_kernel[grid](
        kg, w, u, gk, h, v_new, final_state if links is not None else initial_state, final_state, slot_states,
        state_slot if store_slots else cu_seqlens, cu_seqlens, chunk_offsets, ticket, flags,
        links.source_slot if links is not None else cu_seqlens,
        H=heads, K=key_dim, V=value_dim, BT=chunk_size, BK=_block_k(key_dim), STORE_SLOTS=store_slots,
        LINKED=links is not None,
    )
    return h, v_new, final_state, slot_states


def state_backward(
    qg: torch.Tensor,
    kg: torch.Tensor,
    w: torch.Tensor,
    gk: torch.Tensor,
    do: torch.Tensor,
    dv: torch.Tensor,
    dht: torch.Tensor | None,
    slot_grads: torch.Tensor | None,
    state_slot: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    chunk_offsets: torch.Tensor,
    chunk_size: int,
    num_chunks: int,
    scale: float,
    links: StateLinks | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dh [1, NT, H, K, V] in qg's dtype, dh0 fp32 [N, H, K, V], dv2 like dv): fla's
    `chunk_gated_delta_rule_bwd_dhu` plus the injected slot-state gradients, and with `links` each
    slot's consumers' dh0 added at the slot."""
    _, _, heads, key_dim = qg.shape
    value_dim = do.shape[-1]
    num_seqs = len(cu_seqlens) - 1
    dh = qg.new_empty(1, num_chunks, heads, key_dim, value_dim)
    dh0 = qg.new_empty(num_seqs, heads, key_dim, value_dim, dtype=torch.float32)
    dv2 = torch.empty_like(dv)
    inject = slot_grads is not None and state_slot is not None and slot_grads.shape[0] > 0
    assert links is None or state_slot is not None, "a linked launch hands over slots"
    num_slots = int(links.consumer_ptr.shape[0]) - 1 if links is not None else 0
    ticket, flags = _sync_tensors(links is not None, num_slots, heads, value_dim, qg.device)
    dummy = links.source_slot if links is not None else cu_seqlens
    grid = lambda meta: (triton.cdiv(value_dim, meta["BV"]) * num_seqs * heads,)  # noqa: E731
    _state_backward_kernel[grid](
        qg, kg, w, gk, do, dv, dv2, dh, dht if dht is not None else dh0, dh0,
        slot_grads.contiguous() if inject else dh0, state_slot if inject or links is not None else cu_seqlens,
        cu_seqlens, chunk_offsets, scale, ticket, flags, dummy,
        links.consumer_ptr if links is not None else dummy, links.consumers if links is not None else dummy,
        num_seqs,
        H=heads, K=key_dim, V=value_dim, BT=chunk_size, BK=_block_k(key_dim),
        USE_FINAL_GRADIENT=dht is not None, INJECT=inject, LINKED=links is not None,
        AT_SLOTS=inject or links is not None,
    )
    return dh, dh0, dv2
