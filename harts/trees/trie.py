"""Prefix structures of a step: sorted order, adjacent LCP, RMQ, and the segment tree.

`PrefixIndex.from_step(step)` sorts the N trajectories lexicographically (stable) and stores the
adjacent-LCP array with a sparse table, so the LCP of any two trajectories (and the sorted order
and adjacent LCPs of any subset) is answered without touching the tokens again. The sort
(`sort_with_lcp`) is a multikey partition around pivots that compares token runs with numpy and
never rereads a token it has proven shared, so it costs about one pass over the Σ adjacent-LCP
shared tokens; `naive_sort_with_lcp` (Python's sort on big-endian byte strings, then one
comparison per adjacent pair) is its reference.

`SegmentTree` is the compressed trie of a set of trajectories ("members": the whole step or a
microbatch). A segment is a maximal run of compact tokens with no fork and no trajectory end
inside, so every member's path is a sequence of whole segments. Segments are numbered in DFS
preorder (children in token order); the compact rows of segment v are
`compact_start[v] : compact_start[v] + (end[v] - start[v])`, so compact ids are a preorder of
the trie and the members through v are a contiguous range of the sorted order.

Invariants (tested against a brute-force dict trie): C = Σ (end - start) = Σ len - Σ adjacent
LCP; every semantic position (x, i) maps to the compact row of the segment on x's path
covering i, and two positions share a row iff their trajectories agree on tokens 0..i;
Σ multiplicity = S. Legend: N trajectories, n members, V segments, C compact rows, S semantic
tokens of the members.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harts.trees.step import Step


def _adjacent_lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = a[:n] != b[:n]
    first = int(differ.argmax()) if n else 0
    return first if n and differ[first] else n


def naive_sort_with_lcp(step: Step) -> tuple[np.ndarray, np.ndarray]:
    """(order, lcp) by Python's stable sort on big-endian byte strings: the reference of `sort_with_lcp`."""
    # Big-endian bytes compare like the token sequences, and a proper prefix sorts first.
    keys = [step.trajectory_tokens(k).astype(">u4").tobytes() for k in range(step.num_trajectories)]
    order = np.asarray(sorted(range(len(keys)), key=keys.__getitem__), dtype=np.int64)
    del keys
    lcp = np.zeros(len(order), dtype=np.int64)
    for r in range(1, len(order)):
        lcp[r] = _adjacent_lcp(step.trajectory_tokens(order[r - 1]), step.trajectory_tokens(order[r]))
    return order, lcp


def _first_difference(tokens: np.ndarray, a: int, b: int, start: int, stop: int) -> int:
    """The first i in [start, stop) with tokens[a + i] != tokens[b + i], else stop."""
    # Growing windows: a difference near `start` (another tree) costs one short comparison,
    # a long shared run costs about its own length.
    width = 4096
    while start < stop:
        end = min(stop, start + width)
        differ = tokens[a + start : a + end] != tokens[b + start : b + end]
        first = int(differ.argmax())
        if differ[first]:
            return start + first
        start = end
        width *= 4
    return stop


