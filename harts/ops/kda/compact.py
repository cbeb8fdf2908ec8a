"""KDA over the compact rows of a segment tree, one packed chunked call per planned call.

`compact_kda(q, k, v, g, beta, schedule)` executes a `KDASchedule` (harts.planning.kda_schedule)
over compact rows [C, ...]: for each call it gathers the rows of its sequences (replay rows are
ancestors' compact rows), takes each sequence's initial state from the boundary state an earlier
call returned (zero for a root sequence), runs the chunked operator once with `cu_seqlens`, keeps
the boundary states the call must return, and writes the outputs of its computed (non-replay)
rows to their compact rows. Every compact row is computed exactly once, so the result is a
permutation of the calls' computed outputs; replay outputs are discarded.

On fla a replay schedule of several calls can run as one linked launch instead (`LinkedCalls`,
`prepare_schedule(..., calls="linked")`, harts/ops/kda/README.md "Linked calls": the state kernels
hand the states over inside it); the values are the same.

`prepare_schedule(schedule, device, backend)` puts the schedule's index tensors (and, for fla, each
call's chunk indices) on the device once per microbatch; `compact_kda` then gathers all calls' rows
with one gather per input and permutes the outputs with one gather, so a layer neither copies from
the host nor waits for the device (a model layout prepares its schedule when moved to the device).
Its three stages are public: `gather_call_rows` (compact rows → the calls' rows), `run_calls` (the
calls over those rows) and `computed_rows` (back to compact rows), so that a caller can gather its
own input once and compute q, k, v, g, β on the calls' rows (the model's KDA layer does: it moves
the hidden state instead of five tensors ten times its size).

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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from harts.config.execution import KDA_BACKENDS, KDA_CALLS
from harts.ops.kda.chunk import check_requests, chunk_kda_torch, index_tensor
from harts.planning.kda_schedule import KDASchedule

if TYPE_CHECKING:
    from harts.ops.kda.fla_chunk import FlaCall, LinkedCalls


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σ x² + eps) over the last dim, in fp32 at least (fla's `l2norm`)."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = x.to(dtype)
    return (y * torch.rsqrt((y * y).sum(-1, keepdim=True) + eps)).to(x.dtype)




def check_kda_backend(name: str, chunk_size: int, *, packed: bool = False) -> None:
    """ValueError unless backend `name` runs chunks of `chunk_size`: fla's compact kernels take 32 or 64, its
    packed `chunk_kda` (`packed=True`, the baseline's one call) only 64. Layouts check this when they are built,
    before a model runs: an error raised inside a checkpointed block under torch 2.11 leaves the checkpoint's
    saved-tensor hooks installed (its generator is not closed), and later graphs then recompute that block."""
    if name not in KDA_BACKENDS:
        prefix = "packed_kda" if packed else "compact_kda"
        raise ValueError(f"{prefix}: unknown backend {name!r} (expected 'torch' or 'fla')")
    if name != "fla":
        return
    if packed and chunk_size != 64:
        raise ValueError(f"packed_kda: fla's chunk_kda uses chunks of 64, got chunk_size {chunk_size}")
    from harts.ops.kda.fla_chunk import FLA_CHUNK_SIZES

    if chunk_size not in FLA_CHUNK_SIZES:
        raise ValueError(f"compact_kda: fla's KDA kernels take chunk_size 32 or 64, got {chunk_size}")


@dataclass(frozen=True, eq=False)
class PreparedCall:
    """One call of a prepared schedule: its slice of the gathered rows and its initial states."""

    rows: slice
    """The call's rows within the schedule's gathered rows."""
    cu_seqlens: np.ndarray
    state_offsets: np.ndarray
    state_ptr: np.ndarray
    initial: tuple[tuple[int, torch.Tensor], ...]
    """(producer call, index into its returned states) for the sequences with a handed-off state; empty when the
    calls run linked (`PreparedSchedule.linked` hands the states over)."""
    num_roots: int
    """Sequences starting from the zero state."""
    initial_order: torch.Tensor | None
    """Sequence i's position among the picked states, then the zero states; None: all zero, or linked."""
    fla: FlaCall | None = None
    """The call's device plan on the fla backend."""


@dataclass(frozen=True, eq=False)
class PreparedSchedule:
    """A `KDASchedule` with its index tensors on the device, built once per microbatch and used by
    every KDA layer and its recomputation, so a layer copies nothing from the host and never
    synchronises: each such copy would stall the GPU between two kernels of the layer."""

    schedule: KDASchedule
    backend: str
    device: torch.device
    gather: torch.Tensor
    """int64 [Σ R]: the compact row of every call row, calls back to back (replay rows repeat
    their ancestors' rows)."""
    output: torch.Tensor
    """int64 [C]: each compact row's position among the calls' rows, where it is computed."""
    replay_positions: torch.Tensor
    """int64: positions of the replay rows among the calls' rows ..."""
    replay_rows: torch.Tensor
    """... and the compact rows they repeat."""
    calls: tuple[PreparedCall, ...]
    calls_form: str = "separate"
    """How the calls were asked to run (`prepare_schedule`'s `calls`)."""
    linked: LinkedCalls | None = None
    """With calls "linked" on fla, a replay schedule of several calls: all of them as one linked launch."""

    @property
    def num_call_rows(self) -> int:
        """Σ R: the compact rows plus the replay rows."""
        return int(self.gather.shape[0])


def prepare_schedule(schedule: KDASchedule, device: torch.device | str, backend: str = "torch", *,
                     calls: str = "separate") -> PreparedSchedule:
    """The device form of `schedule` for `compact_kda` with `backend`. On fla a replay schedule of several calls
    runs them one after another (`calls` "separate") or as one linked launch ("linked": `LinkedCalls`)."""
    check_kda_backend(backend, schedule.chunk_size)
    if calls not in KDA_CALLS:
        raise ValueError(f"prepare_schedule: calls must be one of {', '.join(KDA_CALLS)}, got {calls!r}")
    device = torch.device(device)
    linked = None
    if backend == "fla" and schedule.replay and schedule.num_calls > 1 and calls == "linked":
        from harts.ops.kda.fla_chunk import LinkedCalls

        linked = LinkedCalls.build(schedule, device)

    def on_device(index: np.ndarray) -> torch.Tensor:
        return index_tensor(index, device)

    prepared_calls, outputs, destinations, replays, start = [], [], [], [], 0
    for call in schedule.calls:
        source = call.initial_source
        # A linked launch takes every initial state from its slots: the per-call gathers would be unused.
        handed = np.flatnonzero(source[:, 0] >= 0) if linked is None else np.zeros(0, dtype=np.int64)
        initial, owners = [], []
        for producer in np.unique(source[handed, 0]):
            mine = handed[source[handed, 0] == producer]
            producer_call = schedule.calls[int(producer)]
            initial.append((int(producer), on_device(producer_call.boundary_ptr[source[mine, 1]] + source[mine, 2])))
            owners.append(mine)
        roots = np.flatnonzero(source[:, 0] < 0)
        owners.append(roots)
        fla = None
        if backend == "fla" and linked is None:
            from harts.ops.kda.fla_chunk import FlaCall

            requests = check_requests("compact_kda", call.boundary_offsets, call.boundary_ptr,
                                      np.diff(call.cu_seqlens))
            fla = FlaCall.build(np.diff(call.cu_seqlens), requests, schedule.chunk_size, device)
        prepared_calls.append(PreparedCall(
            rows=slice(start, start + call.num_rows), cu_seqlens=call.cu_seqlens, state_offsets=call.boundary_offsets,
            state_ptr=call.boundary_ptr, initial=tuple(initial), num_roots=len(roots),
            initial_order=on_device(np.argsort(np.concatenate(owners))) if len(handed) else None, fla=fla,
        ))
        computed = np.flatnonzero(~call.is_replay)
        outputs.append(start + computed)
        destinations.append(call.rows[computed])
        replays.append(start + np.flatnonzero(call.is_replay))
        start += call.num_rows
    destination = np.concatenate(destinations) if destinations else np.zeros(0, dtype=np.int64)
    assert len(destination) == schedule.num_compact_tokens, "the schedule computes every compact row exactly once"
    output = np.empty(len(destination), dtype=np.int64)
    output[destination] = np.concatenate(outputs) if outputs else destination
    gather = np.concatenate([call.rows for call in schedule.calls]) if schedule.calls else destination
    replay_positions = np.concatenate(replays) if replays else destination
    gather_device = on_device(gather)
    return PreparedSchedule(
        schedule=schedule, backend=backend, device=gather_device.device, gather=gather_device, output=on_device(output),
        replay_positions=on_device(replay_positions), replay_rows=on_device(gather[replay_positions]),
        calls=tuple(prepared_calls), calls_form=calls, linked=linked,
    )


class _GatherCallRows(torch.autograd.Function):
    """Compact rows [C, ...] → the calls' rows [Σ R, ...]. Each compact row occurs once as a
    computed row and maybe again as replay rows, so its gradient is one gather (from its computed
    position) plus a scatter-add over the few replay rows — not the scatter-add over all rows of
    `index_select`'s backward, whose atomics are the slow part of this gather."""

    @staticmethod
    def forward(ctx, x, prepared: PreparedSchedule):
        ctx.prepared = prepared
        return x.index_select(0, prepared.gather)

    @staticmethod
    def backward(ctx, grad):
        p = ctx.prepared
        dx = grad.index_select(0, p.output)
        if p.replay_rows.numel():
            dx.index_add_(0, p.replay_rows, grad.index_select(0, p.replay_positions))
        return dx, None


class _ComputedRows(torch.autograd.Function):
    """The calls' outputs [Σ R, ...] → each compact row's computed output [C, ...]; the backward
    writes each gradient to its one computed position (no accumulation) and zero to replay rows."""

    @staticmethod
    def forward(ctx, packed, prepared: PreparedSchedule):
        ctx.prepared, ctx.num_packed = prepared, packed.shape[0]
        return packed.index_select(0, prepared.output)

    @staticmethod
    def backward(ctx, grad):
        dpacked = grad.new_zeros(ctx.num_packed, *grad.shape[1:])
        return dpacked.index_copy_(0, ctx.prepared.output, grad), None


def compact_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    schedule: KDASchedule | PreparedSchedule,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    backend: Literal["torch", "fla"] = "torch",
) -> torch.Tensor:
    r"""KDA over compact rows, executing `schedule`'s calls in order.

    Args:
        q, k: ``[C, H, K]``. v: ``[C, H, V]``. g: ``[C, H, K]`` log-space decay. beta: ``[C, H]``.
        schedule: the call plan of these C rows (`plan_kda_calls(tree, B, replay=...)`), or its
            `prepare_schedule` form (then its backend and device are used); its chunk size is the
            B of every call.
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
    prepared = schedule if isinstance(schedule, PreparedSchedule) else prepare_schedule(schedule, q.device, backend)
    num_rows = prepared.schedule.num_compact_tokens
    if q.dim() != 3 or q.shape[0] != num_rows or k.shape != q.shape or g.shape != q.shape:
        shapes = ", ".join(str(tuple(x.shape)) for x in (q, k, g))
        raise ValueError(f"compact_kda: q, k, g must be [C={num_rows}, H, K], got {shapes}")
    if v.dim() != 3 or v.shape[:2] != q.shape[:2] or beta.shape != q.shape[:2]:
        raise ValueError(f"compact_kda: v must be [C, H, V] and beta [C, H], got {tuple(v.shape)}, {tuple(beta.shape)}")
    if q.device != prepared.device:
        raise ValueError(f"compact_kda: inputs on {q.device}, schedule prepared for {prepared.device}")
    if not prepared.calls:
        return v.new_zeros(0, q.shape[1], v.shape[2])
    if use_qk_l2norm:
        q, k = normalise_qk(q, k, prepared.backend)
    # All calls' rows in one gather per input (the calls only depend on each other through states).
    inputs = (gather_call_rows(x, prepared) for x in (q, k, v, g, beta))
    return computed_rows(run_calls(*inputs, prepared, scale=scale), prepared)


def gather_call_rows(x: torch.Tensor, prepared: PreparedSchedule) -> torch.Tensor:
    """Compact rows ``[C, ...]`` → the calls' rows ``[Σ R, ...]`` (replay rows repeat their
    ancestors' rows). Any per-row function commutes with it, so a layer may gather its input
    once and compute q, k, v, g, β on the calls' rows (`KDALayer` does)."""
    return _GatherCallRows.apply(x, prepared)


