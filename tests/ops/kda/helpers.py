"""Trees of chosen shapes, an independent one-segment-per-sequence scheduler, and the
per-trajectory reference that the compact KDA operator is compared with.

`segment_schedule(tree, B, replay)` is deliberately simple and unlike the call planner: every
segment is its own sequence, in the call numbered by its depth; with replay it starts at the
anchor ⌊start/B⌋·B and replays its ancestors' rows from there, taking the state at the anchor from
the sequence of the ancestor holding the row before it; without replay it starts at its own start
from its parent's final state. It passes `validate_schedule`, uses more calls and more replay than
the planner, and so exercises hand-offs across several calls.
"""

from __future__ import annotations

import numpy as np
import torch

from harts.ops.kda.chunk import chunk_kda_torch
from harts.planning.kda_schedule import KDACall, KDASchedule, validate_schedule
from harts.trees.trie import PrefixIndex, SegmentTree

from ...trees.helpers import make_step


def tree_from_shape(parent: list[int], lengths: list[int], ends: frozenset[int] = frozenset()) -> SegmentTree:
    """Node v holds `lengths[v]` tokens (all v + 1); a trajectory ends at every leaf and at `ends`."""
    has_child = {p for p in parent if p >= 0}
    sequences = []
    for v in range(len(parent)):
        if v in has_child and v not in ends:
            continue
        tokens: list[int] = []
        u = v
        while u >= 0:
            tokens = [u + 1] * lengths[u] + tokens
            u = parent[u]
        sequences.append(tokens)
    return PrefixIndex.from_step(make_step(sequences)).segment_tree()


