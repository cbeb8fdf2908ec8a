"""Lower bounds that hold for every valid plan of a step: microbatch count K and total work W.

`plan_bounds(rw, capacity, dp) -> PlanBounds` proves, without search, that no plan (any set
partition, contiguous in sorted order or not) has fewer non-empty microbatches than
`num_microbatches` or less total compact work than `compact_tokens`. When a planner's W equals
the bound, its W is optimal and a search for lower W can stop.

Work for a count k (Σ over the N - 1 adjacent LCPs lcp[1:] of the sorted order):
    W >= C + Σ of the k - 1 smallest lcp[1:].
A plan with k non-empty microbatches has N - k "consecutive member" pairs (a, b), each sharing
LCP(a, b). For any depth d the trajectories sharing d tokens form contiguous groups of the
sorted order; a group of g members holds g - 1 adjacent LCPs >= d and at most g - 1 such pairs
of any plan. So at every depth the pairs' LCPs are dominated by the adjacent LCPs, Σ shared <=
the N - k largest lcp, and W = Σ len - Σ shared is at least the right-hand side, which grows
with k.

Count: the largest of three bounds, rounded up to a multiple of D when N >= D (K ≡ 0 mod D
without empty microbatches), then raised until W(k) <= k·T (volume):
- clique: trajectories x, y with len x + len y - LCP(x, y) > T never share a microbatch. One
  trajectory (the longest) per cluster, longest first, while the two shortest taken still
  conflict (trajectories of different clusters share exactly g0);
- clusters: g0 is the prefix every trajectory shares and a cluster is a maximal group sharing
  more (contiguous in sorted order). A microbatch's work is g0 + Σ over its clusters' parts of
  (trie(part) - g0), at most T. Cluster c whole adds m_c = trie(c) - g0; split, at least
  m_c + (its smallest internal lcp - g0). A "heavy" whole cluster (m_c + the smallest
  len - g0 of any trajectory > T - g0) is alone in its microbatch, so it uses T - g0 of room
  either way; hence k·(T - g0) >= Σ_light m_c + Σ_heavy min(split cost, T - g0), with a single
  trajectory never split.

Legend: N trajectories, C the trie size of the step, T capacity, D data-parallel replicas.
Tested against brute force over every set partition of small steps (bounds <= the optimum,
and tight on cases where the optimum needs cuts).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harts.planning.rank_work import RankWork


@dataclass(kw_only=True, frozen=True)
class PlanBounds:
    num_microbatches: int
    """No valid plan has fewer non-empty microbatches."""
    compact_tokens: int
    """No valid plan has less total compact work W."""


def plan_bounds(rw: RankWork, capacity: int, dp: int) -> PlanBounds:
    num = rw.num
    smallest_lcp = np.concatenate([[0], np.cumsum(np.sort(rw.lcp_adjacent[1:]))])
    compact = rw.run_cost(0, num)
    count = max(1, _clique_count(rw, capacity), _cluster_count(rw, capacity))
    step = dp if num >= dp else 1
    count = -(-count // step) * step
    while count <= num and compact + int(smallest_lcp[count - 1]) > count * capacity:
        count += step
    if count > num:
        # No valid plan exists (the planners raise); W of the fewest runs is still a bound.
        count = num
    return PlanBounds(num_microbatches=count, compact_tokens=compact + int(smallest_lcp[count - 1]))


def _clusters(rw: RankWork) -> np.ndarray:
    """Start ranks of the clusters, with N appended."""
    g0 = rw.common_prefix
    inner = np.flatnonzero(rw.lcp_adjacent[1:] == g0) + 1
    return np.concatenate([[0], inner, [rw.num]])


def _clique_count(rw: RankWork, capacity: int) -> int:
    bounds = _clusters(rw)
    longest = np.sort(np.maximum.reduceat(rw.L, bounds[:-1]))[::-1]
    # Taken longest first, the set conflicts pairwise iff its two shortest members do.
    pairs = longest[:-1] + longest[1:] - rw.common_prefix > capacity
    return 1 + int(np.argmin(pairs)) if not pairs.all() else len(longest)


def _cluster_count(rw: RankWork, capacity: int) -> int:
    g0 = rw.common_prefix
    room = capacity - g0
    if room <= 0:
        return 1
    bounds = _clusters(rw)
    starts, ends = bounds[:-1], bounds[1:]
    mass = (rw.cum_len[ends] - rw.cum_len[starts]) - (rw.cum_lcp[ends] - rw.cum_lcp[starts + 1]) - g0
    smallest_piece = int(rw.L.min()) - g0
    heavy = mass + smallest_piece > room
    inner = rw.lcp_adjacent.copy()
    inner[starts] = np.iinfo(np.int64).max
    # Single-trajectory clusters keep the sentinel: they cannot be split.
    cheapest_cut = np.minimum.reduceat(inner, starts)
    split = np.where(cheapest_cut < np.iinfo(np.int64).max, mass + cheapest_cut - g0, room)
    need = int(mass[~heavy].sum()) + int(np.minimum(split[heavy], room).sum())
    return -(-need // room)