def computed_rows(packed: torch.Tensor, prepared: PreparedSchedule) -> torch.Tensor:
    """The calls' rows ``[Σ R, ...]`` → each compact row's computed row ``[C, ...]`` (replay rows dropped)."""
    return _ComputedRows.apply(packed, prepared)


def run_calls(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    prepared: PreparedSchedule, *, scale: float | None = None,
) -> torch.Tensor:
    """o ``[Σ R, H, V]`` of the planned calls over their rows (`gather_call_rows` of compact rows;
    q and k already normalised), calls back to back, replay rows included."""
    heads, key_dim, value_dim = q.shape[1], q.shape[2], v.shape[2]
    if q.shape[0] != prepared.num_call_rows:
        raise ValueError(f"run_calls: inputs have {q.shape[0]} rows, the calls {prepared.num_call_rows}")
    if not prepared.calls:
        return v.new_zeros(0, heads, value_dim)
    if prepared.linked is not None:
        return prepared.linked.run(*(x.unsqueeze(0) for x in (q, k, v, g, beta)), scale=scale)[0]
    # Views by `split`, not by slicing: the backward of a slice writes a zero tensor of all the
    # calls' rows per call (and autograd then adds them up), `split`'s concatenates once.
    sizes = [call.rows.stop - call.rows.start for call in prepared.calls]
    per_call = zip(*(x.split(sizes) for x in (q, k, v, g, beta)))
    returned: list[torch.Tensor] = []
    outputs = []
    for call, rows in zip(prepared.calls, per_call):
        inputs = [x.unsqueeze(0) for x in rows]
        initial = _initial_states(call, returned, heads, key_dim, value_dim)
        if call.fla is not None:
            o, _, states = call.fla.run(*inputs, scale=scale, initial_state=initial)
        else:
            o, _, states = chunk_kda_torch(
                *inputs, scale=scale, initial_state=initial, cu_seqlens=call.cu_seqlens,
                chunk_size=prepared.schedule.chunk_size, state_offsets=call.state_offsets, state_ptr=call.state_ptr,
            )
        returned.append(states)
        outputs.append(o[0])
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def normalise_qk(q: torch.Tensor, k: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k L2-normalised per row: fla's fused kernel on the fla backend, `l2norm` otherwise."""
    if backend == "fla":
        from fla.modules.norm.l2norm import l2norm as fla_l2norm

        return fla_l2norm(q), fla_l2norm(k)
    return l2norm(q), l2norm(k)


def _initial_states(call: PreparedCall, returned: list[torch.Tensor], heads, key_dim, value_dim) -> torch.Tensor | None:
    """[n, H, K, V] initial states of a call's sequences, or None when all start from zero."""
    if call.initial_order is None:
        return None
    parts = [returned[producer].index_select(0, index) for producer, index in call.initial]
    if call.num_roots:
        parts.append(parts[0].new_zeros(call.num_roots, heads, key_dim, value_dim))
    return torch.cat(parts).index_select(0, call.initial_order)
