"""The linear-attention call schedule: what the compact KDA operator executes (DESIGN §3).

A `KDASchedule` is a list of `KDACall`s executed in order. Each call is one packed chunked call
(`chunk_kda` with `cu_seqlens`): n sequences, each a run of consecutive path positions of one
root-to-leaf path, chunked from its own first row. Legend: R = packed rows of a call, n =
sequences of a call, C = compact rows of the microbatch.

Per call:
- `rows` (int64 [R]): the compact row whose inputs (q, k, v, g, β) feed each packed row. Rows of a
  sequence are in path order: its replay rows first, then its computed rows.
- `is_replay` (bool [R]): replay rows update the state only; their outputs are discarded.
- `cu_seqlens` (int64 [n + 1]).
- `path_start` (int64 [n]): path position of each sequence's first row: 0 (a root sequence, zero
  state) or, with replay, the anchor ⌊start/B⌋·B of the segment it starts fresh at.
- `initial_source` (int64 [n, 3]): (-1, -1, -1) for the zero state, else (call r' < this call,
  sequence j of call r', boundary index k of that sequence) — the state returned there.
- `boundary_offsets` (int64, CSR with `boundary_ptr` (int64 [n + 1])): for sequence i, the row
  offsets o (1 ≤ o ≤ its length) after which the call must return the state (the state after
  processing the sequence's first o rows). With replay they are multiples of B; without replay
  (the ablation) they may be any offset.
- `handoff_depth` (int64 [n]): state handoffs on the chain that led to the sequence (0 for a
  sequence from the zero state, else 1 + its source sequence's depth).

Invariants (checked by `validate_schedule`, which the call planner's tests use): every compact
row is computed (non-replay) exactly once over all calls; every initial state refers to a
boundary returned by an earlier call; the rows of a sequence are consecutive path positions of
one path; with replay, each sequence starts at a chunk multiple and has fewer than B replay rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class KDACall:
    rows: np.ndarray
    is_replay: np.ndarray
    cu_seqlens: np.ndarray
    path_start: np.ndarray
    initial_source: np.ndarray
    boundary_offsets: np.ndarray
    boundary_ptr: np.ndarray
    handoff_depth: np.ndarray

    @property
    def num_sequences(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def num_rows(self) -> int:
        return int(self.cu_seqlens[-1])

    def sequence_boundaries(self, i: int) -> np.ndarray:
        return self.boundary_offsets[self.boundary_ptr[i] : self.boundary_ptr[i + 1]]


@dataclass(frozen=True, eq=False)
class KDASchedule:
    chunk_size: int
    """B: chunks are aligned at multiples of B from each sequence's first row."""
    replay: bool
    """False for the no-replay ablation (side branches start at the fork from the exact state)."""
    calls: tuple[KDACall, ...]
    num_compact_tokens: int

    @property
    def num_calls(self) -> int:
        return len(self.calls)

    @property
    def num_sequences(self) -> int:
        return sum(call.num_sequences for call in self.calls)

    @property
    def replay_tokens(self) -> int:
        return int(sum(call.is_replay.sum() for call in self.calls))


def validate_schedule(schedule: KDASchedule, positions: np.ndarray, parent_row: np.ndarray) -> None:
    """Raise AssertionError if `schedule` breaks an invariant of the module docstring.

    `positions` (int64 [C]) is the path position of each compact row; `parent_row` (int64 [C])
    the compact row of the previous path position (-1 at position 0).
    """
    chunk = schedule.chunk_size
    computed = np.zeros(schedule.num_compact_tokens, dtype=np.int64)
    for r, call in enumerate(schedule.calls):
        assert call.rows.shape == call.is_replay.shape == (call.num_rows,), "rows and is_replay: one per packed row"
        assert call.cu_seqlens[0] == 0 and (np.diff(call.cu_seqlens) > 0).all(), "cu_seqlens rise strictly from 0"
        np.add.at(computed, call.rows[~call.is_replay], 1)
        for i in range(call.num_sequences):
            lo, hi = call.cu_seqlens[i], call.cu_seqlens[i + 1]
            rows = call.rows[lo:hi]
            replay = call.is_replay[lo:hi]
            assert positions[rows[0]] == call.path_start[i], "a sequence's first row is at its path start"
            assert (parent_row[rows[1:]] == rows[:-1]).all(), "rows are consecutive positions of one path"
            num_replay = int(replay.sum())
            assert not replay[num_replay:].any(), "replay rows come first"
            assert num_replay < len(rows), "a sequence computes at least one row"
            if schedule.replay:
                assert call.path_start[i] % chunk == 0, "with replay, a sequence starts at a chunk multiple"
                assert num_replay < chunk, "with replay, fewer than B replay rows"
            source = call.initial_source[i]
            if source[0] < 0:
                assert call.path_start[i] == 0, "only sequences starting at position 0 use the zero state"
            else:
                src_call, src_seq, src_k = (int(x) for x in source)
                assert src_call < r, "initial state from an earlier call"
                producer = schedule.calls[src_call]
                offsets = producer.sequence_boundaries(src_seq)
                offset = int(offsets[src_k])
                produced_at = producer.path_start[src_seq] + offset
                assert produced_at == call.path_start[i], "state handed over at the sequence's start"
                last_row = producer.rows[producer.cu_seqlens[src_seq] + offset - 1]
                assert parent_row[rows[0]] == last_row, "the state comes from this path"
                assert call.handoff_depth[i] == producer.handoff_depth[src_seq] + 1, "handoff depth: 1 + the source's"
            for offset in call.sequence_boundaries(i):
                assert 1 <= offset <= hi - lo, "a boundary lies within its sequence"
                if schedule.replay:
                    assert (call.path_start[i] + offset) % chunk == 0, "with replay, boundaries are chunk multiples"
    assert (computed == 1).all(), "every compact row computed exactly once"
