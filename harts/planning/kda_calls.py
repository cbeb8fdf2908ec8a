"""The linear-attention (KDA) call planner: the fewest packed chunked calls for a segment tree.

Provides `plan_kda_calls(tree, chunk_size, *, replay=True) -> KDASchedule` (the structure of
`harts.planning.kda_schedule`), `min_calls` (T_pre of the roots), `call_counts` (T_pre, T_in and
the chosen direct continuation of every segment), `forced_replay` (R) and `compact_parent_row`
(each compact row's predecessor on its path: the validator's and the short convolution's index).
`naive_call_counts` and `naive_plan_kda_calls` are plain per-segment Python twins of the
vectorised functions and their test reference; the oracle of both is an exhaustive search over
every schedule of the execution model on tiny trees (tests/planning/kda_helpers.py).

Execution model and recursion (DESIGN §3). A sequence starts at a root (position 0, zero state) or
fresh at the anchor a = ⌊start(h)/B⌋·B of a segment h, replaying [a, start(h)), computes h and
continues directly into one child, down to a leaf. A state produced in a call is usable only by
later calls. T_pre(v) / T_in(v) count the calls needed for v's subtree from v's call on, when the
state at v's entry anchor was / was not available before that call. With best(v) = min over
children d of max(T_in(d), 1 + max_{c≠d} T_pre(c)): leaves 1; T_in(v) = best(v); T_pre(v) =
max_c T_pre(c) when ⌊end(v)/B⌋ = ⌊start(v)/B⌋ (the children's anchor is v's entry anchor), else
best(v). Without replay (the ablation) a side branch starts at its fork position from the exact
state after its parent, so it always waits for the next call: the recursion with that condition
always false.

Recovery rule. Every internal segment continues into its heavy child d1, the first child (token
order) with the largest T_pre. It attains best(v): T_in(d) ≤ 1 + T_pre(d) for every d, so any other
d gives 1 + max T_pre ≥ max(T_in(d1), 1 + second largest T_pre). Side children start as early as
the model allows: in v's call when v's entry anchor state was available before it and v ends in
its entry chunk (then the continuation keeps that property), else in the next call. So the
sequences are the chains from a head (a root or a side child) down heavy children to a leaf, one
per leaf, and the replay total is exactly R = Σ_v (|ch(v)| − 1)·(end(v) mod B) (0 without replay).

Output order: a call's sequences follow the continuation-first DFS preorder of their heads (the
preorder that visits each heavy child first, in which every sequence's segments are contiguous);
a producer returns the distinct boundary offsets its consumers need, ascending.

Invariants (tested): `validate_schedule` passes; num_calls == min_calls == the exhaustive minimum
on tiny trees; replay_tokens == forced_replay; the vectorised plan equals the naive one array for
array. Cost: O(V + C) numpy work in (max fork depth + 1) vectorised passes per direction, plus at
most B − 1 passes over the side branches for the replay rows; a chain of single-child segments
costs nothing extra, but each level of fork nesting costs a fixed ~0.1 ms (`harts bench kda-calls`
records 1M segments in about 1 s with C = 32M rows; a caterpillar of 20,000 nested forks, 1.9 s).

Legend: V segments, C compact rows, n sequences of the microbatch, B chunk size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harts.planning.kda_schedule import KDACall, KDASchedule
from harts.trees.trie import SegmentTree


@dataclass(frozen=True, eq=False)
class CallCounts:
    """The recursion's values per segment."""

    t_pre: np.ndarray
    """int64 [V] calls for the subtree from the segment's call on, its entry anchor state ready before."""
    t_in: np.ndarray
    """int64 [V] the same when that state is produced in the segment's own call."""
    continuation: np.ndarray
    """int64 [V] the heavy child the segment's sequence continues into (-1 for a leaf)."""


def _check_chunk(chunk_size: int) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(f"chunk size must be a positive integer, got {chunk_size!r}")
    return int(chunk_size)


def _same_chunk(tree: SegmentTree, chunk: int, replay: bool) -> np.ndarray:
    if not replay:
        return np.zeros(tree.num_segments, dtype=bool)
    return tree.end // chunk == tree.start // chunk


