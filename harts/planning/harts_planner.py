"""The HARTS microbatch planner: cut-point DP over the sorted order, refinement, greedy replicas.

`plan_harts(step, capacity, dp, ...) -> Plan` minimises the lexicographic objective of
`harts.planning.microbatch.objective`: total compact work W, then the slot critical path, then
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
2. "dp" (DP over cut points): f[k][j] = min W of the first j ranks in k contiguous runs, each
   <= T: f[k][j] = min_{lo(j) <= i < j} f[k-1][i] + cost(i, j), where lo(j) is the first start
   whose run fits (monotone, found by binary search on prefix sums). Counts k run upward until
   the bound C + (k - 1 smallest adjacent LCPs) exceeds the best W found at a multiple of D;
   every k ≡ 0 mod D reaching that W is rebuilt and scored by the full objective. Exact among
   contiguous partitions (tested against enumeration of all cut sets).
3. "restricted-dp" (when N · window · counts exceeds `dp_max_cells`): the same recursion keeping,
   for each prefix j, only counts within `count_band` of the fewest runs that can cover it.

Refinement (tiers 2 and 3), each move accepted only when it lowers the objective it targets:
- boundary moves and sparse repair: move one trajectory to the microbatch of one of its sorted
  neighbours (crossing a cut) or to one of the microbatches with the most room (pairing
  leftovers of different trees, which share the common prefix), and swap a trajectory with a
  sorted neighbour in another microbatch, whenever W drops. Emptying a microbatch is allowed;
  afterwards K is brought back to a multiple of D by the cheapest splits (cost = the LCP at
  the split), or by the best state that already had K ≡ 0 mod D, whichever has the lower W;
  a second pass of moves then runs with K fixed.
- balance: "clusters" are the maximal groups of a microbatch's members that share more than the
  common prefix g0 with each other; moving or swapping whole clusters never raises W (they
  share g0 with anything), so clusters are moved or swapped between microbatches whenever the
  (W, critical path, largest replica) key drops.
The refined plan replaces the DP plan only if its objective is no worse.

Replicas: the greedy assignment of `greedy_assignment` (sort by work, D per slot, heaviest to the
least-loaded replica).
"""

from __future__ import annotations

import bisect
import heapq
import time
from dataclasses import dataclass, fields, replace

import numpy as np

from harts.planning.microbatch import Plan, build_plan, objective
from harts.planning.rank_work import RankWork, no_plan_error, pad_to_dp, split_to_multiple
from harts.trees.step import Step
from harts.trees.trie import PrefixIndex

_INF = np.int64(1) << 61


@dataclass(kw_only=True)
class HartsConfig:
    exact_max_trajectories: int = 8
    """Steps with at most this many trajectories are solved by exhaustive branch and bound."""
    dp_max_cells: int = 100_000_000
    """Above N · window · (possible counts) cells the DP keeps only a band of counts per prefix."""
    count_band: int = 64
    """Restricted tier: counts kept per prefix beyond the fewest runs that cover it (>= D)."""
    refine: bool = True
    """Run the moves, swaps and balancing after the DP."""
    neighbor_window: int = 12
    """Boundary moves and swaps look this many ranks either side of a trajectory."""
    room_candidates: int = 16
    """Sparse repair also tries the microbatches with the most free capacity."""
    max_passes: int = 30
    """Passes of moves over all trajectories (each pass stops early when nothing improves)."""
    max_balance_moves: int = 2000
    """Upper bound on accepted balancing changes."""

    def __post_init__(self) -> None:
        if self.exact_max_trajectories < 0 or self.neighbor_window < 1 or self.room_candidates < 0:
            raise ValueError("exact_max_trajectories >= 0, neighbor_window >= 1, room_candidates >= 0")
        if self.count_band < 1 or self.max_passes < 0 or self.max_balance_moves < 0:
            raise ValueError("count_band >= 1, max_passes >= 0 and max_balance_moves >= 0")


