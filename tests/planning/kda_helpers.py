"""Tiny rollout trees with chosen shapes, and the exhaustive scheduler that is the call planner's oracle.

`tree_from_shape(parent, lengths, ends)` turns a tree given by parent pointers (parents before
children, -1 for roots) and token counts into real trajectories (node i's tokens are all i + 1,
so siblings differ at their first token) and builds their segment tree through `PrefixIndex`;
a trajectory ends at every leaf and at every node in `ends` (that splits a chain into segments).

`brute_force_min_calls` tries every schedule of the execution model (DESIGN §3): every choice,
per internal segment, of ending its sequence there or continuing into any one child, and every
assignment of calls to the resulting sequences; a sequence's fresh start is legal iff the segment
holding the token before its first row was computed in an earlier call (or it starts at position
0 from the zero state).
"""

from __future__ import annotations

import itertools

import numpy as np

from harts.trees.trie import PrefixIndex, SegmentTree

from ..trees.helpers import make_step


def tree_from_shape(parent: list[int], lengths: list[int], ends: set[int] = frozenset()) -> SegmentTree:
    paths: list[list[int]] = []
    has_child = {p for p in parent if p >= 0}
    for v in range(len(parent)):
        tokens = [v + 1] * lengths[v]
        u = parent[v]
        while u >= 0:
            tokens = [u + 1] * lengths[u] + tokens
            u = parent[u]
        paths.append(tokens)
    sequences = [paths[v] for v in range(len(parent)) if v not in has_child or v in ends]
    return PrefixIndex.from_step(make_step(sequences)).segment_tree()


def _length(rng: np.random.Generator, position: int, chunk: int) -> int:
    """Token counts that hit the interesting cases: one token, around a chunk, up to a chunk multiple."""
    kind = rng.integers(6)
    if kind == 0:
        return 1
    if kind == 1:
        return chunk - position % chunk  # the segment ends on a chunk multiple
    if kind == 2:
        return chunk - position % chunk + chunk * int(rng.integers(1, 3))
    if kind == 3:
        return max(1, chunk + int(rng.integers(-1, 2)))
    return int(rng.integers(1, 3 * chunk + 1))


SHAPES = ("random", "binary", "chain", "runs", "bushy-root", "forest", "one-token", "chunk-aligned", "caterpillar")


def random_tree(rng: np.random.Generator, shape: str, num_nodes: int, chunk: int) -> SegmentTree:
    """A random tree of about `num_nodes` segments in one of `SHAPES`."""
    parent = [-1]
    for v in range(1, num_nodes):
        if shape == "chain":
            parent.append(v - 1)
        elif shape == "bushy-root":
            parent.append(0 if rng.random() < 0.7 else int(rng.integers(v)))
        elif shape == "forest":
            parent.append(-1 if rng.random() < 0.3 else int(rng.integers(v)))
        elif shape == "runs":
            parent.append(v - 1 if rng.random() < 0.6 else int(rng.integers(v)))
        elif shape == "binary":
            parent.append((v - 1) // 2)
        elif shape == "caterpillar":
            parent.append(v - 1 if v % 2 else v - 2)
        else:
            parent.append(int(rng.integers(v)))
    lengths, first = [], []
    for v in range(num_nodes):
        position = 0 if parent[v] < 0 else first[parent[v]] + lengths[parent[v]]
        first.append(position)
        if shape == "one-token":
            lengths.append(1)
        elif shape == "chunk-aligned":
            lengths.append(chunk * int(rng.integers(1, 3)))
        else:
            lengths.append(_length(rng, position, chunk))
    end_probability = {"chain": 1.0, "runs": 0.8}.get(shape, 0.2)
    ends = {v for v in range(num_nodes) if rng.random() < end_probability}
    return tree_from_shape(parent, lengths, ends)


def _holders(tree: SegmentTree, chunk: int, replay: bool) -> list[int]:
    """Per segment, the segment whose computation a fresh start there waits for (-1: zero state)."""
    parent, start = tree.parent.tolist(), tree.start.tolist()
    holders = []
    for v in range(tree.num_segments):
        first = start[v] // chunk * chunk if replay else start[v]
        u = parent[v]
        while u >= 0 and start[u] > first - 1:
            u = parent[u]
        holders.append(u if first > 0 else -1)
    return holders


def continuation_choices(tree: SegmentTree, *, allow_stop: bool = True):
    """Every map internal segment -> the child its sequence continues into (-1: it stops)."""
    parent = tree.parent.tolist()
    children: dict[int, list[int]] = {}
    for v, p in enumerate(parent):
        if p >= 0:
            children.setdefault(p, []).append(v)
    internal = sorted(children)
    options = [([-1] if allow_stop else []) + children[v] for v in internal]
    for choice in itertools.product(*options):
        yield dict(zip(internal, choice))


def _heads(tree: SegmentTree, continuation: dict[int, int]) -> tuple[list[int], list[int]]:
    """Sequence heads in preorder and the head of every segment's sequence."""
    parent = tree.parent.tolist()
    head_of = []
    for v, p in enumerate(parent):
        head_of.append(head_of[p] if p >= 0 and continuation[p] == v else v)
    return [v for v in range(len(parent)) if head_of[v] == v], head_of


def _feasible(heads: list[int], head_of: list[int], holders: list[int], num_calls: int) -> bool:
    call: dict[int, int] = {}

    def assign(i: int) -> bool:
        if i == len(heads):
            return True
        h = heads[i]
        for c in range(num_calls):
            # The holder is an ancestor, so its sequence's head comes earlier in preorder.
            if holders[h] >= 0 and call[head_of[holders[h]]] >= c:
                continue
            call[h] = c
            if assign(i + 1):
                return True
        return False

    return assign(0)


def brute_force_min_calls(tree: SegmentTree, chunk: int, *, replay: bool = True) -> int:
    holders = _holders(tree, chunk, replay)
    choices = [_heads(tree, c) for c in continuation_choices(tree)]
    for num_calls in range(1, tree.num_segments + 1):
        if any(_feasible(heads, head_of, holders, num_calls) for heads, head_of in choices):
            return num_calls
    raise AssertionError("every tree has a schedule with one call per segment")


def replay_total(tree: SegmentTree, chunk: int, continuation: dict[int, int]) -> int:
    """Replay rows when the sequences follow `continuation`: each non-root head replays to its anchor."""
    heads, _ = _heads(tree, continuation)
    return sum(int(tree.start[h]) % chunk for h in heads if tree.parent[h] >= 0)
