"""Task trees into a fixed number of microbatches, splitting a tree only where it fits nowhere whole.

A cluster is a maximal run of the sorted order sharing more than g0, the prefix of the whole step
(an RL step's task tree under the shared system prompt). A microbatch of whole clusters has work
g0 + Σ (trie(c) - g0); a cluster too large for any microbatch's free room is split into parts
(its root-level subtrees: the groups of its trajectories that agree beyond the cluster's own
prefix, split again while larger than T), and each microbatch it spans pays the cluster's prefix
once more. So for a count K the work is W = C + (K - 1)·g0 + Σ over the extra microbatches a
cluster spans of the prefix the split repeats (its root fork depth minus g0, or deeper where a
subtree alone exceeds T).

`FragmentPacker(rw, clusters, capacity).pack(count)`: clusters by decreasing size, each whole to
the fullest microbatch it fits (best fit) or, fitting none, its parts by decreasing size into the
roomiest microbatches one at a time (each microbatch taking the parts it still fits, the tree's
prefix counted once there); microbatches left empty take the smallest whole cluster of a
microbatch holding several (W unchanged), or else a subtree split off the largest piece. None
when some part fits nowhere. Unlike bin packing of
whole trees this reaches the volume bound's count when trees exceed T or leave gaps (a split costs a
task prompt, a microbatch the system prompt), and unlike a contiguous cut of the sorted order it
pairs a tree's tail with any other tree. Deterministic (ties: lowest rank, lowest microbatch).

`tree_parts` gives the parts (`RankWork.root_subtrees`, recursively). Legend: K microbatches (`count`), T capacity.
Tested in tests/planning/test_fragment_packing.py: coverage, capacity, the work formula above
against the trie of every microbatch, and the count reached on hand-built trees.
"""

from __future__ import annotations

import numpy as np

from harts.planning.cluster_packing import BestFit
from harts.planning.rank_work import RankWork

# A microbatch a split tree already spans: never its roomiest for another part of that tree.
_SPANNED = np.iinfo(np.int64).max


def tree_parts(rw: RankWork, ranks: list[int], capacity: int) -> list[list[int]]:
    """The root-level subtrees of a cluster, each split the same way again while its trie exceeds T
    (a single trajectory always fits: longer ones are refused before planning)."""
    if len(ranks) == 1:
        return [ranks]
    parts = []
    pending = rw.root_subtrees(ranks)[::-1]
    while pending:
        part = pending.pop()
        if rw.trie(part) <= capacity:
            parts.append(part)
        else:
            pending.extend(rw.root_subtrees(part)[::-1])
    return parts