def plan_harts(step: Step, capacity: int, dp: int, *, index: PrefixIndex | None = None,
               config: HartsConfig | None = None, **options) -> Plan:
    """The HARTS plan of `step` (`options` override `HartsConfig` fields)."""
    started = time.perf_counter()
    config = _configure(config, options)
    index = index or PrefixIndex.from_step(step)
    rw = RankWork(index)
    details: dict[str, object] = {}
    if rw.num <= config.exact_max_trajectories:
        bins = exact_partition(rw, capacity, dp)
        details["tier"] = "exact"
    else:
        band = None
        window = _window(rw, capacity)
        if rw.num * window * rw.num > config.dp_max_cells:
            band = max(config.count_band, dp)
        bins = cut_point_dp(rw, capacity, dp, band=band)
        details["tier"] = "dp" if band is None else "restricted-dp"
        details["dp_compact_tokens"] = sum(rw.trie(b) for b in bins)
        if config.refine and rw.num >= dp:
            bins = refine(rw, bins, capacity, dp, config)
    works = np.asarray([rw.trie(b) for b in bins], dtype=np.int64)
    groups = [rw.order[np.asarray(b, dtype=np.int64)] for b in bins]
    return build_plan(step, groups, works, planner="harts", capacity=capacity, dp=dp,
                      started=started, details=details)


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


def refine(rw: RankWork, bins: list[list[int]], capacity: int, dp: int, config: HartsConfig) -> list[list[int]]:
    """Moves and swaps that lower W, cluster repacking, then balancing; never worse than `bins`."""
    original = _key(rw, bins, dp)
    state = _State(rw, bins, capacity)
    options = [(state.total(), state.nonempty())]
    _descend(state, config, dp=dp, snapshots=options)
    drifted = state.nonempty()
    for candidate in (split_to_multiple(rw, drifted, dp), _repack(rw, drifted, capacity, dp)):
        if candidate is not None:
            options.append((sum(rw.trie(b) for b in candidate), candidate))
    # min() keeps the earliest of equal totals.
    state = _State(rw, min(options, key=lambda item: item[0])[1], capacity)
    for _ in range(config.max_passes):
        _descend(state, config, dp=dp, snapshots=None)
        repacked = _repack(rw, state.nonempty(), capacity, dp)
        if repacked is None or sum(rw.trie(b) for b in repacked) >= state.total():
            break
        state = _State(rw, repacked, capacity)
    _balance(state, dp, config)
    refined = state.nonempty()
    assert len(refined) % dp == 0
    return refined if _key(rw, refined, dp) <= original else [list(b) for b in bins]


def _descend(state: _State, config: HartsConfig, *, dp: int,
             snapshots: list[tuple[int, list[list[int]]]] | None) -> None:
    """Boundary moves, sparse-repair moves and neighbour swaps while W drops.

    With `snapshots` a move may empty a microbatch (K drifts; every state with K ≡ 0 mod D is
    recorded); without, K stays fixed.
    """
    rw = state.rw
    lengths = rw.lengths_list
    window = config.neighbor_window
    allow_empty = snapshots is not None
    for _ in range(config.max_passes):
        improved = False
        for x in range(rw.num):
            source = int(state.bin_of[x])
            members = state.bins[source]
            if len(members) == 1 and not allow_empty:
                continue
            saved = lengths[x] - rw.share(members, x)
            candidates = set(state.bin_of[max(0, x - window) : x + window + 1].tolist())
            if config.room_candidates:
                works = np.asarray([w if b else state.capacity + 1 for w, b in zip(state.works, state.bins)])
                candidates.update(np.argsort(works, kind="stable")[: config.room_candidates].tolist())
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
                improved = True
                if allow_empty and not state.bins[source]:
                    count = sum(1 for b in state.bins if b)
                    if count % dp == 0:
                        snapshots.append((state.total(), state.nonempty()))
            elif _swap_neighbour(state, x, window):
                improved = True
        if not improved:
            return


def _swap_neighbour(state: _State, x: int, window: int) -> bool:
    """Swap x with the sorted neighbour in another microbatch that lowers W most, if any."""
    rw = state.rw
    source = int(state.bin_of[x])
    best_delta, best = 0, None
    without_x = [r for r in state.bins[source] if r != x]
    for y in range(max(0, x - window), min(rw.num, x + window + 1)):
        target = int(state.bin_of[y])
        if target == source:
            continue
        new_source = sorted(without_x + [y])
        new_target = sorted([r for r in state.bins[target] if r != y] + [x])
        work_source, work_target = rw.trie(new_source), rw.trie(new_target)
        if work_source > state.capacity or work_target > state.capacity:
            continue
        delta = work_source + work_target - state.works[source] - state.works[target]
        if delta < best_delta:
            best_delta, best = delta, {source: new_source, target: new_target}
    if best is None:
        return False
    state.replace(best)
    return True


