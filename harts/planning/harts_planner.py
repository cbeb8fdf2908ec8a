"""The HARTS microbatch planner: cut-point DP over the sorted order, refinement, greedy replicas.

`plan_harts(step, capacity, dp, ...) -> Plan` minimises the lexicographic objective of
`harts.planning.plans.objective`: total compact work W, then the slot critical path, then
the largest replica cumulative work. Deterministic: no clocks, no randomness in the search.

Formulation. Sort the N trajectories lexicographically (ranks r); L[r] is a length and
lcp[r] = LCP(r - 1, r). A microbatch's work is the trie size of its members, Σ L - Σ LCP of
consecutive members in rank order, so W = C + Σ (sharing lost): for a partition into
contiguous runs W = C + Σ_{cuts c} lcp[c] — a cut at a shallow fork (an LCP valley) loses the
least. A run i..j-1 costs (Σ L - Σ lcp)[i..j) in O(1) from prefix sums, and the LCP of any two
ranks is a range minimum (sparse table), which prices non-contiguous microbatches too.

Search tiers, by size:
1. "exact" (N <= `exact_max_trajectories`): branch and bound over all set partitions of the
   ranks (restricted-growth assignment in rank order, capacity and W-bound pruning), scoring
   complete partitions with the full objective. Optimal; tested against brute force.
2. "cluster-packing" (refinement on): clusters are the maximal runs of the sorted order sharing
   more than g0, the prefix of the whole step (RL steps: one per task tree, under the shared
   system prompt). Whole clusters in K microbatches cost exactly W = C + (K - 1)·g0, the least W
   of any plan with K or more microbatches (bound of `harts.planning.bounds`); a cluster split
   over several microbatches adds, per extra microbatch, the prefix its parts then repeat (a task
   prompt when a GRPO group of samples is split at its root fork). `whole_cluster_plan` builds two
   packings and keeps the better: (a) clusters larger than T cut into their cheapest contiguous
   runs, K from the first-fit-decreasing count rounded up to D, lowered by D while splitting a
   few clusters at their cheapest cuts costs less than the D·g0 it saves; (b) the fragment
   packing of `harts.planning.fragment_packing` (trees whole by best fit, a tree that fits no
   microbatch spread as root-level subtrees over the roomiest ones) at a few counts from the
   bound's up. The search is then for the critical path: each packing and its best-fit or
   least-loaded restart is balanced by the priced moves and swaps of
   `harts.planning.cluster_packing.balance` (pieces of one cluster never share a microbatch, so
   works stay additive), the best kept. A trajectory-level move out of a cluster raises W by at
   least its cut cost, so the trajectory-level refinement below runs on this plan only when some
   cluster cuts for less than `refine_packed_split_ratio`·g0 ("cluster-packing+refine").
3. "dp" (DP over cut points): f[k][j] = min W of the first j ranks in k contiguous runs, each
   <= T: f[k][j] = min_{lo(j) <= i < j} f[k-1][i] + cost(i, j), where lo(j) is the first start
   whose run fits (monotone, found by binary search on prefix sums). Counts k run upward until
   the bound C + (k - 1 smallest adjacent LCPs) exceeds the best W found at a multiple of D;
   every k ≡ 0 mod D reaching that W is rebuilt and scored by the full objective. Exact among
   contiguous partitions (tested against enumeration of all cut sets). With a cluster-packing
   plan it runs only on steps of at most `dp_with_packing_max_trajectories` (see the field).
4. "restricted-dp" (when N² · window, the full table's cells, exceeds `dp_max_cells`): the same
   recursion keeping, for each prefix j, only counts within `count_band` of the fewest runs
   that can cover it.
The plan with the smallest objective among the tiers that ran is returned (`details["tier"]`).

Refinement of the DP plan (tiers 3 and 4), each change accepted only when it lowers the objective it targets:
- boundary moves and sparse repair: move one trajectory to the microbatch of one of its sorted
  neighbours (crossing a cut) or to one of the microbatches with the most room (pairing
  leftovers of different trees, which share only the common prefix), or swap it with a sorted
  neighbour in another microbatch, whenever W drops;
- elimination: empty a whole microbatch when its members fit elsewhere (each may push one
  member of its new microbatch on to a third: an ejection chain of length one) for less than
  the microbatch's work, which saves at least the common prefix;
- K mod D: moves and eliminations run with K free; K is then brought back to a multiple of D
  by the cheapest splits (cost = the LCP at the split), by repacking clusters (below), or by the
  best state met with K ≡ 0 mod D, whichever has the lowest W; afterwards moves run with K
  fixed, alternating with further free rounds while W keeps dropping;
- repacking: "clusters" are the maximal groups of a microbatch's members that share more than
  the common prefix g0; a cluster costs the same in any microbatch without its tree, so whole
  clusters are repacked into the fewest multiple-of-D microbatches (first-fit-decreasing
  count), largest first onto the least-loaded;
- balance: moves of trajectories that do not raise W and moves or swaps of whole clusters out
  of each slot's heaviest microbatch whenever the (W, critical path, largest replica) key drops.
The refined plan replaces the DP plan only if its objective is no worse. When the DP's W already
equals the lower bound of `harts.planning.bounds.plan_bounds` (no plan of any shape has less W),
the W-lowering stages cannot change anything and are skipped: only balancing runs (the result is
the same as the full refinement's; tested). `details["work_gap_to_bound"]` reports the final W
minus that bound (0: W proven optimal).

Replicas: the greedy assignment of `greedy_assignment` (sort by work, D per slot, heaviest to the
least-loaded replica).
"""