class FragmentPacker:
    """`pack(count)` for several counts of one step's clusters (their sizes and parts computed once)."""

    def __init__(self, rw: RankWork, clusters: list[list[int]], capacity: int) -> None:
        self.rw = rw
        self.clusters = clusters
        self.capacity = capacity
        self.sizes = [rw.trie(c) - rw.common_prefix for c in clusters]
        self.order = sorted(range(len(clusters)), key=lambda c: (-self.sizes[c], clusters[c][0]))
        self._parts: dict[int, list[list[int]]] = {}

    def parts(self, c: int) -> list[list[int]]:
        """Cluster c's parts (`tree_parts`), largest first."""
        if c not in self._parts:
            parts = tree_parts(self.rw, self.clusters[c], self.capacity)
            self._parts[c] = sorted(parts, key=lambda p: (-self.rw.trie(p), p[0]))
        return self._parts[c]

    def orders(self, num: int) -> list[list[int]]:
        """`num` cluster orders for `pack`: decreasing size; the clusters that fit T first (then the
        larger ones fill the gaps with their parts, which are smaller than whole trees); then
        decreasing size × a log-normal factor (σ = 0.3, seeded by the order's index), so that
        close sizes trade places. Greedy packing is sensitive to the order; the caller keeps the
        best of several. Deterministic."""
        room = self.capacity - self.rw.common_prefix
        orders = [self.order, [c for c in self.order if self.sizes[c] <= room]
                  + [c for c in self.order if self.sizes[c] > room]]
        for seed in range(num - 2):
            noise = np.random.default_rng([seed, len(self.clusters)]).lognormal(0.0, 0.3, len(self.clusters))
            orders.append(sorted(self.order, key=lambda c: -self.sizes[c] * noise[c]))
        return orders[:num]

    def best(self, first_count: int, step: int, *, num_counts: int, num_orders: int) -> list[list[int]] | None:
        """The lowest-W packing found: counts rise by `step` from `first_count` until the two plain
        orders pack (count c); then every order of `orders(num_orders)` at c - step (greedy order
        matters most at the smallest count) and c, and the plain orders at `num_counts` - 1 counts
        above c (W is not monotone in the count: a microbatch more can spare several splits). None if
        no count up to one microbatch per trajectory packs."""
        orders = self.orders(num_orders)
        count = first_count
        found: list[tuple[int, int, list[list[int]]]] = []

        def attempt(count: int, orders: list[list[int]]) -> None:
            for order in orders:
                bins = self.pack(count, order)
                if bins is not None:
                    found.append((sum(self.rw.trie(b) for b in bins), count, bins))

        while not found and count <= self.rw.num:
            attempt(count, orders[:2])
            count += step
        if not found:
            return None
        count -= step
        if count - step >= first_count:
            attempt(count - step, orders)
        attempt(count, orders[2:])
        for extra in range(1, num_counts):
            attempt(count + extra * step, orders[:2])
        return min(found, key=lambda entry: entry[:2])[2]

    def pack(self, count: int, order: list[int] | None = None) -> list[list[int]] | None:
        """`count` non-empty microbatches (sorted rank lists) holding every cluster, placed in `order`
        (default: decreasing size; module docstring); None when the greedy finds no room for some
        part, or no microbatch can give an empty one a cluster or part."""
        return _pack(self, count, self.order if order is None else order)


def _pack(packer: FragmentPacker, count: int, order: list[int]) -> list[list[int]] | None:
    rw = packer.rw
    g0 = rw.common_prefix
    room = packer.capacity - g0
    fit = BestFit(count)
    bins: list[list[int]] = [[] for _ in range(count)]
    sizes = packer.sizes
    for c in order:
        k = fit.find(room - sizes[c])
        if k >= 0:
            bins[k] += packer.clusters[c]
            fit.add(k, sizes[c])
            continue
        parts = packer.parts(c)
        loads = np.asarray(fit.loads, dtype=np.int64)
        while parts:
            k = int(np.argmin(loads))
            if loads[k] == _SPANNED:
                return None
            taken: list[int] = []
            rest = []
            for part in parts:
                trial = sorted(taken + part)
                if loads[k] + rw.trie(trial) - g0 <= room:
                    taken = trial
                else:
                    rest.append(part)
            if not taken:
                return None
            bins[k] += taken
            fit.add(k, rw.trie(taken) - g0)
            loads[k] = _SPANNED
            parts = rest
    return _fill_empty(rw, [sorted(b) for b in bins])


def _fill_empty(rw: RankWork, bins: list[list[int]]) -> list[list[int]] | None:
    """Each empty microbatch takes the smallest whole cluster (or piece of a split one) of a microbatch
    holding several, W unchanged; failing that, the smallest root-level subtree of the largest piece
    that has several, which repeats that piece's prefix."""
    empty = [k for k, members in enumerate(bins) if not members]
    if not empty:
        return bins
    groups = [rw.clusters(members) for members in bins]
    for k in empty:
        donors = [(rw.trie(group), group[0], j, group) for j, held in enumerate(groups) if len(held) >= 2
                  for group in held]
        if not donors:
            splittable = [(rw.trie(group), -group[0], j, group) for j, held in enumerate(groups) for group in held
                          if len(group) >= 2]
            if not splittable:
                return None
            _, _, j, group = max(splittable)
            subtrees = rw.root_subtrees(group)
            taken = min(subtrees, key=lambda sub: (rw.trie(sub), sub[0]))
            kept = sorted(set(group) - set(taken))
            groups[j] = [g if g is not group else kept for g in groups[j]]
        else:
            _, _, j, taken = min(donors, key=lambda donor: donor[:2])
            groups[j] = [g for g in groups[j] if g is not taken]
        groups[k] = [taken]
    return [sorted(r for group in held for r in group) for held in groups]