def compact_parent_row(tree: SegmentTree) -> np.ndarray:
    """int64 [C] the compact row of the previous path position (-1 at position 0)."""
    parent_row = np.arange(-1, tree.num_compact_tokens - 1, dtype=np.int64)
    parent = tree.parent
    last_row = tree.compact_start + tree.segment_lengths - 1
    parent_row[tree.compact_start] = np.where(parent >= 0, last_row[np.maximum(parent, 0)], -1)
    return parent_row


def forced_replay(tree: SegmentTree, chunk_size: int) -> int:
    """R = Σ_v (|ch(v)| − 1)·(end(v) mod B): replay rows of any schedule with direct continuations."""
    chunk = _check_chunk(chunk_size)
    internal = tree.num_children > 0
    return int(((tree.num_children[internal] - 1) * (tree.end[internal] % chunk)).sum())


def _stable_order(keys: np.ndarray) -> np.ndarray:
    """Stable argsort of small non-negative integers (radix sort when they fit 16 bits)."""
    return np.argsort(keys.astype(np.int16) if keys.max() < 2**15 else keys, kind="stable")


@dataclass(frozen=True, eq=False)
class _Levels:
    """Segments grouped by fork depth, and the runs of single-child segments inside a level.

    A run starts at a segment whose parent does not have exactly one child (its head) and goes
    down through single children to the first segment that does not have exactly one child (its
    bottom). A run is consecutive ids in preorder and lies in one level, so one pass per level
    handles any chain at once: the passes number max fork depth + 1, not max depth + 1.
    """

    order: np.ndarray
    """int64 [V] segments by fork depth, preorder inside a level (so a family is adjacent)."""
    bounds: np.ndarray
    """int64 [levels + 1] level L is order[bounds[L]:bounds[L + 1]]."""
    single: np.ndarray
    """bool [V] the segment has exactly one child."""
    run_head: np.ndarray
    """int64 [V] first segment of the segment's run."""
    run_bottom: np.ndarray
    """int64 [V] last segment of the segment's run (its first descendant that is not single-child)."""
    not_same_before: np.ndarray
    """int64 [V + 1] segments before each id that do not end in their entry chunk."""

    def level(self, index: int) -> np.ndarray:
        return self.order[self.bounds[index] : self.bounds[index + 1]]


def _levels(tree: SegmentTree, same: np.ndarray) -> _Levels:
    num = tree.num_segments
    ids = np.arange(num)
    fork_depth = tree.fork_depth()
    order = _stable_order(fork_depth)
    single = tree.num_children == 1
    opens_run = (tree.parent < 0) | ~single[np.maximum(tree.parent, 0)]
    not_same_before = np.zeros(num + 1, dtype=np.int64)
    np.cumsum(~same, out=not_same_before[1:])
    return _Levels(
        order=order,
        bounds=np.searchsorted(fork_depth[order], np.arange(int(fork_depth.max()) + 2)),
        single=single,
        run_head=np.maximum.accumulate(np.where(opens_run, ids, 0)),
        run_bottom=np.minimum.accumulate(np.where(single, num, ids)[::-1])[::-1],
        not_same_before=not_same_before,
    )