from __future__ import annotations

import bisect
import heapq
import time
from dataclasses import dataclass, fields, replace

import numpy as np

from harts.planning import cluster_packing
from harts.planning.bounds import plan_bounds
from harts.planning.fragment_packing import FragmentPacker
from harts.planning.plans import Plan, build_plan, objective
from harts.planning.rank_work import RankWork, no_plan_error, pad_to_dp, split_to_multiple
from harts.trees.step import Step
from harts.trees.trie import PrefixIndex

_INF = np.int64(1) << 61


@dataclass(kw_only=True)
class HartsConfig:
    exact_max_trajectories: int = 8
    """Steps with at most this many trajectories are solved by exhaustive branch and bound."""
    dp_max_cells: int = 100_000_000
    """Above N² · window cells (N prefixes × N counts × window starts) the DP keeps a band of counts."""
    count_band: int = 64
    """Restricted tier: counts kept per prefix beyond the fewest runs that cover it (>= D)."""
    refine: bool = True
    """Search beyond the DP: the cluster packing, and the moves, swaps and balancing after the DP."""
    pack_clusters: bool = True
    """Try the cluster-packing tier (with `refine`)."""
    refine_packed_split_ratio: float = 0.5
    """Refine a cluster-packing plan at trajectory level when some cluster can be cut for less
    than this fraction of g0: cuts that cheap can pay for the microbatches they empty (the
    paper's trees cut for >= 0.83·g0, and the trajectory-level search gained nothing there in
    0.3-0.9 s per step)."""
    refine_packed_max_trajectories: int = 4000
    """...and only on steps of at most this many trajectories: on the `paper-4x` step (9,431 trajectories)
    the refinement took 3.5 of the plan's 4.3 s on 2 cores and left W unchanged (30,781,717 tokens; on an
    earlier 4× step it saved 0.05%); on the ten `paper` steps (2,400-2,600 trajectories) it lowered W on
    two, by 0.02% and 0.08%."""
    neighbor_window: int = 12
    """Boundary moves and swaps look this many ranks either side of a trajectory."""
    room_candidates: int = 16
    """Sparse repair also tries the microbatches with the most free capacity."""
    max_passes: int = 30
    """Passes of moves over all trajectories (each pass stops early when nothing improves)."""
    eliminate_max_members: int = 8
    """Microbatches with more members are not candidates for elimination."""
    max_balance_moves: int = 2000
    """Upper bound on accepted balancing changes."""
    stop_at_bound: bool = True
    """Skip the W-lowering refinement when the DP's W equals the plan lower bound (only balancing runs)."""
    dp_with_packing_max_trajectories: int = 1000
    """With a cluster-packing plan, the DP tier (and its refinement) runs too only on steps of at most
    this many trajectories, where it is cheap. Above, the packing alone: on paper-sized steps (1,250 to
    9,200 trajectories, trees within T or beyond it) it had the lower W on every step, and the DP
    with its refinement took 0.5-8 s; on small random steps the refined DP, which is not contiguous,
    is sometimes better (tests/planning/test_harts_planner.py)."""
    fragment_counts: int = 4
    fragment_orders: int = 16
    """Fragment packing (`FragmentPacker.best`): counts tried above the smallest that packs, and cluster
    orders tried at the smallest counts."""
    balance_rounds: int = 100
    """Cluster packing: most rounds of priced moves and swaps per start (a round that takes nothing ends it)."""
    balance_batch: int = 512
    """Cluster packing: best priced candidates tried per round, each checked against the exact critical path.
    At 128 the last slot of `paper` step 7 kept 2.17% imbalance (P95 over the step's 17 slots); at 512 the ten
    `paper` steps' P95 is 0.64-1.90% with the same W on every step and the same plan time (0.4-0.8 s)."""

    def __post_init__(self) -> None:
        if self.exact_max_trajectories < 0 or self.neighbor_window < 1 or self.room_candidates < 0:
            raise ValueError("exact_max_trajectories >= 0, neighbor_window >= 1, room_candidates >= 0")
        if min(self.count_band, self.balance_batch) < 1 or min(self.max_passes, self.max_balance_moves,
                                                                 self.balance_rounds) < 0:
            raise ValueError("count_band >= 1, balance_batch >= 1, max_passes >= 0, max_balance_moves >= 0, "
                             "balance_rounds >= 0")