def _repack(rw: RankWork, bins: list[list[int]], capacity: int, dp: int) -> list[list[int]] | None:
    """Repack whole clusters into the fewest multiple-of-D microbatches, balanced; None if impossible.

    A cluster shares only the common prefix g0 with anything outside it, so a microbatch of
    clusters costs g0 + Σ (trie(c) - g0) (less where clusters of one tree meet): W falls by g0
    per microbatch saved. The count is the first-fit-decreasing count rounded up to a multiple
    of D; clusters, largest first, then go to the least-loaded microbatch (which has the most
    room), or first-fit-decreasing when that fails.
    """
    g0 = rw.common_prefix
    clusters = [c for b in bins for c in _clusters(rw, b)]
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


def _clusters(rw: RankWork, members: list[int]) -> list[list[int]]:
    """Split a sorted member list where consecutive members share only the common prefix g0."""
    out = [[members[0]]]
    for a, b in zip(members, members[1:]):
        if rw.lcp(a, b) == rw.common_prefix:
            out.append([b])
        else:
            out[-1].append(b)
    return out


def _balance(state: _State, dp: int, config: HartsConfig) -> None:
    """Move or swap whole clusters while the (W, critical path, largest replica) key drops.

    Candidates: a cluster of a slot's heaviest microbatch goes to (or swaps with a cluster of)
    another microbatch, when both results stay below that heaviest work and within capacity;
    every candidate of one cluster is scored exactly in one batch.
    """
    rw = state.rw
    capacity = state.capacity
    cache: dict[int, list[list[int]]] = {}

    def clusters_of(k: int) -> list[list[int]]:
        if k not in cache:
            cache[k] = _clusters(rw, state.bins[k])
        return cache[k]

    for _ in range(config.max_balance_moves):
        live = [k for k, b in enumerate(state.bins) if b]
        works = np.asarray([state.works[k] for k in live], dtype=np.int64)
        current = objective(works, dp)
        by_work = np.argsort(-works, kind="stable")
        sources = by_work[::dp].tolist()
        accepted = False
        for a in sources:
            source = live[a]
            source_clusters = clusters_of(source)
            for c, cluster in enumerate(source_clusters):
                rest = [r for e, cl in enumerate(source_clusters) if e != c for r in cl]
                rest_work = rw.trie(rest)
                proposals: list[tuple[int, int, int, int, dict[int, list[int]]]] = []
                for b, target in enumerate(live):
                    if target == source:
                        continue
                    if rest:
                        new_target = works[b] + rw.insert_cost(state.bins[target], cluster)
                        if new_target <= capacity and new_target < works[a]:
                            proposals.append((rest_work, b, int(new_target), a,
                                              {source: rest, target: sorted(state.bins[target] + cluster)}))
                    target_clusters = clusters_of(target)
                    for d, other in enumerate(target_clusters):
                        target_rest = [r for e, cl in enumerate(target_clusters) if e != d for r in cl]
                        new_source = rest_work + rw.insert_cost(rest, other)
                        new_target = rw.trie(target_rest) + rw.insert_cost(target_rest, cluster)
                        if new_source < works[a] and new_target < works[a] and max(new_source, new_target) <= capacity:
                            proposals.append((int(new_source), b, int(new_target), a,
                                              {source: sorted(rest + other), target: sorted(target_rest + cluster)}))
                if not proposals:
                    continue
                trial = np.tile(works, (len(proposals), 1))
                rows = np.arange(len(proposals))
                trial[rows, [p[3] for p in proposals]] = [p[0] for p in proposals]
                trial[rows, [p[1] for p in proposals]] = [p[2] for p in proposals]
                totals = trial.sum(axis=1)
                critical = -np.sort(-trial, axis=1)[:, ::dp].sum(axis=1)
                for p in np.lexsort((critical, totals))[:8].tolist():
                    key = objective(trial[p], dp)
                    if key < current:
                        changed = proposals[p][4]
                        state.replace(changed)
                        for k in changed:
                            cache.pop(k, None)
                        accepted = True
                        break
                if accepted:
                    break
            if accepted:
                break
        if not accepted:
            return
