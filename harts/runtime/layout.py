"""Row layouts: how a microbatch's tokens become rows, for both executions.

A `Layout` is built once per microbatch and used by every layer (and by the recomputation in
backward). It holds the row inputs and everything a layer needs beyond per-row work:
- `positions` (int64 [R]): the path position of each row (RoPE uses original positions);
- the KDA rows: a KDA layer gathers its input to the rows of its calls (`kda_rows`), computes
  q/k/v/g/β and the output gate there and returns to the layout's rows (`from_kda_rows`). The
  baseline's KDA rows are its rows; the compact execution's are the planned calls' rows back to
  back, replay rows repeating their ancestors' rows (C + replay rows): gathering the hidden
  state once moves a tenth of the bytes of gathering q, k, v, g and β;
- `predecessors` (int64 [P, W - 1]): for each KDA row, the KDA rows of the 1st..(W-1)-th
  previous path positions, for the short causal conv (P points at an all-zero row before a
  path's start);
- the linear-attention execution over the KDA rows: one packed call over all trajectories
  (baseline) or the planned calls of a `KDASchedule` with state handoff and replay (compact);
- `groups` (AttentionGroups): MLA query groups with their ancestor KV rows, and the DFS
  subtree ends for the tree-mask backend;
- `multiplicity` (float32 [R] or None): q_c, the MoE loss weights (None = all ones);
- `semantic_rows` (int64 [S_mb]): the row of each semantic position of the members, members
  concatenated in the given order — the compact map m for the compact layout.

`baseline_layout` packs each trajectory as its own sequence (what a standard trainer does);
`compact_layout` uses the microbatch's segment tree: C compact rows in DFS preorder, the KDA
call schedule of harts.planning.kda_calls, and query groups = the schedule's sequences.
Invariant (tests/runtime, tests/model/test_equivalence.py): for any per-row function, both
layouts give the same value at every semantic position.
Legend: R rows, P KDA rows, N any rows, C channels, W conv width, S_mb semantic positions of the microbatch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from harts.config.execution import EXECUTIONS, GDN_KERNELS
from harts.ops import uses_fp32_kernels
from harts.ops.attention.groups import group_attention
from harts.ops.attention.query_groups import AttentionGroups
from harts.ops.kda.compact import (
    PreparedSchedule, check_kda_backend, computed_rows, gather_call_rows, normalise_qk, prepare_schedule, run_calls,
)
from harts.planning.kda_calls import compact_parent_row, plan_kda_calls
from harts.planning.kda_schedule import KDASchedule
from harts.trees.step import Step
from harts.trees.trie import PrefixIndex, SegmentTree

if TYPE_CHECKING:
    from harts.ops.kda.fla_chunk import FlaCall


@dataclass(eq=False)
class Layout:
    execution: str
    members: np.ndarray
    """int64 trajectory indices (of the step) in this microbatch, in row/semantic order."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    predecessors: torch.Tensor
    semantic_rows: torch.Tensor
    groups: AttentionGroups
    multiplicity: torch.Tensor | None
    chunk_size: int
    kda_schedule: KDASchedule | None = None
    """The compact execution's call plan."""
    kda_prepared: PreparedSchedule | None = None
    """`kda_schedule` on the layout's device (set by `to`), reused by every KDA layer."""
    cu_seqlens: torch.Tensor | None = None
    """The baseline's packed sequences (one KDA call)."""
    cu_seqlens_cpu: torch.Tensor | None = None
    """Their host copy, so fla need not read them back from the device in every layer."""
    attention_backend: str = "sdpa"
    kda_backend: str = "torch"
    gdn_kernel: str = "gdn"
    """The baseline's Gated DeltaNet kernel on the fla backend (harts.ops.gdn.packed; `StepConfig.gdn_kernel`)."""
    keep_kda_intermediates: bool = False
    """Recomputed blocks keep fla's KDA intermediates for their backward (`HybridModel.run_blocks`,
    harts.ops.kda.keep; `StepConfig.keep_kda_intermediates`); the torch KDA has none and ignores it."""
    kda_calls: str = "separate"
    """How the compact execution's KDA calls run on fla: separate or linked (`StepConfig.kda_calls`,
    harts.ops.kda.compact.prepare_schedule)."""
    info: dict = field(default_factory=dict)
    """Sizes for reports: rows, semantic tokens, KDA calls, replay rows, ancestor KV rows."""
    _packed_kda_call: FlaCall | None = field(default=None, init=False, repr=False)
    """The baseline's GDN call on fla's KDA kernels (`packed_kda_call`), built by the first GDN layer."""
    _conv_exception_rows: torch.Tensor | None = field(default=None, init=False, repr=False)
    _conv_exception_taps: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(
        default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        # Checked here rather than in the first KDA layer, which runs inside a checkpointed block.
        check_kda_backend(self.kda_backend, self.chunk_size, packed=self.kda_schedule is None)
        if self.gdn_kernel not in GDN_KERNELS:
            raise ValueError(f"layout: unknown gdn_kernel {self.gdn_kernel!r} (expected one of "
                             f"{', '.join(GDN_KERNELS)})")

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_kda_rows(self) -> int:
        return int(self.predecessors.shape[0])

    def prepared_schedule(self) -> PreparedSchedule:
        """The compact KDA schedule on the layout's device with its backend (prepared by `to`, or
        here once; prepared again if a `replace` changed the schedule, backend or device)."""
        assert self.kda_schedule is not None, "only the compact execution has a KDA schedule"
        prepared = self.kda_prepared
        if (prepared is None or prepared.schedule is not self.kda_schedule or prepared.backend != self.kda_backend
                or prepared.device != self.input_ids.device or prepared.calls_form != self.kda_calls):
            self.kda_prepared = prepare_schedule(self.kda_schedule, self.input_ids.device, self.kda_backend,
                                                 calls=self.kda_calls)
        return self.kda_prepared

    def kda_rows(self, x_RC: torch.Tensor) -> torch.Tensor:
        """The layout's rows → the KDA rows [P, C]."""
        return x_RC if self.kda_schedule is None else gather_call_rows(x_RC, self.prepared_schedule())

    def from_kda_rows(self, x_PC: torch.Tensor) -> torch.Tensor:
        """The KDA rows → the layout's rows [R, C] (the compact execution drops the replay rows)."""
        return x_PC if self.kda_schedule is None else computed_rows(x_PC, self.prepared_schedule())

    def to(self, device: torch.device | str) -> Layout:
        def move(t):
            return None if t is None else t.to(device)

        return replace(
            self,
            input_ids=move(self.input_ids), positions=move(self.positions), predecessors=move(self.predecessors),
            semantic_rows=move(self.semantic_rows), groups=self.groups.to(device),
            multiplicity=move(self.multiplicity), cu_seqlens=move(self.cu_seqlens),
            cu_seqlens_cpu=None if self.cu_seqlens is None else self.cu_seqlens.cpu(),
            kda_prepared=None if self.kda_schedule is None else prepare_schedule(
                self.kda_schedule, device, self.kda_backend, calls=self.kda_calls),
        )

    def causal_conv(self, x_PC: torch.Tensor, weight_CW: torch.Tensor) -> torch.Tensor:
        """Depthwise causal conv of KDA rows along each row's path; weight[:, -1] multiplies the row itself.

        Row p's j-th predecessor is row p − j for all but a few rows (a path's first W − 1 rows; in
        the compact execution also the rows after a fork or a call boundary): every row takes the
        shifted products (one fused multiply-add per tap over contiguous slices, no gathers), then
        those few rows (`conv_exception_rows`) are recomputed from their true predecessors with the
        same operations in the same order. `naive_causal_conv` is the gather-only reference."""
        width = weight_CW.shape[1]
        weight_CW = weight_CW.to(x_PC.dtype)
        out_PC = x_PC * weight_CW[:, -1]
        for j in range(1, min(width, x_PC.shape[0])):
            out_PC[j:].addcmul_(x_PC[:-j], weight_CW[:, -1 - j])
        rows = self.conv_exception_rows()
        if width > 1 and len(rows):
            predecessors = self.predecessors[rows]
            inside = predecessors < x_PC.shape[0]
            previous = x_PC[predecessors.clamp(max=x_PC.shape[0] - 1)] * inside[..., None]
            out_PC.index_copy_(0, rows, conv_taps(x_PC[rows], previous, weight_CW))
        return out_PC

    def causal_conv_silu(
        self, x_PC: torch.Tensor, weight_CW: torch.Tensor, num_parts: int, *, fused: bool | None = None
    ) -> tuple[torch.Tensor, ...]:
        """silu(`causal_conv`(x)) split into `num_parts` channel blocks [P, C / num_parts] (KDA's q, k, v).

        Fused (default: `harts.ops.uses_fp32_kernels`, on CUDA but for fp64 rows): one Triton kernel
        (`fused_shifted_conv_silu`: the shifted taps in fp32, SiLU, one rounding, each part written
        contiguous) computes every row as if its predecessors were the previous rows; the
        `conv_exception_rows` are then recomputed from their true predecessors by a kernel with the
        same arithmetic (so a row's bits do not depend on which rows are exceptions: the two
        executions stay equal), written into the output in place (`fused_conv_silu`). Otherwise
        `causal_conv` in x's dtype, then SiLU, as views of one tensor."""
        if fused is None:
            fused = uses_fp32_kernels(x_PC)
        if not fused:
            return F.silu(self.causal_conv(x_PC, weight_CW)).chunk(num_parts, dim=-1)
        from harts.ops.conv.fused import fused_conv_silu

        rows = self.conv_exception_rows()
        exceptions = (rows, *self.conv_exception_taps()) if weight_CW.shape[1] > 1 and len(rows) else None
        return fused_conv_silu(x_PC, weight_CW, num_parts, exceptions).unbind(0)

    def conv_exception_taps(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The `conv_exception_rows`' taps [n, W] (the row, then its predecessors; P = the zero row), the
        distinct rows they read and each tap's index among them (the gathered conv's backward sums its
        gradients per distinct row): cached per layout, so no layer's backward synchronises for them."""
        if self._conv_exception_taps is None:
            rows = self.conv_exception_rows()
            taps = torch.cat([rows[:, None], self.predecessors[rows]], dim=1)
            distinct, slot = torch.unique(taps, return_inverse=True)
            self._conv_exception_taps = (taps, distinct, slot)
        return self._conv_exception_taps

    def conv_exception_rows(self) -> torch.Tensor:
        """int64 KDA rows whose j-th predecessor is not row p − j for some j (cached per layout)."""
        if self._conv_exception_rows is None:
            num_rows, width = self.predecessors.shape[0], self.predecessors.shape[1] + 1
            shifted = (torch.arange(num_rows, device=self.predecessors.device)[:, None]
                       - torch.arange(1, width, device=self.predecessors.device))
            shifted = torch.where(shifted >= 0, shifted, num_rows)
            self._conv_exception_rows = torch.nonzero((self.predecessors != shifted).any(dim=1)).squeeze(1)
        return self._conv_exception_rows

    def linear_attention(self, q, k, v, g, beta) -> torch.Tensor:
        """KDA over the KDA rows with L2-normalised q and k: the planned calls (compact) or one
        packed call (baseline); o [P, H, V]."""
        from harts.ops.kda.packed import packed_kda

        if self.kda_schedule is not None:
            prepared = self.prepared_schedule()
            return run_calls(*normalise_qk(q, k, prepared.backend), v, g, beta, prepared)
        return packed_kda(
            q, k, v, g, beta, self.cu_seqlens, chunk_size=self.chunk_size, use_qk_l2norm=True, backend=self.kda_backend,
            cu_seqlens_cpu=self.cu_seqlens_cpu,
        )

    def gated_delta_rule(self, q, k, v, g, beta) -> torch.Tensor:
        """Gated DeltaNet (harts.ops.gdn) over the linear-attention rows with L2-normalised q and k [P, H, K],
        v [P, HV, V], per-head g and beta [P, HV]: the planned calls (compact: the KDA calls of its KDA form)
        or one packed call (baseline: on the fla backend `gdn_kernel`'s, fla's `chunk_gated_delta_rule` or its
        KDA kernels on the KDA form); o [P, HV, V]."""
        from harts.ops.gdn.compact import run_gdn_calls
        from harts.ops.gdn.packed import packed_gdn, packed_kda_call

        if self.kda_schedule is not None:
            prepared = self.prepared_schedule()
            return run_gdn_calls(*normalise_qk(q, k, prepared.backend), v, g, beta, prepared)
        if self.kda_backend == "fla" and self.gdn_kernel == "kda" and self._packed_kda_call is None:
            host = self.cu_seqlens_cpu if self.cu_seqlens_cpu is not None else self.cu_seqlens
            self._packed_kda_call = packed_kda_call(host, self.chunk_size, self.input_ids.device)
        return packed_gdn(
            q, k, v, g, beta, self.cu_seqlens, chunk_size=self.chunk_size, use_qk_l2norm=True, backend=self.kda_backend,
            kernel=self.gdn_kernel, cu_seqlens_cpu=self.cu_seqlens_cpu, kda_call=self._packed_kda_call,
        )

    def check_gdn_kernel(self) -> None:
        """ValueError when this layout's packed GDN call would run fla's GDN kernel where the installed fla
        refuses its backward (harts.ops.gdn.packed.check_gdn_kernel). A GDN model checks it before its first
        block runs: fla raises only in the backward, after the whole forward ran."""
        if self.kda_schedule is None:
            from harts.ops.gdn.packed import check_gdn_kernel

            check_gdn_kernel(self.gdn_kernel, self.kda_backend, self.input_ids.device)

    def attention(self, q_RHE, k_RHE, v_RHF, scale: float) -> torch.Tensor:
        return group_attention(q_RHE, k_RHE, v_RHF, self.groups, scale, self.attention_backend)


def conv_taps(x_NC: torch.Tensor, previous_NWC: torch.Tensor, weight_CW: torch.Tensor) -> torch.Tensor:
    """The causal conv of rows x given their 1st..(W−1)-th predecessors `previous[:, j − 1]` (zeros
    before a path's start): x·weight[:, −1], then one fused multiply-add per tap j with
    weight[:, −1 − j], in that order. The arithmetic of every causal-conv path (the shifted
    training path, its reference, decoding), so all of them round alike."""
    weight_CW = weight_CW.to(x_NC.dtype)
    out_NC = x_NC * weight_CW[:, -1]
    for j in range(1, weight_CW.shape[1]):
        out_NC = torch.addcmul(out_NC, previous_NWC[:, j - 1], weight_CW[:, -1 - j])
    return out_NC


def naive_causal_conv(x_PC: torch.Tensor, weight_CW: torch.Tensor, predecessors_PW: torch.Tensor) -> torch.Tensor:
    """Reference of `Layout.causal_conv`: every tap gathered from the predecessor table (row P: zero)."""
    padded = torch.cat([x_PC, x_PC.new_zeros(1, x_PC.shape[1])])
    return conv_taps(x_PC, padded[predecessors_PW], weight_CW)


def _predecessors(parent_row: np.ndarray, width: int) -> np.ndarray:
    """int64 [R, W - 1]: j-th previous row along the path; R (a zero row) past the path start."""
    num_rows = len(parent_row)
    step_back = np.where(parent_row >= 0, parent_row, num_rows)
    step_back = np.append(step_back, num_rows)
    columns, current = [], np.arange(num_rows)
    for _ in range(width - 1):
        current = step_back[current]
        columns.append(current)
    return np.stack(columns, axis=1) if columns else np.zeros((num_rows, 0), dtype=np.int64)


def _kda_predecessors(predecessors: np.ndarray, schedule: KDASchedule) -> np.ndarray:
    """Compact predecessors [C, W - 1] (C: none) → those of the calls' rows [P, W - 1] (P: none).
    A replay row repeats its compact row's inputs, so any call row holding a compact row serves
    as that row's predecessor: the first one."""
    call_rows = np.concatenate([call.rows for call in schedule.calls]) if schedule.calls else np.zeros(0, np.int64)
    num_compact, num_kda = len(predecessors), len(call_rows)
    rows, first_position = np.unique(call_rows, return_index=True)
    assert len(rows) == num_compact, "the calls hold every compact row"
    first = np.append(first_position, num_kda)
    return first[predecessors[call_rows]]


def _member_tokens(step: Step, members: np.ndarray) -> np.ndarray:
    return np.concatenate([step.trajectory_tokens(k) for k in members]).astype(np.int64)


def _groups(q_rows: list[np.ndarray], kv_rows: list[np.ndarray], subtree_end: np.ndarray) -> AttentionGroups:
    q_ptr = np.zeros(len(q_rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in q_rows], out=q_ptr[1:])
    kv_ptr = np.zeros(len(kv_rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in kv_rows], out=kv_ptr[1:])
    q_index, kv_index = np.concatenate(q_rows), np.concatenate(kv_rows)
    return AttentionGroups(
        q_index=torch.from_numpy(q_index),
        q_ptr=torch.from_numpy(q_ptr),
        kv_index=torch.from_numpy(kv_index),
        kv_ptr=torch.from_numpy(kv_ptr),
        row_subtree_end=torch.from_numpy(subtree_end.astype(np.int64)),
        max_q=int(np.diff(q_ptr).max()),
        max_k=int(np.diff(kv_ptr).max()),
        q_in_order=bool(np.array_equal(q_index, np.arange(len(q_index)))),
        kv_in_order=bool(np.array_equal(kv_index, np.arange(len(kv_index)))),
    )


def baseline_layout(
    step: Step, members: np.ndarray, *, conv_size: int, chunk_size: int,
    attention_backend: str = "sdpa", kda_backend: str = "torch", gdn_kernel: str = "gdn",
    attention_splits: list[np.ndarray] | None = None,
) -> Layout:
    """Each member trajectory its own packed sequence (rows = its semantic tokens).

    `attention_splits[i]` (positions in (0, length) of member i, ascending) splits the member's MLA
    queries into groups that start there, each attending to all of the member's earlier rows: the
    same attention, computed in other call shapes (the fidelity benchmark's tiling noise floor)."""
    members = np.asarray(members, dtype=np.int64)
    return packed_layout(
        _member_tokens(step, members), step.lengths[members], members, conv_size=conv_size, chunk_size=chunk_size,
        attention_backend=attention_backend, kda_backend=kda_backend, gdn_kernel=gdn_kernel,
        attention_splits=attention_splits,
    )


def packed_layout(
    input_ids: np.ndarray, lengths: np.ndarray, members: np.ndarray, *, conv_size: int, chunk_size: int,
    attention_backend: str = "sdpa", kda_backend: str = "torch", gdn_kernel: str = "gdn",
    attention_splits: list[np.ndarray] | None = None,
) -> Layout:
    """`baseline_layout` of sequences given by their tokens `input_ids` (int64, concatenated) and `lengths` (each
    >= 1; `members`: whose they are), so that a sequence need not be a whole trajectory of a step (harts.runtime.mtp's
    per-trajectory MTP rows: a trajectory from its k-th token on)."""
    starts = np.zeros(len(members) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    num_rows = int(starts[-1])
    rows = np.arange(num_rows, dtype=np.int64)
    parent_row = rows - 1
    parent_row[starts[:-1]] = -1
    positions = rows - np.repeat(starts[:-1], lengths)
    q_rows, kv_rows = [], []
    for i in range(len(members)):
        cuts = np.asarray(attention_splits[i] if attention_splits is not None else [], dtype=np.int64)
        if len(cuts) and (cuts[0] <= 0 or cuts[-1] >= lengths[i] or (np.diff(cuts) <= 0).any()):
            raise ValueError(f"baseline_layout: attention splits of member {i} must rise inside (0, {lengths[i]})")
        bounds = np.concatenate([[0], cuts, [lengths[i]]]) + starts[i]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            q_rows.append(rows[lo:hi])
            kv_rows.append(rows[starts[i] : hi])
    subtree_end = np.repeat(starts[1:], lengths)
    groups = _groups(q_rows, kv_rows, subtree_end)
    return Layout(
        execution="baseline",
        members=members,
        input_ids=torch.from_numpy(input_ids),
        positions=torch.from_numpy(positions),
        predecessors=torch.from_numpy(_predecessors(parent_row, conv_size)),
        semantic_rows=torch.from_numpy(rows),
        groups=groups,
        multiplicity=None,
        chunk_size=chunk_size,
        cu_seqlens=torch.from_numpy(starts),
        attention_backend=attention_backend,
        kda_backend=kda_backend,
        gdn_kernel=gdn_kernel,
        info={"rows": num_rows, "semantic_tokens": num_rows, "kda_calls": 1, "replay_rows": 0,
              "attention_kv_rows": groups.num_kv_rows, "attention_pairs": groups.num_pairs,
              "sequences": len(members)},
    )


def _ancestor_rows(tree: SegmentTree, segment_of_row: np.ndarray, row: int) -> np.ndarray:
    """Compact rows of the path positions before `row`, in path order."""
    v = int(segment_of_row[row])
    pieces = [np.arange(tree.compact_start[v], row)]
    u = int(tree.parent[v])
    while u >= 0:
        pieces.append(np.arange(tree.compact_start[u], tree.compact_start[u] + tree.end[u] - tree.start[u]))
        u = int(tree.parent[u])
    return np.concatenate(pieces[::-1])


def compact_layout(
    step: Step, index: PrefixIndex, members: np.ndarray, *, conv_size: int, chunk_size: int,
    replay: bool = True, attention_backend: str = "sdpa", kda_backend: str = "torch", gdn_kernel: str = "gdn",
) -> Layout:
    """One row per compact token of the members' trie, KDA executed by the planned calls (`gdn_kernel`: the
    baseline's, which `bench speedup`'s op breakdown times on these rows)."""
    members = np.asarray(members, dtype=np.int64)
    tree = index.segment_tree(members)
    compact_map = tree.compact_map()
    input_ids = np.empty(tree.num_compact_tokens, dtype=np.int64)
    input_ids[compact_map] = _member_tokens(step, members)
    return tree_layout(tree, input_ids, conv_size=conv_size, chunk_size=chunk_size, replay=replay,
                       attention_backend=attention_backend, kda_backend=kda_backend, gdn_kernel=gdn_kernel,
                       compact_map=compact_map)


def tree_layout(
    tree: SegmentTree, input_ids: np.ndarray, *, conv_size: int, chunk_size: int, replay: bool = True,
    attention_backend: str = "sdpa", kda_backend: str = "torch", gdn_kernel: str = "gdn",
    compact_map: np.ndarray | None = None,
) -> Layout:
    """`compact_layout` of a segment tree whose compact rows hold the tokens `input_ids` (int64 [C]), so that the
    tree need not be a step's trie (harts.runtime.mtp: the trie below depth k); `compact_map`: the tree's, when
    already computed."""
    members = tree.members
    compact_map = tree.compact_map() if compact_map is None else compact_map
    num_rows = tree.num_compact_tokens
    parent_row = compact_parent_row(tree)
    schedule = plan_kda_calls(tree, chunk_size, replay=replay)
    kda_predecessors = _kda_predecessors(_predecessors(parent_row, conv_size), schedule)

    segment_of_row = tree.compact_segment()
    q_rows, kv_rows = [], []
    for call in schedule.calls:
        for i in range(call.num_sequences):
            lo, hi = int(call.cu_seqlens[i]), int(call.cu_seqlens[i + 1])
            computed = call.rows[lo:hi][~call.is_replay[lo:hi]]
            q_rows.append(computed)
            kv_rows.append(np.concatenate([_ancestor_rows(tree, segment_of_row, int(computed[0])), computed]))
    segment_end_row = np.append(tree.compact_start, num_rows)[tree.subtree_end]
    groups = _groups(q_rows, kv_rows, segment_end_row[segment_of_row])
    return Layout(
        execution="compact",
        members=members,
        input_ids=torch.from_numpy(input_ids),
        positions=torch.from_numpy(tree.compact_positions()),
        predecessors=torch.from_numpy(kda_predecessors),
        semantic_rows=torch.from_numpy(compact_map),
        groups=groups,
        multiplicity=torch.from_numpy(tree.multiplicity().astype(np.float32)),
        chunk_size=chunk_size,
        kda_schedule=schedule,
        attention_backend=attention_backend,
        kda_backend=kda_backend,
        gdn_kernel=gdn_kernel,
        info={"rows": num_rows, "semantic_tokens": tree.num_semantic_tokens, "kda_calls": schedule.num_calls,
              "replay_rows": schedule.replay_tokens, "attention_kv_rows": groups.num_kv_rows,
              "attention_pairs": groups.num_pairs, "sequences": schedule.num_sequences},
    )
