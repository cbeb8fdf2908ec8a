"""The HARTS planner's cluster-packing tier (`whole_cluster_plan`, with `HartsConfig.refine` and `pack_clusters`).

Clusters are the maximal runs of the sorted order sharing more than g0, the prefix of the whole step (RL steps:
one per task tree, under the shared system prompt). Whole clusters in K microbatches cost exactly
W = C + (K - 1)·g0, the least W of any plan with K or more microbatches (bound of `harts.planning.bounds`); a
cluster split over several microbatches adds, per extra microbatch, the prefix its parts then repeat (a task prompt
when a GRPO group of samples is split at its root fork). `whole_cluster_plan` builds two packings and keeps the
better: (a) clusters larger than T cut into their cheapest contiguous runs (`harts_search.cheapest_pieces`), K from
the first-fit-decreasing count rounded up to D, lowered by D while splitting a few clusters at their cheapest cuts
costs less than the D·g0 it saves (`_fewer_microbatches`); (b) the fragment packing of
`harts.planning.fragment_packing` (trees whole by best fit, a tree that fits no microbatch spread as root-level
subtrees over the roomiest ones) at a few counts from the bound's up. The search is then for the critical path:
each packing and its best-fit or least-loaded restart is balanced by the priced moves and swaps of
`harts.planning.cluster_packing.balance` (pieces of one cluster never share a microbatch, so works stay additive),
the best kept. Tested in tests/planning/test_harts_planner.py (W = C + (K - 1)·g0 with whole trees, a tree larger
than T split at its root fork, never more W than the OR-Tools planner).
"""

from __future__ import annotations

import numpy as np

from harts.planning import cluster_packing
from harts.planning.bounds import plan_bounds
from harts.planning.fragment_packing import FragmentPacker
from harts.planning.harts_search import HartsConfig, cheapest_pieces
from harts.planning.plans import objective
from harts.planning.rank_work import RankWork