def _call_counts(tree: SegmentTree, same: np.ndarray, levels: _Levels) -> CallCounts:
    num = tree.num_segments
    t_pre = np.ones(num, dtype=np.int64)
    t_in = np.ones(num, dtype=np.int64)
    # Per segment, over its children: largest T_pre (1 for a leaf, so a leaf's T_pre is 1 either
    # way), second largest (0 when there is one child: no side branch) and the heavy child's T_in.
    largest = np.ones(num, dtype=np.int64)
    second = np.zeros(num, dtype=np.int64)
    heavy_in = np.ones(num, dtype=np.int64)
    continuation = np.full(num, -1, dtype=np.int64)
    for level in range(len(levels.bounds) - 2, -1, -1):
        nodes = levels.level(level)
        in_run = levels.single[nodes]
        bottoms = nodes[~in_run]
        bottom_in = np.maximum(heavy_in[bottoms], second[bottoms] + 1)
        t_in[bottoms] = bottom_in
        t_pre[bottoms] = np.where(same[bottoms], largest[bottoms], bottom_in)
        # Above a run's bottom w: T_in = T_in(w), and T_pre = T_pre(w) while every segment
        # down to w ends in its entry chunk (the anchor stays the same), else T_in(w).
        singles = nodes[in_run]
        below = levels.run_bottom[singles]
        t_in[singles] = t_in[below]
        same_down = levels.not_same_before[below] == levels.not_same_before[singles]
        t_pre[singles] = np.where(same_down, t_pre[below], t_in[below])
        continuation[singles] = singles + 1

        children = nodes[(tree.parent[nodes] >= 0) & (levels.run_head[nodes] == nodes)]
        if not len(children):
            continue
        level_pre, level_in = t_pre[children], t_in[children]
        parents = tree.parent[children]
        first = np.flatnonzero(np.concatenate(([True], parents[1:] != parents[:-1])))
        # One reduction finds each family's largest T_pre and, among ties, the first child.
        width = len(children) + 1
        top = np.maximum.reduceat(level_pre * width + (width - 1 - np.arange(len(children))), first)
        heavy = width - 1 - top % width
        owners = parents[first]
        largest[owners] = top // width
        rest = level_pre.copy()
        rest[heavy] = 0
        second[owners] = np.maximum.reduceat(rest, first)
        heavy_in[owners] = level_in[heavy]
        continuation[owners] = children[heavy]
    return CallCounts(t_pre=t_pre, t_in=t_in, continuation=continuation)


def call_counts(tree: SegmentTree, chunk_size: int, *, replay: bool = True) -> CallCounts:
    """T_pre, T_in and the heavy-child continuation of every segment (level passes, bottom-up)."""
    chunk = _check_chunk(chunk_size)
    if tree.num_segments == 0:
        empty = np.zeros(0, dtype=np.int64)
        return CallCounts(t_pre=empty, t_in=empty, continuation=empty)
    same = _same_chunk(tree, chunk, replay)
    return _call_counts(tree, same, _levels(tree, same))


def min_calls(tree: SegmentTree, chunk_size: int, *, replay: bool = True) -> int:
    """The fewest calls: the largest T_pre over the roots (a forest's trees run side by side)."""
    counts = call_counts(tree, chunk_size, replay=replay)
    return int(counts.t_pre[tree.parent < 0].max()) if tree.num_segments else 0