def plan_harts(step: Step, capacity: int, dp: int, *, index: PrefixIndex | None = None,
               config: HartsConfig | None = None, **options) -> Plan:
    """The HARTS plan of `step` (`options` override `HartsConfig` fields)."""
    started = time.perf_counter()
    config = _configure(config, options)
    index = index or PrefixIndex.from_step(step)
    rw = RankWork(index)
    details: dict[str, object] = {}
    bound = plan_bounds(rw, capacity, dp).compact_tokens
    if rw.num <= config.exact_max_trajectories:
        bins = exact_partition(rw, capacity, dp)
        works = np.asarray([rw.trie(b) for b in bins], dtype=np.int64)
        details["tier"] = "exact"
    else:
        refining = config.refine and rw.num >= dp
        # (objective, tier, bins, works) of each candidate plan; the smallest objective wins.
        candidates: list[tuple[tuple[int, int, int], str, list[list[int]], np.ndarray]] = []
        packed = whole_cluster_plan(rw, capacity, dp, config) if refining and config.pack_clusters else None
        if packed is not None:
            details["clusters_split"] = packed[2]
            candidates.append((objective(packed[1], dp), "cluster-packing", packed[0], packed[1]))
            if rw.num <= config.refine_packed_max_trajectories and _cheap_split(rw, config.refine_packed_split_ratio):
                refined = refine(rw, packed[0], capacity, dp, config)
                refined_works = np.asarray([rw.trie(b) for b in refined], dtype=np.int64)
                candidates.append((objective(refined_works, dp), "cluster-packing+refine", refined, refined_works))
        if packed is None or rw.num <= config.dp_with_packing_max_trajectories:
            band = None
            if rw.num * _window(rw, capacity) * rw.num > config.dp_max_cells:
                band = max(config.count_band, dp)
            cut = cut_point_dp(rw, capacity, dp, band=band)
            details["dp_compact_tokens"] = sum(rw.trie(b) for b in cut)
            if refining:
                optimal = config.stop_at_bound and details["dp_compact_tokens"] == bound
                cut = refine(rw, cut, capacity, dp, config, work_optimal=optimal)
            cut_works = np.asarray([rw.trie(b) for b in cut], dtype=np.int64)
            candidates.append((objective(cut_works, dp), "dp" if band is None else "restricted-dp", cut, cut_works))
        _, details["tier"], bins, works = min(candidates, key=lambda candidate: candidate[0])
    details["work_gap_to_bound"] = int(works.sum()) - bound
    groups = [rw.order[np.asarray(b, dtype=np.int64)] for b in bins]
    return build_plan(step, groups, works, planner="harts", capacity=capacity, dp=dp,
                      started=started, details=details)


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


def cheapest_pieces(rw: RankWork, a: int, b: int, capacity: int) -> list[tuple[int, int]]:
    """Ranks [a, b) as contiguous runs [lo, hi) of at most `capacity` compact tokens each, at the least
    total work (the run's trie plus the LCP at every cut: cuts fall at shallow forks); [(a, b)] when
    the whole run fits. f[j] = min over fitting starts i of f[i] + run_cost(i, j), the starts that
    fit being a suffix of [a, j)."""
    if rw.run_cost(a, b) <= capacity:
        return [(a, b)]
    lo = _run_starts(rw, capacity)
    best = [0] + [int(_INF)] * (b - a)
    start = [a] * (b - a + 1)
    for j in range(a + 1, b + 1):
        for i in range(max(int(lo[j]), a), j):
            cost = best[i - a] + rw.run_cost(i, j)
            if cost < best[j - a]:
                best[j - a], start[j - a] = cost, i
    runs = []
    j = b
    while j > a:
        runs.append((start[j - a], j))
        j = start[j - a]
    return runs[::-1]


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