def sort_with_lcp(step: Step) -> tuple[np.ndarray, np.ndarray]:
    """(order, lcp): the stable lexicographic order of the trajectories and its adjacent LCPs.

    A group of trajectories known to share their first `depth` tokens is split around its
    lowest-index member p: every other member x is compared with p from `depth` on, giving
    l = LCP(x, p) and the tokens of x and p at l (-1 past the end, so a proper prefix sorts
    first). Members with the same (l, token of x) share l + 1 tokens and form a subgroup;
    subgroups sort below p by (l, token) and above p by (-l, token), copies of p follow it in
    index order, and two neighbouring subgroups share min(l, l') tokens. Subgroups are split
    the same way, depth first, so the output comes out in order.
    """
    tokens = step.tokens
    offsets = step.offsets[:-1].tolist()
    lengths = step.lengths.tolist()
    order: list[int] = []
    lcp: list[int] = []
    # (members in index order, shared depth, LCP with the previous trajectory of the output)
    stack: list[tuple[list[int], int, int]] = [(list(range(step.num_trajectories)), 0, 0)]
    while stack:
        members, depth, before = stack.pop()
        pivot = members[0]
        if len(members) == 1:
            order.append(pivot)
            lcp.append(before)
            continue
        start, length = offsets[pivot], lengths[pivot]
        below: dict[tuple[int, int], list[int]] = {}
        above: dict[tuple[int, int], list[int]] = {}
        copies: list[int] = []
        for x in members[1:]:
            shared = _first_difference(tokens, offsets[x], start, depth, min(lengths[x], length))
            token_x = int(tokens[offsets[x] + shared]) if shared < lengths[x] else -1
            token_p = int(tokens[start + shared]) if shared < length else -1
            if token_x == token_p:
                copies.append(x)
            elif token_x < token_p:
                below.setdefault((shared, token_x), []).append(x)
            else:
                above.setdefault((-shared, token_x), []).append(x)
        groups: list[tuple[list[int], int, int]] = []
        previous = before
        for shared, token in sorted(below):
            # A subgroup that ended at `shared` (token -1) is a set of copies: nothing left to compare.
            groups.append((below[shared, token], shared + (token >= 0), previous))
            previous = shared
        groups.append(([pivot], length, previous))
        groups.extend(([x], length, length) for x in copies)
        previous = length
        for negative, token in sorted(above):
            groups.append((above[negative, token], -negative + 1, min(previous, -negative)))
            previous = -negative
        stack.extend(reversed(groups))
    return np.asarray(order, dtype=np.int64), np.asarray(lcp, dtype=np.int64)