def plan_kda_calls(tree: SegmentTree, chunk_size: int, *, replay: bool = True) -> KDASchedule:
    """A schedule with the fewest calls (`min_calls`) for the segment tree of one microbatch.

    `replay=False` is the ablation: side branches start at their fork position from the exact
    state after it (boundary offsets may be mid-chunk) and replay nothing.
    """
    chunk = _check_chunk(chunk_size)
    num = tree.num_segments
    num_compact = tree.num_compact_tokens
    if num == 0:
        return KDASchedule(chunk_size=chunk, replay=replay, calls=(), num_compact_tokens=0)
    parent, start, end, compact_start = tree.parent, tree.start, tree.end, tree.compact_start
    same = _same_chunk(tree, chunk, replay)
    levels = _levels(tree, same)
    continuation = _call_counts(tree, same, levels).continuation

    # Top-down: position in the continuation-first preorder, the call of every segment, and
    # whether every segment from its sequence's head down to it ends in its entry chunk (then a
    # side child may start in the same call, from the head's anchor state). A run's head gets
    # its values from its parent, the rest of the run (single children: continuations) from it.
    size = tree.subtree_end - np.arange(num)
    new_position = np.empty(num, dtype=np.int64)
    call = np.empty(num, dtype=np.int64)
    same_run = np.empty(num, dtype=bool)
    for level in range(len(levels.bounds) - 1):
        nodes = levels.level(level)
        opens = levels.run_head[nodes] == nodes
        roots = nodes[opens & (parent[nodes] < 0)]
        new_position[roots] = roots
        call[roots] = 0
        same_run[roots] = same[roots]
        children = nodes[opens & (parent[nodes] >= 0)]
        parents = parent[children]
        heavy = continuation[parents]
        is_heavy = heavy == children
        # A side child moves past the heavy subtree when the heavy child comes after it.
        shift = np.where(heavy > children, size[heavy], 0)
        new_position[children] = new_position[parents] + np.where(is_heavy, 1, children - parents + shift)
        call[children] = call[parents] + (~is_heavy & ~same_run[parents])
        same_run[children] = same[children] & (~is_heavy | same_run[parents])
        followers = nodes[~opens]
        head = levels.run_head[followers]
        new_position[followers] = new_position[head] + followers - head
        call[followers] = call[head]
        same_down = levels.not_same_before[followers + 1] == levels.not_same_before[head + 1]
        same_run[followers] = same_run[head] & same_down

    by_position = np.empty(num, dtype=np.int64)
    by_position[new_position] = np.arange(num)
    is_head = np.ones(num, dtype=bool)
    is_head[continuation[continuation >= 0]] = False
    head_at = np.flatnonzero(is_head[by_position])
    heads = by_position[head_at]
    leaves = by_position[np.append(head_at[1:], num) - 1]
    num_sequences = len(heads)
    sequence_of = np.empty(num, dtype=np.int64)
    sequence_of[by_position] = np.cumsum(is_head[by_position]) - 1

    # Sequences are numbered in continuation-first preorder; `rank` is their place in the
    # schedule (by call, then that preorder).
    sequence_call = call[heads]
    schedule_order = _stable_order(sequence_call)
    rank = np.empty(num_sequences, dtype=np.int64)
    rank[schedule_order] = np.arange(num_sequences)
    num_calls = int(sequence_call.max()) + 1
    call_first = np.searchsorted(sequence_call[schedule_order], np.arange(num_calls + 1))

    path_start = start[heads] // chunk * chunk if replay else start[heads].copy()
    num_replay = start[heads] - path_start
    lengths = end[leaves] - path_start
    row_offsets = np.zeros(num_sequences + 1, dtype=np.int64)
    np.cumsum(lengths[schedule_order], out=row_offsets[1:])

    # Packed rows come in pieces, each a run of consecutive compact rows: a sequence's replay
    # rows, one piece per ancestor segment that its window [path_start, start(head)) touches
    # (found in at most B - 1 passes over the branches whose window reaches further up), then
    # its segments. The walk also finds the segment holding the token before the window, whose
    # sequence produced the initial state.
    lengths_of = tree.segment_lengths
    holder = parent[heads].copy()
    replay_pieces = np.zeros(num_sequences, dtype=np.int64)
    passes = []
    walking = np.flatnonzero(num_replay > 0)
    segment = parent[heads[walking]]
    remaining = num_replay[walking]
    while len(walking):
        take = np.minimum(remaining, lengths_of[segment])
        passes.append((walking, compact_start[segment] + lengths_of[segment] - take, take))
        replay_pieces[walking] += 1
        remaining = remaining - take
        done = remaining == 0
        inside = take[done] < lengths_of[segment[done]]
        holder[walking[done]] = np.where(inside, segment[done], parent[segment[done]])
        going = ~done
        walking, segment, remaining = walking[going], parent[segment[going]], remaining[going]
    pieces_before = np.zeros(num_sequences + 1, dtype=np.int64)
    np.cumsum((replay_pieces + np.diff(np.append(head_at, num)))[schedule_order], out=pieces_before[1:])
    first_piece = pieces_before[rank] + replay_pieces
    piece_row = np.empty(int(pieces_before[-1]), dtype=np.int64)
    piece_length = np.empty_like(piece_row)
    slot = first_piece[sequence_of] + new_position - head_at[sequence_of]
    piece_row[slot] = compact_start
    piece_length[slot] = lengths_of
    for back, (walking, first_row, take) in enumerate(passes, start=1):
        slot = first_piece[walking] - back
        piece_row[slot] = first_row
        piece_length[slot] = take
    # The packed rows are a cumulative sum of ones that jumps at every piece start.
    num_rows = int(row_offsets[-1])
    rows = np.ones(num_rows, dtype=np.int64)
    piece_at = np.zeros(len(piece_row), dtype=np.int64)
    np.cumsum(piece_length[:-1], out=piece_at[1:])
    rows[piece_at] = piece_row - np.concatenate(([0], (piece_row + piece_length - 1)[:-1]))
    np.cumsum(rows, out=rows)
    replay_runs = np.stack((num_replay, lengths - num_replay), axis=1)[schedule_order].reshape(-1)
    is_replay = np.repeat(np.tile([True, False], num_sequences), replay_runs)

    consumers = np.flatnonzero(path_start > 0)
    producer = sequence_of[holder[consumers]]
    offset = path_start[consumers] - path_start[producer]
    stride = int(lengths.max()) + 1
    boundary_key, which = np.unique(rank[producer] * stride + offset, return_inverse=True)
    boundary_offsets = boundary_key % stride
    boundary_ptr = np.searchsorted(boundary_key // stride, np.arange(num_sequences + 1))

    initial_source = np.full((num_sequences, 3), -1, dtype=np.int64)
    producer_call = sequence_call[producer]
    initial_source[rank[consumers]] = np.stack(
        (producer_call, rank[producer] - call_first[producer_call], which - boundary_ptr[rank[producer]]), axis=1
    )
    source_rank = np.full(num_sequences, -1, dtype=np.int64)
    source_rank[rank[consumers]] = rank[producer]
    handoff_depth = np.zeros(num_sequences, dtype=np.int64)
    for r in range(1, num_calls):
        members = np.arange(call_first[r], call_first[r + 1])
        members = members[source_rank[members] >= 0]
        handoff_depth[members] = handoff_depth[source_rank[members]] + 1

    ordered_start = path_start[schedule_order]
    calls = []
    for r in range(num_calls):
        lo, hi = int(call_first[r]), int(call_first[r + 1])
        row_lo, row_hi = int(row_offsets[lo]), int(row_offsets[hi])
        ptr_lo, ptr_hi = int(boundary_ptr[lo]), int(boundary_ptr[hi])
        calls.append(KDACall(
            rows=rows[row_lo:row_hi],
            is_replay=is_replay[row_lo:row_hi],
            cu_seqlens=row_offsets[lo : hi + 1] - row_lo,
            path_start=ordered_start[lo:hi],
            initial_source=initial_source[lo:hi],
            boundary_offsets=boundary_offsets[ptr_lo:ptr_hi],
            boundary_ptr=boundary_ptr[lo : hi + 1] - ptr_lo,
            handoff_depth=handoff_depth[lo:hi],
        ))
    return KDASchedule(chunk_size=chunk, replay=replay, calls=tuple(calls), num_compact_tokens=num_compact)


def _int64(values: list) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def _children(tree: SegmentTree) -> list[list[int]]:
    children: list[list[int]] = [[] for _ in range(tree.num_segments)]
    for v, p in enumerate(tree.parent.tolist()):
        if p >= 0:
            children[p].append(v)
    return children


def naive_call_counts(tree: SegmentTree, chunk_size: int, *, replay: bool = True) -> CallCounts:
    """Reference for `call_counts`: the recursion evaluated literally, one segment at a time."""
    chunk = _check_chunk(chunk_size)
    children = _children(tree)
    num = tree.num_segments
    t_pre, t_in, continuation = [1] * num, [1] * num, [-1] * num
    for v in reversed(range(num)):
        family = children[v]
        if not family:
            continue
        best = min(
            max([t_in[d]] + [1 + t_pre[c] for c in family if c != d]) for d in family
        )
        same = replay and int(tree.end[v]) // chunk == int(tree.start[v]) // chunk
        t_in[v] = best
        t_pre[v] = max(t_pre[c] for c in family) if same else best
        heavy = max(family, key=lambda c: (t_pre[c], -c))
        assert max([t_in[heavy]] + [1 + t_pre[c] for c in family if c != heavy]) == best
        continuation[v] = heavy
    return CallCounts(t_pre=_int64(t_pre), t_in=_int64(t_in), continuation=_int64(continuation))


def naive_plan_kda_calls(tree: SegmentTree, chunk_size: int, *, replay: bool = True) -> KDASchedule:
    """Reference for `plan_kda_calls`: the same schedule built by walking the tree in Python."""
    chunk = _check_chunk(chunk_size)
    start, end = tree.start.tolist(), tree.end.tolist()
    compact_start, parent = tree.compact_start.tolist(), tree.parent.tolist()
    continuation = naive_call_counts(tree, chunk, replay=replay).continuation.tolist()
    children = _children(tree)

    def same(v: int) -> bool:
        return replay and end[v] // chunk == start[v] // chunk

    # Continuation-first DFS: (segment, call, every segment from its head to here ends in its
    # entry chunk); a side child waits for the next call unless its parent's run allows it.
    visit: list[tuple[int, int]] = []
    stack = [(v, 0, same(v)) for v in reversed(range(len(start))) if parent[v] < 0]
    while stack:
        v, call, run = stack.pop()
        visit.append((v, call))
        heavy = continuation[v]
        for c in reversed(children[v]):
            if c != heavy:
                stack.append((c, call if run else call + 1, same(c)))
        if heavy >= 0:
            stack.append((heavy, call, same(heavy) and run))

    heads = sorted(
        (call, index, v) for index, (v, call) in enumerate(visit) if parent[v] < 0 or continuation[parent[v]] != v
    )
    sequence_of_segment: dict[int, int] = {}
    sequences = []
    for number, (call, _, head) in enumerate(heads):
        chain = [head]
        while continuation[chain[-1]] >= 0:
            chain.append(continuation[chain[-1]])
        for v in chain:
            sequence_of_segment[v] = number
        path_start = start[head] // chunk * chunk if replay and parent[head] >= 0 else start[head]
        # The ancestors covering the replay window, then `u`, the first one wholly before it.
        ancestors = []
        u = parent[head]
        while u >= 0 and end[u] > path_start:
            ancestors.append(u)
            u = parent[u]
        replay_rows = []
        for position in range(path_start, start[head]):
            owner = next(a for a in ancestors if start[a] <= position < end[a])
            replay_rows.append(compact_start[owner] + position - start[owner])
        computed = [compact_start[v] + i for v in chain for i in range(end[v] - start[v])]
        holder = -1
        if path_start > 0:
            holder = next((a for a in ancestors if start[a] < path_start), u)
        sequences.append({"call": call, "head": head, "path_start": path_start, "holder": holder,
                          "replay": replay_rows, "computed": computed})

    boundaries: list[set[int]] = [set() for _ in sequences]
    for s in sequences:
        if s["holder"] >= 0:
            s["producer"] = sequence_of_segment[s["holder"]]
            s["offset"] = s["path_start"] - sequences[s["producer"]]["path_start"]
            boundaries[s["producer"]].add(s["offset"])
    sorted_boundaries = [sorted(b) for b in boundaries]
    index_in_call: list[int] = []
    depth: list[int] = []
    counts: dict[int, int] = {}
    for s in sequences:
        index_in_call.append(counts.get(s["call"], 0))
        counts[s["call"]] = index_in_call[-1] + 1
        depth.append(depth[s["producer"]] + 1 if s["holder"] >= 0 else 0)

    calls = []
    for r in range(len(counts)):
        members = [number for number, s in enumerate(sequences) if s["call"] == r]
        rows, is_replay, cu_seqlens, offsets, ptr, sources = [], [], [0], [], [0], []
        for number in members:
            s = sequences[number]
            rows += s["replay"] + s["computed"]
            is_replay += [True] * len(s["replay"]) + [False] * len(s["computed"])
            cu_seqlens.append(len(rows))
            offsets += sorted_boundaries[number]
            ptr.append(len(offsets))
            if s["holder"] >= 0:
                p = s["producer"]
                sources.append([sequences[p]["call"], index_in_call[p], sorted_boundaries[p].index(s["offset"])])
            else:
                sources.append([-1, -1, -1])
        calls.append(KDACall(
            rows=_int64(rows),
            is_replay=np.asarray(is_replay, dtype=bool),
            cu_seqlens=_int64(cu_seqlens),
            path_start=_int64([sequences[n]["path_start"] for n in members]),
            initial_source=_int64(sources).reshape(-1, 3),
            boundary_offsets=_int64(offsets),
            boundary_ptr=_int64(ptr),
            handoff_depth=_int64([depth[n] for n in members]),
        ))
    return KDASchedule(chunk_size=chunk, replay=replay, calls=tuple(calls), num_compact_tokens=tree.num_compact_tokens)
