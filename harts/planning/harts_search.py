"""The HARTS planner's settings (`HartsConfig`, every tier's) and its exact search tiers over the sorted order
(`rank_work.RankWork`: ranks r, lengths L[r], lcp[r] = LCP(r - 1, r)); `harts_planner.plan_harts` chooses among them.

1. "exact" (`exact_partition`, N <= `exact_max_trajectories`): branch and bound over all set partitions of the
   ranks (restricted-growth assignment in rank order, capacity and W-bound pruning), scoring complete partitions
   with the full objective. Optimal; tested against brute force.
2. "dp" (`cut_point_dp`, DP over cut points): f[k][j] = min W of the first j ranks in k contiguous runs, each
   <= T: f[k][j] = min_{lo(j) <= i < j} f[k-1][i] + cost(i, j), where lo(j) is the first start whose run fits
   (monotone, found by binary search on prefix sums). Counts k run upward until the bound C + (k - 1 smallest
   adjacent LCPs) exceeds the best W found at a multiple of D; every k ≡ 0 mod D reaching that W is rebuilt and
   scored by the full objective. Exact among contiguous partitions (tested against enumeration of all cut sets).
3. "restricted-dp" (when N² · window, the full table's cells, exceeds `dp_max_cells`): the same recursion
   keeping, for each prefix j, only counts within `count_band` of the fewest runs that can cover it.
`cheapest_pieces` is the same recursion over one run of ranks without the count: its cheapest split into runs that
fit (the cluster-packing tier's pieces of a cluster larger than T).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harts.planning.plans import objective
from harts.planning.rank_work import RankWork, no_plan_error, pad_to_dp

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

    tail: bool = True
    """Run the slot-tail pass (`harts_tail.refine_tail`) on the plan the tiers chose (with `refine`)."""
    tail_target: float = 0.01
    """Slots at most this imbalanced (max/mean - 1) are left as they are."""
    tail_unit_depth: int = 1
    """Units of the tail pass: a microbatch's clusters and their root-level subtrees to this many levels (on the
    GRPO shapes of `harts bench planning-grpo`, tuning seeds 0-1, 2 to 4 levels took the same changes as 1, in 30%
    more time: a sub-tree under a sample moves only where its sample is)."""
    tail_candidates: int = 16
    """Candidates of a slot weighed on the whole plan (every slot's imbalance and the objective), best ranked first
    (16 and 64 took the same changes on those seeds)."""
    tail_max_changes: int = 200
    """Most changes the tail pass takes."""

    def __post_init__(self) -> None:
        if self.exact_max_trajectories < 0 or self.neighbor_window < 1 or self.room_candidates < 0:
            raise ValueError("exact_max_trajectories >= 0, neighbor_window >= 1, room_candidates >= 0")
        if min(self.count_band, self.balance_batch) < 1 or min(self.max_passes, self.max_balance_moves,
                                                                 self.balance_rounds) < 0:
            raise ValueError("count_band >= 1, balance_batch >= 1, max_passes >= 0, max_balance_moves >= 0, "
                             "balance_rounds >= 0")


def bins_key(rw: RankWork, bins: list[list[int]], dp: int) -> tuple[int, int, int]:
    """The full objective of `bins` (lists of ranks), each microbatch's work its trie size."""
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


def dp_window(rw: RankWork, capacity: int) -> int:
    """The most ranks a run that fits holds: the DP's starts per prefix."""
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
        candidates.append((bins_key(rw, pad_to_dp(bins, num, dp), dp), bins))
    return pad_to_dp(min(candidates, key=lambda item: item[0])[1], num, dp)


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