class PrefixIndex:
    """Lexicographic order and adjacent LCPs of a step's trajectories, with O(1) range-min."""

    def __init__(self, lengths: np.ndarray, order: np.ndarray, lcp: np.ndarray) -> None:
        self.lengths = lengths
        """int64 [N] tokens per trajectory (batch order)."""
        self.order = order
        """int64 [N] sorted rank -> trajectory index."""
        self.rank = np.empty_like(order)
        """int64 [N] trajectory index -> sorted rank."""
        self.rank[order] = np.arange(len(order))
        self.lcp = lcp
        """int64 [N] lcp[r] = LCP(order[r - 1], order[r]); lcp[0] = 0."""
        self._table = [lcp]
        span = 1
        while 2 * span <= len(lcp):
            previous = self._table[-1]
            self._table.append(np.minimum(previous[:-span], previous[span:]))
            span *= 2

    @classmethod
    def from_step(cls, step: Step) -> PrefixIndex:
        order, lcp = sort_with_lcp(step)
        return cls(step.lengths, order, lcp)

    def range_min(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """min(lcp[lo:hi]) elementwise, for lo < hi (vectorised sparse-table query)."""
        lo = np.asarray(lo, dtype=np.int64)
        hi = np.asarray(hi, dtype=np.int64)
        assert (lo < hi).all()
        level = np.floor(np.log2(hi - lo)).astype(np.int64)
        result = np.empty(lo.shape, dtype=np.int64)
        for k in np.unique(level):
            sel = level == k
            table = self._table[k]
            result[sel] = np.minimum(table[lo[sel]], table[hi[sel] - (1 << int(k))])
        return result

    def lcp_of(self, a: int, b: int) -> int:
        """LCP of trajectories a and b (batch indices)."""
        if a == b:
            return int(self.lengths[a])
        ra, rb = sorted((int(self.rank[a]), int(self.rank[b])))
        return int(self.range_min(np.array([ra + 1]), np.array([rb + 1]))[0])

    def sort_members(self, members: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(perm, lcp): members[perm] is lexicographically sorted, lcp its adjacent LCPs."""
        ranks = self.rank[np.asarray(members, dtype=np.int64)]
        perm = np.argsort(ranks, kind="stable")
        ranks = ranks[perm]
        lcp = np.zeros(len(ranks), dtype=np.int64)
        if len(ranks) > 1:
            lcp[1:] = self.range_min(ranks[:-1] + 1, ranks[1:] + 1)
        return perm, lcp

    def segment_tree(self, members: np.ndarray | None = None) -> SegmentTree:
        """The segment tree of `members` (default: the whole step, batch order)."""
        if members is None:
            members = np.arange(len(self.lengths), dtype=np.int64)
        members = np.asarray(members, dtype=np.int64)
        if len(np.unique(members)) != len(members):
            raise ValueError("segment_tree: members must be distinct trajectories")
        perm, lcp = self.sort_members(members)
        return SegmentTree.build(members, self.lengths[members], perm, lcp)


def _ancestor_sums(parent: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Σ of `weight` over each node and all its ancestors (pointer jumping, O(V log depth))."""
    total = weight.astype(np.int64).copy()
    jump = parent.copy()
    while True:
        live = np.flatnonzero(jump >= 0)
        if not len(live):
            return total
        target = jump[live]
        total[live] += total[target]
        jump[live] = jump[target]


@dataclass(frozen=True, eq=False)
class SegmentTree:
    """Compressed trie of a set of member trajectories, segments in DFS preorder."""

    members: np.ndarray
    """int64 [n] member trajectories (batch indices of the step), in the caller's order."""
    member_lengths: np.ndarray
    """int64 [n] tokens per member, caller's order."""
    sorted_position: np.ndarray
    """int64 [n] members[sorted_position] is the lexicographic order of the members."""
    parent: np.ndarray
    """int64 [V] parent segment, -1 for a root (several roots = several first tokens)."""
    start: np.ndarray
    """int64 [V] first path position of the segment."""
    end: np.ndarray
    """int64 [V] one past its last path position; children start there (the fork position)."""
    compact_start: np.ndarray
    """int64 [V] first compact row of the segment."""
    subtree_end: np.ndarray
    """int64 [V] descendants of v are the segments v + 1 .. subtree_end[v] - 1."""
    num_children: np.ndarray
    """int64 [V]."""
    end_segment: np.ndarray
    """int64 [n] the segment where each member ends, in sorted-member order."""

    @classmethod
    def build(
        cls, members: np.ndarray, member_lengths: np.ndarray, sorted_position: np.ndarray, lcp: np.ndarray
    ) -> SegmentTree:
        """From the members, their lengths, their lexicographic order and its adjacent LCPs."""
        sorted_lengths = member_lengths[sorted_position]
        num = len(sorted_lengths)
        parent: list[int] = []
        start: list[int] = []
        end: list[int] = []
        first_rank: list[int] = []
        end_segment = np.empty(num, dtype=np.int64)
        path: list[int] = []
        for r in range(num):
            length = int(sorted_lengths[r])
            shared = int(lcp[r]) if r else 0
            while path and start[path[-1]] >= shared:
                path.pop()
            if path and end[path[-1]] > shared:
                # Split the segment at the new fork: a new upper node, the old id keeps the lower
                # part so its children's parent pointers stay valid.
                lower = path[-1]
                upper = len(parent)
                parent.append(parent[lower])
                start.append(start[lower])
                end.append(shared)
                first_rank.append(first_rank[lower])
                parent[lower] = upper
                start[lower] = shared
                path[-1] = upper
            if length > shared:
                parent.append(path[-1] if path else -1)
                start.append(shared)
                end.append(length)
                first_rank.append(r)
                path.append(len(parent) - 1)
            end_segment[r] = path[-1]

        start_a = np.asarray(start, dtype=np.int64)
        preorder = np.lexsort((start_a, np.asarray(first_rank, dtype=np.int64)))
        new_id = np.empty(len(preorder), dtype=np.int64)
        new_id[preorder] = np.arange(len(preorder))
        old_parent = np.asarray(parent, dtype=np.int64)[preorder]
        parent_a = np.where(old_parent >= 0, new_id[np.maximum(old_parent, 0)], -1)
        start_a = start_a[preorder]
        end_a = np.asarray(end, dtype=np.int64)[preorder]
        lengths = end_a - start_a
        compact_start = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], out=compact_start[1:])
        num_children = np.bincount(parent_a[parent_a >= 0], minlength=len(parent_a)).astype(np.int64)
        return cls(
            members=np.asarray(members, dtype=np.int64),
            member_lengths=np.asarray(member_lengths, dtype=np.int64),
            sorted_position=np.asarray(sorted_position, dtype=np.int64),
            parent=parent_a,
            start=start_a,
            end=end_a,
            compact_start=compact_start,
            subtree_end=_subtree_end(parent_a),
            num_children=num_children,
            end_segment=new_id[end_segment],
        )

    @property
    def num_segments(self) -> int:
        return len(self.parent)

    @property
    def num_compact_tokens(self) -> int:
        return int((self.end - self.start).sum())

    @property
    def num_semantic_tokens(self) -> int:
        return int(self.member_lengths.sum())

    @property
    def segment_lengths(self) -> np.ndarray:
        return self.end - self.start

    def depth(self) -> np.ndarray:
        """int64 [V] number of proper ancestors of each segment."""
        return _ancestor_sums(self.parent, np.ones(self.num_segments, dtype=np.int64)) - 1

    def fork_depth(self) -> np.ndarray:
        """int64 [V] number of forks (ancestors with >= 2 children) strictly above each segment."""
        is_fork = self.num_children >= 2
        above = np.where(self.parent >= 0, is_fork[np.maximum(self.parent, 0)], False)
        return _ancestor_sums(self.parent, above.astype(np.int64))

    def member_range(self) -> tuple[np.ndarray, np.ndarray]:
        """[lo, hi) of sorted-member positions whose path runs through each segment."""
        lo = np.searchsorted(self.end_segment, np.arange(self.num_segments), side="left")
        hi = np.searchsorted(self.end_segment, self.subtree_end, side="left")
        return lo, hi

    def segment_multiplicity(self) -> np.ndarray:
        """int64 [V] number of members through each segment."""
        lo, hi = self.member_range()
        return hi - lo

    def multiplicity(self) -> np.ndarray:
        """int64 [C] q_c: semantic positions mapped to each compact row (Σ q = S)."""
        return np.repeat(self.segment_multiplicity(), self.segment_lengths)

    def compact_positions(self) -> np.ndarray:
        """int64 [C] the path position of each compact row."""
        return np.arange(self.num_compact_tokens, dtype=np.int64) - np.repeat(
            self.compact_start - self.start, self.segment_lengths
        )

    def compact_segment(self) -> np.ndarray:
        """int64 [C] the segment of each compact row."""
        return np.repeat(np.arange(self.num_segments, dtype=np.int64), self.segment_lengths)

    def member_paths(self) -> tuple[np.ndarray, np.ndarray]:
        """(member, segment) pairs of every member's path, sorted by member (caller order) then start."""
        owners, segments = [], []
        current = self.end_segment.copy()
        member = self.sorted_position
        while len(current):
            owners.append(member)
            segments.append(current)
            nxt = self.parent[current]
            keep = nxt >= 0
            current, member = nxt[keep], member[keep]
        owners_a = np.concatenate(owners)
        segments_a = np.concatenate(segments)
        order = np.lexsort((self.start[segments_a], owners_a))
        return owners_a[order], segments_a[order]

    def compact_map(self) -> np.ndarray:
        """int64 [S] m: semantic position -> compact row, members concatenated in caller order."""
        offsets = np.zeros(len(self.members) + 1, dtype=np.int64)
        np.cumsum(self.member_lengths, out=offsets[1:])
        compact_map = np.empty(int(offsets[-1]), dtype=np.int64)
        owners, segments = self.member_paths()
        lengths = self.segment_lengths[segments]
        destinations = offsets[owners] + self.start[segments]
        for dest, first, count in zip(destinations.tolist(), self.compact_start[segments].tolist(), lengths.tolist()):
            compact_map[dest : dest + count] = np.arange(first, first + count)
        return compact_map


def _subtree_end(parent: np.ndarray) -> np.ndarray:
    """Preorder subtree ends from parent pointers, accumulating sizes level by level upward."""
    num = len(parent)
    if num == 0:
        return np.zeros(0, dtype=np.int64)
    depth = _ancestor_sums(parent, np.ones(num, dtype=np.int64)) - 1
    size = np.ones(num, dtype=np.int64)
    by_depth = np.argsort(depth, kind="stable")
    bounds = np.searchsorted(depth[by_depth], np.arange(int(depth.max()) + 2))
    for level in range(int(depth.max()), 0, -1):
        nodes = by_depth[bounds[level] : bounds[level + 1]]
        np.add.at(size, parent[nodes], size[nodes])
    return np.arange(num, dtype=np.int64) + size