def whole_cluster_plan(rw: RankWork, capacity: int, dp: int,
                       config: HartsConfig) -> tuple[list[list[int]], np.ndarray, int] | None:
    """(bins, works, clusters split): clusters packed into few multiple-of-D microbatches, split only
    where they fit no microbatch whole, balanced; None when no packing is found. With no cluster split
    W = C + (K - 1)·g0; each split adds the prefix it repeats.

    Two packings, each balanced by `cluster_packing.balance` (pieces of one cluster never share a
    microbatch, so works stay additive), the lowest objective kept:
    - contiguous pieces: clusters larger than T cut into their cheapest runs (`cheapest_pieces`); K
      starts at the first-fit-decreasing count rounded up to D and drops by D while
      `_fewer_microbatches` finds K - D microbatches whose splits cost less than the D·g0 they save;
      starts: that packing, best-fit decreasing and least-loaded placement;
    - fragments: `fragment_packing.FragmentPacker.best` from the plan bound's count up (the lowest W of
      several counts and cluster orders), which splits a tree into its root-level subtrees
      over the roomiest microbatches only when it fits none whole; starts: that packing and
      least-loaded placement of its pieces.
    """
    g0 = rw.common_prefix
    starts = np.concatenate([[0], np.flatnonzero(rw.lcp_adjacent[1:] == g0) + 1]).astype(np.int64)
    ends = np.concatenate([starts[1:], [rw.num]])
    room = capacity - g0
    pieces = []
    for cluster, (a, b) in enumerate(zip(starts.tolist(), ends.tolist())):
        pieces += [(lo, hi, cluster) for lo, hi in cheapest_pieces(rw, a, b, capacity)]
    runs = np.asarray([(a, b) for a, b, _ in pieces], dtype=np.int64)
    sizes = rw.run_costs(runs[:, 0], runs[:, 1]) - g0
    count = -(-cluster_packing.first_fit_count(sizes, room) // dp) * dp
    repacked = None
    while count > dp:
        fewer = _fewer_microbatches(rw, pieces, count - dp, room, max_extra=dp * g0)
        if fewer is None:
            break
        pieces, repacked = fewer
        count -= dp
    best = None
    while best is None and count <= len(pieces):
        contiguous = [(list(range(a, b)), cluster) for a, b, cluster in pieces]
        best = _balanced(rw, contiguous, count, dp, capacity, config, repacked, best_fit=True)
        # Pieces of one cluster never share a microbatch: the first-fit count may not hold them.
        count += 0 if best is not None else dp
        repacked = None
    clusters = [list(range(a, b)) for a, b in zip(starts.tolist(), ends.tolist())]
    first = -(-plan_bounds(rw, capacity, dp).num_microbatches // dp) * dp
    fragments = FragmentPacker(rw, clusters, capacity).best(first, dp, num_counts=config.fragment_counts,
                                                            num_orders=config.fragment_orders)
    if fragments is not None:
        owned = [(group, k) for k, members in enumerate(fragments) for group in rw.clusters(members)]
        cluster_of = np.searchsorted(starts, [group[0] for group, _ in owned], side="right") - 1
        packed = _balanced(rw, [(group, int(c)) for (group, _), c in zip(owned, cluster_of)], len(fragments), dp,
                           capacity, config, np.asarray([k for _, k in owned], dtype=np.int64), best_fit=False)
        if packed is not None and (best is None or packed[0] < best[0]):
            best = packed
    if best is None:
        return None
    _, bins, works, num_pieces = best
    return bins, works, num_pieces - len(starts)


def _balanced(rw: RankWork, pieces: list[tuple[list[int], int]], count: int, dp: int, capacity: int,
              config: HartsConfig, start: np.ndarray | None, *, best_fit: bool):
    """(objective, bins, works, pieces) of the best balanced packing of `pieces` ((ranks, cluster))
    into `count` microbatches from `start` (a bin per piece, or None), best-fit decreasing (with
    `best_fit`) and least-loaded placement; None if no start fits."""
    g0 = rw.common_prefix
    sizes = np.asarray([rw.trie(ranks) - g0 for ranks, _ in pieces], dtype=np.int64)
    clusters = np.asarray([cluster for _, cluster in pieces], dtype=np.int64)
    groups = clusters if len(np.unique(clusters)) < len(pieces) else None
    room = capacity - g0
    best = None
    for bin_of in (start, cluster_packing.pack_best_fit(sizes, room, count, groups) if best_fit else None,
                   cluster_packing.pack_least_loaded(sizes, room, count, groups)):
        if bin_of is None:
            continue
        bin_of = cluster_packing.balance(sizes, bin_of, count, dp, base=g0, capacity=capacity, groups=groups,
                                         max_rounds=config.balance_rounds, batch=config.balance_batch)
        works = g0 + np.bincount(bin_of, weights=sizes, minlength=count).astype(np.int64)
        key = objective(works, dp)
        if best is None or key < best[0]:
            best = (key, bin_of, works)
    if best is None:
        return None
    key, bin_of, works = best
    bins: list[list[int]] = [[] for _ in range(count)]
    for (ranks, _), k in zip(pieces, bin_of.tolist()):
        bins[k].extend(ranks)
    return key, [sorted(b) for b in bins], works, len(pieces)


def _fewer_microbatches(rw: RankWork, pieces: list[tuple[int, int, int]], count: int, room: int, *,
                        max_extra: int) -> tuple[list[tuple[int, int, int]], np.ndarray] | None:
    """Pieces (rank ranges [a, b) with their cluster) in `count` microbatches, splitting the ones
    that do not fit for less than `max_extra` extra work in all; (pieces, bin of each) or None.

    Best-fit decreasing places what fits; each leftover, largest first, is cut into two or
    three pieces at the cheapest cuts (a cut at rank c costs lcp[c] - g0, the prefix its two
    sides no longer share) whose parts fit, best fit, in distinct microbatches holding nothing
    of its cluster.
    """
    g0 = rw.common_prefix
    runs = np.asarray([(a, b) for a, b, _ in pieces], dtype=np.int64)
    sizes = (rw.run_costs(runs[:, 0], runs[:, 1]) - g0).tolist()
    fit = cluster_packing.BestFit(count)
    holds = np.zeros((max(c for *_, c in pieces) + 1, count), dtype=bool)
    placed: list[tuple[int, int, int, int]] = []
    leftovers = []
    # Every leftover needs a cut: give up as soon as the shallowest cuts already cost too much.
    floor = 0
    for i in sorted(range(len(pieces)), key=lambda i: (-sizes[i], i)):
        a, b, cluster = pieces[i]
        k = fit.find(room - sizes[i], holds[cluster])
        if k < 0:
            leftovers.append(pieces[i])
            floor += int(rw.lcp_adjacent[a + 1 : b].min(initial=np.iinfo(np.int64).max // 4)) - g0
            if floor >= max_extra:
                return None
            continue
        fit.add(k, sizes[i])
        holds[cluster, k] = True
        placed.append((a, b, cluster, k))
    loads = np.asarray(fit.loads, dtype=np.int64)
    extra = 0
    for a, b, cluster in leftovers:
        split = _cheapest_split(rw, a, b, loads, holds[cluster], room)
        if split is None:
            return None
        cost, parts = split
        extra += cost
        if extra >= max_extra:
            return None
        for lo, hi, k in parts:
            loads[k] += rw.run_cost(lo, hi) - g0
            holds[cluster, k] = True
            placed.append((lo, hi, cluster, k))
    if not holds.any(axis=0).all():
        return None
    placed.sort()
    return [(a, b, c) for a, b, c, _ in placed], np.asarray([k for *_, k in placed], dtype=np.int64)


def _best_fit(loads: np.ndarray, blocked: np.ndarray, room: int, size: int) -> int:
    """The fullest microbatch (ties: lowest) with room for `size` and not `blocked`; -1 if none."""
    fullest = np.where((loads <= room - size) & ~blocked, loads, -1)
    k = int(np.argmax(fullest))
    return k if fullest[k] >= 0 else -1


def _cheapest_split(rw: RankWork, a: int, b: int, loads: np.ndarray, blocked: np.ndarray, room: int,
                    max_cuts: int = 16) -> tuple[int, list[tuple[int, int, int]]] | None:
    """(cost, [(lo, hi, microbatch)]): ranks [a, b) cut once or twice, among its `max_cuts`
    shallowest cuts, at the least cost whose parts fit in distinct microbatches not `blocked`
    (largest part placed first, best fit); None if no such cut exists."""
    g0 = rw.common_prefix
    depth = rw.lcp_adjacent
    cuts = sorted((a + 1 + np.argsort(depth[a + 1 : b], kind="stable")[:max_cuts]).tolist())
    options = [(c,) for c in cuts] + [(c, d) for i, c in enumerate(cuts) for d in cuts[i + 1:]]
    for option in sorted(options, key=lambda o: (sum(int(depth[c]) for c in o), o)):
        bounds = (a, *option, b)
        parts = sorted(((rw.run_cost(lo, hi) - g0, lo, hi) for lo, hi in zip(bounds, bounds[1:])), reverse=True)
        taken = blocked.copy()
        chosen: list[tuple[int, int, int]] = []
        for size, lo, hi in parts:
            k = _best_fit(loads, taken, room, size)
            if k < 0:
                break
            taken[k] = True
            chosen.append((lo, hi, k))
        else:
            # Options come cheapest first: the first that fits is the cheapest.
            return sum(int(depth[c]) - g0 for c in option), chosen
    return None