def random_shape(rng: np.random.Generator, kind: str, chunk: int) -> SegmentTree:
    """A random tree of one of the shapes the tests name."""
    if kind == "chain":
        num = int(rng.integers(3, 6))
        lengths = [int(rng.integers(1, 2 * chunk + 2)) for _ in range(num)]
        return tree_from_shape([-1] + list(range(num - 1)), lengths, ends=frozenset(range(num - 1)))
    if kind == "bushy":
        num = int(rng.integers(6, 12))
        lengths = [int(rng.integers(1, 3 * chunk))] + [int(rng.integers(1, chunk + 3)) for _ in range(num)]
        return tree_from_shape([-1] + [0] * num, lengths)
    if kind == "forest":
        parent, lengths = [], []
        for _ in range(int(rng.integers(2, 4))):
            root = len(parent)
            parent.append(-1)
            lengths.append(int(rng.integers(1, 2 * chunk)))
            for _ in range(int(rng.integers(0, 4))):
                parent.append(root)
                lengths.append(int(rng.integers(1, 2 * chunk)))
        return tree_from_shape(parent, lengths)
    if kind == "chunk_forks":
        num = int(rng.integers(5, 9))
        parent = [-1] + [int(rng.integers(0, v)) for v in range(1, num)]
        return tree_from_shape(parent, [chunk * int(rng.integers(1, 3)) for _ in range(num)])
    if kind == "one_token":
        num = int(rng.integers(8, 16))
        parent = [-1] + [int(rng.integers(0, v)) for v in range(1, num)]
        lengths = [1 if rng.random() < 0.7 else int(rng.integers(2, chunk + 2)) for _ in range(num)]
        return tree_from_shape(parent, lengths)
    if kind == "random":
        num = int(rng.integers(6, 14))
        parent = [-1] + [int(rng.integers(-1, v)) for v in range(1, num)]
        lengths = [int(rng.integers(1, 2 * chunk + 1)) for _ in range(num)]
        ends = frozenset(int(v) for v in rng.choice(num, size=num // 4, replace=False))
        return tree_from_shape(parent, lengths, ends)
    raise ValueError(kind)


def parent_rows(tree: SegmentTree) -> np.ndarray:
    """int64 [C] compact row of the previous path position (-1 at position 0)."""
    parent_row = np.arange(-1, tree.num_compact_tokens - 1, dtype=np.int64)
    last_row = tree.compact_start + tree.segment_lengths - 1
    parent_row[tree.compact_start] = np.where(tree.parent >= 0, last_row[np.maximum(tree.parent, 0)], -1)
    return parent_row


def _path_rows(tree: SegmentTree, v: int, lo: int, hi: int) -> list[int]:
    """Compact rows of positions [lo, hi) on the path to segment v (all above v's start)."""
    rows: list[int] = []
    u = int(tree.parent[v])
    while u >= 0 and tree.end[u] > lo:
        first, last = max(lo, int(tree.start[u])), min(hi, int(tree.end[u]))
        rows = [int(tree.compact_start[u]) + p - int(tree.start[u]) for p in range(first, last)] + rows
        u = int(tree.parent[u])
    return rows


def segment_schedule(tree: SegmentTree, chunk: int, replay: bool) -> KDASchedule:
    depth = tree.depth()
    num_calls = int(depth.max()) + 1
    first = tree.start // chunk * chunk if replay else tree.start.copy()
    producer = np.full(tree.num_segments, -1, dtype=np.int64)
    for v in range(tree.num_segments):
        if first[v] == 0:
            continue
        u = int(tree.parent[v])
        while tree.start[u] > first[v] - 1:
            u = int(tree.parent[u])
        producer[v] = u
    wanted: dict[int, set[int]] = {}
    for v in np.flatnonzero(producer >= 0):
        wanted.setdefault(int(producer[v]), set()).add(int(first[v] - first[producer[v]]))
    members = [np.flatnonzero(depth == r) for r in range(num_calls)]
    slot = {int(v): i for call in members for i, v in enumerate(call)}
    handoff = np.zeros(tree.num_segments, dtype=np.int64)
    for v in range(tree.num_segments):
        if producer[v] >= 0:
            handoff[v] = handoff[producer[v]] + 1
    calls = []
    for r, segments in enumerate(members):
        rows, replayed, lengths, starts, sources, offsets, counts = [], [], [], [], [], [], []
        for v in segments.tolist():
            replay_rows = _path_rows(tree, v, int(first[v]), int(tree.start[v]))
            own = list(range(int(tree.compact_start[v]), int(tree.compact_start[v] + tree.segment_lengths[v])))
            rows += replay_rows + own
            replayed += [True] * len(replay_rows) + [False] * len(own)
            lengths.append(len(replay_rows) + len(own))
            starts.append(int(first[v]))
            if producer[v] >= 0:
                p = int(producer[v])
                sources.append((int(depth[p]), slot[p], sorted(wanted[p]).index(int(first[v] - first[p]))))
            else:
                sources.append((-1, -1, -1))
            mine = sorted(wanted.get(v, ()))
            offsets += mine
            counts.append(len(mine))
        calls.append(KDACall(
            rows=np.asarray(rows, dtype=np.int64),
            is_replay=np.asarray(replayed, dtype=bool),
            cu_seqlens=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            path_start=np.asarray(starts, dtype=np.int64),
            initial_source=np.asarray(sources, dtype=np.int64).reshape(-1, 3),
            boundary_offsets=np.asarray(offsets, dtype=np.int64),
            boundary_ptr=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
            handoff_depth=handoff[segments],
        ))
    schedule = KDASchedule(chunk_size=chunk, replay=replay, calls=tuple(calls),
                           num_compact_tokens=tree.num_compact_tokens)
    validate_schedule(schedule, tree.compact_positions(), parent_rows(tree))
    return schedule


def random_inputs(num_rows: int, heads: int, key_dim: int, value_dim: int, dtype: torch.dtype, seed: int,
                  device: str = "cpu", gate_scale: float = 1.0) -> list[torch.Tensor]:
    """q, k (L2-normalised), v, g ≤ 0, β ∈ (0, 1) over `num_rows` rows, as leaves requiring grad."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_rows, heads, key_dim, generator=gen, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(num_rows, heads, key_dim, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(num_rows, heads, value_dim, generator=gen, dtype=torch.float64)
    g = -torch.rand(num_rows, heads, key_dim, generator=gen, dtype=torch.float64) * gate_scale
    beta = torch.rand(num_rows, heads, generator=gen, dtype=torch.float64)
    return [x.to(device=device, dtype=dtype).requires_grad_() for x in (q, k, v, g, beta)]


def per_trajectory(inputs: list[torch.Tensor], tree: SegmentTree, chunk: int,
                   scale: float | None = None) -> torch.Tensor:
    """Every member trajectory its own sequence from position 0 (chunked from there), one packed
    call over semantic rows gathered through m: o [S, H, V]."""
    index = torch.from_numpy(tree.compact_map()).to(inputs[0].device)
    semantic = [x.index_select(0, index).unsqueeze(0) for x in inputs]
    cu = np.concatenate([[0], np.cumsum(tree.member_lengths)])
    o, _, _ = chunk_kda_torch(*semantic, scale=scale, cu_seqlens=torch.from_numpy(cu), chunk_size=chunk)
    return o[0]


def value_and_grads(run, leaves: list[torch.Tensor], upstream: torch.Tensor) -> list[torch.Tensor]:
    """[out, *d out·upstream / d leaves] for out = run(*leaves) (a tuple of outputs stacked), upstream cast
    to out's dtype: what the fused-kernel tests compare with their references."""
    out = run(*leaves)
    if isinstance(out, tuple):
        out = torch.stack(out)
    return [out, *torch.autograd.grad(out, leaves, upstream.to(out.dtype))]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖a − e‖ / ‖e‖ in fp64 (0 when both are zero)."""
    diff = (actual.double() - expected.double()).norm().item()
    norm = expected.double().norm().item()
    return diff / norm if norm else diff