def _cheap_split(rw: RankWork, ratio: float) -> bool:
    """Whether some cluster can be cut for less than `ratio`·g0 (a cut at rank c costs lcp[c] - g0)."""
    inner = rw.lcp_adjacent[1:][rw.lcp_adjacent[1:] > rw.common_prefix]
    return len(inner) > 0 and int(inner.min()) - rw.common_prefix < ratio * rw.common_prefix


def _configure(config: HartsConfig | None, options: dict) -> HartsConfig:
    config = config or HartsConfig()
    names = {f.name for f in fields(HartsConfig)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise ValueError(f"harts planner: unknown option '{unknown[0]}' (allowed: {', '.join(sorted(names))})")
    return replace(config, **options) if options else config


def _key(rw: RankWork, bins: list[list[int]], dp: int) -> tuple[int, int, int]:
    return objective(np.asarray([rw.trie(b) for b in bins], dtype=np.int64), dp)


def exact_partition(rw: RankWork, capacity: int, dp: int) -> list[list[int]]:
    """Optimal partition (full objective) by branch and bound over all set partitions."""
    num = rw.num
    lengths = rw.lengths_list
    # Adding rank r after every smaller rank costs at least L[r] - lcp[r] (its best predecessor).
    floor = [lengths[r] - (int(rw.lcp_adjacent[r]) if r else 0) for r in range(num)]
    remaining = [0] * (num + 1)
    for r in range(num - 1, -1, -1):
        remaining[r] = remaining[r + 1] + floor[r]
    best: list = [None, None]
    bins: list[list[int]] = []
    works: list[int] = []

    def finish() -> None:
        count = len(bins) if num >= dp else dp
        if num >= dp and count % dp:
            return
        padded = works + [0] * (count - len(works))
        key = objective(np.asarray(padded, dtype=np.int64), dp)
        if best[0] is None or key < best[0]:
            best[0], best[1] = key, [list(b) for b in bins]

    def search(r: int, total: int) -> None:
        if best[0] is not None and total + remaining[r] > best[0][0]:
            return
        if r == num:
            finish()
            return
        for k in range(len(bins)):
            added = lengths[r] - rw.lcp(bins[k][-1], r)
            if works[k] + added <= capacity:
                bins[k].append(r)
                works[k] += added
                search(r + 1, total + added)
                works[k] -= added
                bins[k].pop()
        bins.append([r])
        works.append(lengths[r])
        search(r + 1, total + lengths[r])
        works.pop()
        bins.pop()

    search(0, 0)
    if best[1] is None:
        raise no_plan_error(num, dp, capacity)
    return pad_to_dp(best[1], num, dp)


def _window(rw: RankWork, capacity: int) -> int:
    return int((np.arange(rw.num + 1) - _run_starts(rw, capacity)).max())


def _run_starts(rw: RankWork, capacity: int) -> np.ndarray:
    """lo[j]: the first start i whose run i..j-1 fits in the capacity (lo[0] = 0)."""
    # cost(i, j) = A[j] - B[i] with B non-decreasing, so the fitting starts are a suffix.
    head = rw.cum_len[:-1] - rw.cum_lcp[1:]
    tail = rw.cum_len - rw.cum_lcp
    lo = np.searchsorted(head, tail - capacity, side="left").astype(np.int64)
    lo[0] = 0
    return lo


def cut_point_dp(rw: RankWork, capacity: int, dp: int, *, band: int | None = None) -> list[list[int]]:
    """The best contiguous partition of the sorted order with K ≡ 0 mod D (see the module docstring)."""
    num = rw.num
    # Fewer than D trajectories: any count, padded with empty microbatches afterwards.
    modulus = dp if num >= dp else 1
    lo = _run_starts(rw, capacity)
    tail = rw.cum_len - rw.cum_lcp
    head = np.concatenate([rw.cum_len[:-1] - rw.cum_lcp[1:], [0]])
    fewest = np.zeros(num + 1, dtype=np.int64)
    for j in range(1, num + 1):
        fewest[j] = 1 + fewest[lo[j]]
    window = int((np.arange(num + 1) - lo).max())
    sorted_lcp = np.sort(rw.lcp_adjacent[1:])
    compact = rw.run_cost(0, num)
    bound = compact + np.concatenate([[0], np.cumsum(sorted_lcp)])

    previous = np.full(num + 1, _INF, dtype=np.int64)
    previous[0] = 0
    choices: list[tuple[int, np.ndarray]] = []
    best_total = None
    finals: dict[int, int] = {}
    columns = np.arange(num + 1, dtype=np.int64)
    for k in range(1, num + 1):
        if best_total is not None and bound[k - 1] > best_total:
            break
        # Prefixes whose count band contains k; everything else stays unreachable.
        first = 1 if band is None else int(np.searchsorted(fewest, k - band + 1, side="left"))
        last = int(np.searchsorted(fewest, k, side="right")) - 1
        first = max(first, 1)
        if first > last:
            # fewest[] rises by at most 1 per prefix, so the band has passed every prefix.
            break
        j = columns[first : last + 1]
        reach = np.where(previous < _INF, previous - head, _INF)
        value = np.full(len(j), _INF, dtype=np.int64)
        argument = np.full(len(j), -1, dtype=np.int64)
        for d in range(1, window + 1):
            i = j - d
            valid = i >= np.maximum(lo[j], 0)
            candidate = np.where(valid, reach[np.maximum(i, 0)], _INF)
            better = candidate < value
            value = np.where(better, candidate, value)
            argument = np.where(better, i, argument)
        current = np.full(num + 1, _INF, dtype=np.int64)
        current[j] = np.where(value < _INF, value + tail[j], _INF)
        choices.append((first, argument))
        previous = current
        if current[num] < _INF and k % modulus == 0:
            finals[k] = int(current[num])
            best_total = min(finals.values())
    if not finals:
        raise no_plan_error(num, dp, capacity)
    candidates = []
    for k, total in sorted(finals.items()):
        if total != best_total:
            continue
        bins = []
        end = num
        for level in range(k, 0, -1):
            first, argument = choices[level - 1]
            start = int(argument[end - first])
            bins.append(list(range(start, end)))
            end = start
        assert end == 0
        bins.reverse()
        candidates.append((_key(rw, pad_to_dp(bins, num, dp), dp), bins))
    return pad_to_dp(min(candidates, key=lambda item: item[0])[1], num, dp)


class _State:
    """Microbatches as sorted rank lists with their works and each rank's microbatch."""

    def __init__(self, rw: RankWork, bins: list[list[int]], capacity: int) -> None:
        self.rw = rw
        self.capacity = capacity
        self.bins = [list(b) for b in bins]
        self.works = [rw.trie(b) for b in self.bins]
        self.bin_of = np.empty(rw.num, dtype=np.int64)
        for k, b in enumerate(self.bins):
            self.bin_of[b] = k

    def nonempty(self) -> list[list[int]]:
        return [list(b) for b in self.bins if b]

    def total(self) -> int:
        return sum(self.works)

    def move(self, x: int, source: int, target: int) -> None:
        self.bins[source].remove(x)
        bisect.insort(self.bins[target], x)
        self.bin_of[x] = target
        self.works[source] = self.rw.trie(self.bins[source])
        self.works[target] = self.rw.trie(self.bins[target])

    def replace(self, changes: dict[int, list[int]]) -> None:
        for k, members in changes.items():
            self.bins[k] = members
            self.works[k] = self.rw.trie(members)
            if members:
                self.bin_of[members] = k


def refine(rw: RankWork, bins: list[list[int]], capacity: int, dp: int, config: HartsConfig, *,
           work_optimal: bool = False) -> list[list[int]]:
    """Moves, swaps and eliminations that lower W, K mod D repair, balancing; never worse than `bins`.

    `work_optimal`: the W of `bins` is proven minimal, so only balancing runs.
    """
    original = _key(rw, bins, dp)
    state = _State(rw, bins, capacity)
    if not work_optimal:
        state = _lower_work(state, config, dp)
    _balance(state, dp, config)
    refined = state.nonempty()
    assert len(refined) % dp == 0
    return refined if _key(rw, refined, dp) <= original else [list(b) for b in bins]


def _lower_work(state: _State, config: HartsConfig, dp: int) -> _State:
    """Drift (K free) and descend (K fixed) alternately while W drops; K ≡ 0 mod D on return."""
    rw, capacity = state.rw, state.capacity
    options = [(state.total(), state.nonempty())]
    _drift(state, config, dp, options)
    state = _State(rw, min(options, key=lambda item: item[0])[1], capacity)
    for _ in range(config.max_passes):
        _descend(state, config, dp=dp, snapshots=None)
        trial = _State(rw, state.nonempty(), capacity)
        candidates = [(state.total(), state.nonempty())]
        _drift(trial, config, dp, candidates)
        best = min(candidates, key=lambda item: item[0])
        if best[0] >= state.total():
            break
        state = _State(rw, best[1], capacity)
    return state


def _drift(state: _State, config: HartsConfig, dp: int, options: list[tuple[int, list[list[int]]]]) -> None:
    """Descend and eliminate microbatches with K free, then add the ways back to K ≡ 0 mod D.

    Appends to `options` every state met with K ≡ 0 mod D, the cheapest splits of the final
    state and its cluster repacking (each as (W, bins)).
    """
    rw = state.rw
    for _ in range(config.max_passes):
        _descend(state, config, dp=dp, snapshots=options)
        if not _eliminate(state, config, dp=dp, snapshots=options):
            break
    drifted = state.nonempty()
    for candidate in (split_to_multiple(rw, drifted, dp), _repack(rw, drifted, state.capacity, dp)):
        if candidate is not None:
            options.append((sum(rw.trie(b) for b in candidate), candidate))


def _descend(state: _State, config: HartsConfig, *, dp: int,
             snapshots: list[tuple[int, list[list[int]]]] | None) -> None:
    """Boundary moves, sparse-repair moves and neighbour swaps while W drops.

    With `snapshots` a move may empty a microbatch (K drifts; every state with K ≡ 0 mod D is
    recorded); without, K stays fixed. After the first pass a trajectory is looked at again only
    when its microbatch or a sorted neighbour's changed.
    """
    rw = state.rw
    lengths = rw.lengths_list
    window = config.neighbor_window
    allow_empty = snapshots is not None
    dirty = set(range(len(state.bins)))
    for _ in range(config.max_passes):
        changed: set[int] = set()
        roomiest = _roomiest(state, config.room_candidates)
        for x in range(rw.num):
            nearby = state.bin_of[max(0, x - window) : x + window + 1].tolist()
            if dirty.isdisjoint(nearby) and changed.isdisjoint(nearby):
                continue
            source = int(state.bin_of[x])
            members = state.bins[source]
            if len(members) == 1 and not allow_empty:
                continue
            saved = lengths[x] - rw.share(members, x)
            candidates = set(nearby).union(roomiest)
            candidates.discard(source)
            best_delta, best_target = 0, -1
            for target in sorted(candidates):
                if not state.bins[target]:
                    continue
                added = lengths[x] - rw.share(state.bins[target], x)
                if state.works[target] + added > state.capacity:
                    continue
                if added - saved < best_delta:
                    best_delta, best_target = added - saved, target
            if best_target >= 0:
                state.move(x, source, best_target)
                changed.update((source, best_target))
                roomiest = _roomiest(state, config.room_candidates)
                if allow_empty and not state.bins[source]:
                    count = sum(1 for b in state.bins if b)
                    if count % dp == 0:
                        snapshots.append((state.total(), state.nonempty()))
                continue
            target = _swap_neighbour(state, x, saved, window)
            if target >= 0:
                changed.update((source, target))
        if not changed:
            return
        dirty = changed


def _roomiest(state: _State, count: int) -> list[int]:
    """The `count` non-empty microbatches with the most free capacity (ties: lowest index)."""
    works = np.asarray([w if b else state.capacity + 1 for w, b in zip(state.works, state.bins)])
    return np.argsort(works, kind="stable")[:count].tolist()


def _eliminate(state: _State, config: HartsConfig, *, dp: int,
               snapshots: list[tuple[int, list[list[int]]]]) -> bool:
    """Empty whole microbatches, lightest first, when their members fit elsewhere for less than
    the microbatch's work.

    Each member (longest first) goes where it adds least: a microbatch of a sorted neighbour or
    one of the roomiest; when it does not fit there, that microbatch may eject one member into
    a third microbatch (a chain of length one). Records every state with K ≡ 0 mod D.
    """
    rw = state.rw
    lengths = rw.lengths_list
    capacity = state.capacity
    window = config.neighbor_window
    improved = False
    for emptied in sorted((k for k, b in enumerate(state.bins) if b), key=lambda k: (state.works[k], k)):
        members = state.bins[emptied]
        if not members or len(members) > config.eliminate_max_members:
            continue
        scratch: dict[int, tuple[list[int], int]] = {}

        def current(k: int) -> tuple[list[int], int]:
            return scratch.get(k, (state.bins[k], state.works[k]))

        def home(r: int) -> int:
            for k, (m, _) in scratch.items():
                if r in m:
                    return k
            return int(state.bin_of[r])

        roomiest = _roomiest(state, config.room_candidates)
        cost = 0
        for x in sorted(members, key=lambda r: (-lengths[r], r)):
            targets = {home(r) for r in range(max(0, x - window), min(rw.num, x + window + 1))}
            best: tuple[int, dict[int, tuple[list[int], int]]] | None = None
            for target in sorted((targets | set(roomiest)) - {emptied}):
                held, before = current(target)
                if not held:
                    continue
                joined = sorted(held + [x])
                work = before + lengths[x] - rw.share(held, x)
                if work <= capacity:
                    if best is None or work - before < best[0]:
                        best = (work - before, {target: (joined, work)})
                    continue
                for y in held:
                    kept_work = work - lengths[y] + rw.share(joined, y)
                    if kept_work > capacity:
                        continue
                    thirds = {home(r) for r in range(max(0, y - 4), min(rw.num, y + 5))} | set(roomiest[:4])
                    for third in sorted(thirds - {emptied, target}):
                        receiving, receiving_work = current(third)
                        if not receiving:
                            continue
                        grown_work = receiving_work + lengths[y] - rw.share(receiving, y)
                        delta = kept_work - before + grown_work - receiving_work
                        if grown_work <= capacity and (best is None or delta < best[0]):
                            best = (delta, {target: ([r for r in joined if r != y], kept_work),
                                            third: (sorted(receiving + [y]), grown_work)})
            if best is None:
                break
            cost += best[0]
            scratch.update(best[1])
            if cost >= state.works[emptied]:
                break
        else:
            if cost < state.works[emptied]:
                changes = {k: m for k, (m, _) in scratch.items()}
                changes[emptied] = []
                state.replace(changes)
                improved = True
                if sum(1 for b in state.bins if b) % dp == 0:
                    snapshots.append((state.total(), state.nonempty()))
    return improved


def _swap_neighbour(state: _State, x: int, saved: int, window: int) -> int:
    """Swap x with the sorted neighbour in another microbatch that lowers W most; that
    microbatch, or -1 if no swap lowers W. `saved` is what removing x alone saves."""
    rw = state.rw
    lengths = rw.lengths_list
    source = int(state.bin_of[x])
    members = state.bins[source]
    best_delta, best = 0, None
    for y in range(max(0, x - window), min(rw.num, x + window + 1)):
        target = int(state.bin_of[y])
        if target == source:
            continue
        held = state.bins[target]
        work_source = state.works[source] - saved + lengths[y] - rw.share(members, y, skip=x)
        work_target = state.works[target] - lengths[y] + rw.share(held, y) + lengths[x] - rw.share(held, x, skip=y)
        if work_source > state.capacity or work_target > state.capacity:
            continue
        delta = work_source + work_target - state.works[source] - state.works[target]
        if delta < best_delta:
            best_delta, best = delta, (y, target)
    if best is None:
        return -1
    y, target = best
    state.replace({
        source: sorted([r for r in members if r != x] + [y]),
        target: sorted([r for r in state.bins[target] if r != y] + [x]),
    })
    return target


def _repack(rw: RankWork, bins: list[list[int]], capacity: int, dp: int) -> list[list[int]] | None:
    """Repack whole clusters into the fewest multiple-of-D microbatches, balanced; None if impossible.

    A cluster shares only the common prefix g0 with anything outside it, so a microbatch of
    clusters costs g0 + Σ (trie(c) - g0) (less where clusters of one tree meet): W falls by g0
    per microbatch saved. The count is the first-fit-decreasing count rounded up to a multiple
    of D; clusters, largest first, then go to the least-loaded microbatch (which has the most
    room), or first-fit-decreasing when that fails.
    """
    g0 = rw.common_prefix
    clusters = [c for b in bins for c in rw.clusters(b)]
    sizes = [rw.trie(c) - g0 for c in clusters]
    room = capacity - g0
    order = sorted(range(len(clusters)), key=lambda i: (-sizes[i], clusters[i][0]))
    first_fit: list[int] = []
    placed = [0] * len(clusters)
    for i in order:
        for k, load in enumerate(first_fit):
            if load + sizes[i] <= room:
                first_fit[k] += sizes[i]
                placed[i] = k
                break
        else:
            placed[i] = len(first_fit)
            first_fit.append(sizes[i])
    count = -(-len(first_fit) // dp) * dp
    if count > len(clusters):
        return None
    heap = [(0, k) for k in range(count)]
    assignment = [0] * len(clusters)
    for i in order:
        load, k = heapq.heappop(heap)
        if load + sizes[i] > room:
            break
        assignment[i] = k
        heapq.heappush(heap, (load + sizes[i], k))
    else:
        return _gather(clusters, assignment, count)
    # Least-loaded placement ran out of room: keep first fit and give each empty microbatch
    # the smallest cluster of a microbatch that holds several.
    assignment = placed
    members = [[i for i in range(len(clusters)) if assignment[i] == k] for k in range(count)]
    for k in range(len(first_fit), count):
        donors = [(sizes[i], i) for m in members if len(m) >= 2 for i in m]
        size, i = min(donors)
        members[assignment[i]].remove(i)
        members[k].append(i)
        assignment[i] = k
    return _gather(clusters, assignment, count)


def _gather(clusters: list[list[int]], assignment: list[int], count: int) -> list[list[int]]:
    bins: list[list[int]] = [[] for _ in range(count)]
    for cluster, k in zip(clusters, assignment):
        bins[k].extend(cluster)
    return [sorted(b) for b in bins]


def _balance(state: _State, dp: int, config: HartsConfig) -> None:
    """Move trajectories or move/swap whole clusters while the (W, critical path, largest replica) key drops.

    Candidates, for each slot's heaviest microbatch (the only ones whose loss of work can lower
    the critical path): one of its trajectories to the microbatch of a sorted neighbour when W
    does not rise, or one of its clusters to (or swapped with a cluster of) any microbatch,
    when both results stay below the heaviest work and within capacity. A source's candidates
    are scored in one batch; the best that lowers the full key is taken.
    """
    rw = state.rw
    capacity = state.capacity
    lengths = rw.lengths_list
    window = config.neighbor_window
    cache: dict[int, list[list[int]]] = {}

    def clusters_of(k: int) -> list[list[int]]:
        if k not in cache:
            cache[k] = rw.clusters(state.bins[k])
            sizes[k] = [rw.trie(cl) for cl in cache[k]]
        return cache[k]

    def sizes_of(k: int) -> list[int]:
        clusters_of(k)
        return sizes[k]

    sizes: dict[int, list[int]] = {}
    # Sources that found nothing are skipped until they change; a full rescan confirms the end.
    barren: set[int] = set()
    for _ in range(config.max_balance_moves):
        live = [k for k, b in enumerate(state.bins) if b]
        position = {k: i for i, k in enumerate(live)}
        works = np.asarray([state.works[k] for k in live], dtype=np.int64)
        current = objective(works, dp)
        change = None
        heaviest = np.argsort(-works, kind="stable")[::dp].tolist()
        sources = [a for a in heaviest if live[a] not in barren]
        for a in sources:
            source = live[a]
            members = state.bins[source]
            # (new source work, target position, new target work, change)
            proposals: list[tuple[int, int, int, dict[int, list[int]]]] = []
            for x in members if len(members) >= 2 else ():
                saved = lengths[x] - rw.share(members, x)
                for target in sorted(set(state.bin_of[max(0, x - window) : x + window + 1].tolist()) - {source}):
                    b = position[target]
                    added = lengths[x] - rw.share(state.bins[target], x)
                    if added <= saved and works[b] + added <= capacity and works[b] + added < works[a]:
                        proposals.append((int(works[a] - saved), b, int(works[b] + added), {
                            source: [r for r in members if r != x], target: sorted(state.bins[target] + [x])}))
            source_clusters = clusters_of(source)
            for c, cluster in enumerate(source_clusters):
                rest = [r for e, cl in enumerate(source_clusters) if e != c for r in cl]
                rest_work = rw.trie(rest)
                for b, target in enumerate(live):
                    if target == source:
                        continue
                    if rest:
                        new_target = works[b] + rw.insert_cost(state.bins[target], cluster)
                        if new_target <= capacity and new_target < works[a]:
                            proposals.append((rest_work, b, int(new_target),
                                              {source: rest, target: sorted(state.bins[target] + cluster)}))
                    target_clusters = clusters_of(target)
                    for d, other in enumerate(target_clusters):
                        # A larger cluster coming back cannot lighten the source.
                        if sizes_of(target)[d] >= sizes_of(source)[c]:
                            continue
                        target_rest = [r for e, cl in enumerate(target_clusters) if e != d for r in cl]
                        new_source = rest_work + rw.insert_cost(rest, other)
                        new_target = rw.trie(target_rest) + rw.insert_cost(target_rest, cluster)
                        if new_source < works[a] and new_target < works[a] and max(new_source, new_target) <= capacity:
                            proposals.append((int(new_source), b, int(new_target),
                                              {source: sorted(rest + other), target: sorted(target_rest + cluster)}))
            if not proposals:
                continue
            trial = np.tile(works, (len(proposals), 1))
            rows = np.arange(len(proposals))
            trial[rows, a] = [p[0] for p in proposals]
            trial[rows, [p[1] for p in proposals]] = [p[2] for p in proposals]
            totals = trial.sum(axis=1)
            critical = -np.sort(-trial, axis=1)[:, ::dp].sum(axis=1)
            for p in np.lexsort((critical, totals))[:8].tolist():
                if objective(trial[p], dp) < current:
                    change = proposals[p][3]
                    break
            if change is not None:
                break
            barren.add(source)
        if change is None:
            if len(sources) == len(heaviest):
                return
            barren.clear()
            continue
        state.replace(change)
        for k in change:
            cache.pop(k, None)
            barren.discard(k)
