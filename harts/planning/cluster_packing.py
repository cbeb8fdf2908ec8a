"""Whole-cluster packing: clusters into K microbatches, then slot balancing by moves and swaps.

A cluster is a maximal run of the sorted order whose neighbours share more than g0, the prefix
every trajectory of the step shares (`RankWork.common_prefix`); two trajectories of different
clusters share exactly g0. A microbatch of whole clusters therefore has work g0 + Σ m_c with
m_c = trie(c) - g0, and a plan of K such microbatches has W = C + (K - 1)·g0: W depends on K
alone, and since every adjacent LCP is >= g0 the bound of `harts.planning.bounds` shows that no
plan with K or more microbatches has less W. So the work of a whole-cluster plan is settled by
its count, and what is left is the slot critical path: this module packs item sizes (the m_c)
into bins of room T - g0 and balances them; `harts_packing` turns bins into microbatches.

Provides (items: int64 sizes [P]; bins: `bin_of` int64 [P], 0 <= bin < count):
- `first_fit_count(sizes, room)`: bins used by first-fit-decreasing (K is it rounded up to D);
- `pack_best_fit(sizes, room, count)`: largest first to the fullest bin it fits, keeping one
  item for every still-empty bin (bins filled near the room form tight slots at the top);
  `pack_least_loaded(sizes, room, count)`: largest first to the least-loaded bin (near-equal
  loads, which balancing finishes better when a bin holds only a few items);
  `BestFit`, the ordered loads it (and `harts_packing`'s splitting of leftovers) finds that bin with;
- `critical_path(works, dp)`: Σ over slots of the largest work under the sorted grouping of
  `harts.planning.plans.objective`;
- `CriticalPathChange(works, dp, ranks).price(...)`: the exact change of the critical path when
  one work falls by δ and another rises by δ, vectorised; `naive_critical_path_change` (sort and
  sum) is its reference; `rank_table(works, limit)` is the optional lookup that replaces its
  binary searches (same prices, tested);
- `balance(sizes, bin_of, count, dp, base, capacity, max_rounds)`: descent over moves of one
  item and swaps of two items that lowers the critical path; never raises it, never leaves a
  bin empty, never exceeds the capacity (tested on random instances). Per round it prices
  only the candidates that `CriticalPathChange.can_lower` keeps, checks each taken one
  exactly on the sorted works, and updates the rank table by slices.

Identity behind the pricing: with N(t) = #{k : work_k >= t}, slot s of the sorted grouping has
its largest work >= t iff N(t) > s·D, so CP = Σ_{t >= 1} ⌈N(t)/D⌉. Lowering one work from u to
u - δ lowers CP by #{t in (u - δ, u] : N(t) ≡ 1 mod D}; raising one from v to v + δ raises it
by #{t in (v, v + δ] : N(t) ≡ 0 mod D}; where the two intervals overlap N is unchanged. Prefix
sums of both counts over the sorted works price every candidate in O(log K), or O(1) given the
interval of each value (`rank_table`: #{works < x} for every x up to the capacity, which
`balance` updates by two slices per accepted change instead of rebuilding).

Legend: P items, K (`count`) bins, D replicas (`dp`).
"""

from __future__ import annotations

import bisect
import functools

import numpy as np

# Largest capacity for which `balance` ranks priced values with a table (8 bytes per value).
_RANK_TABLE_MAX = 1 << 20


def first_fit_count(sizes: np.ndarray, room: int) -> int:
    """Bins used by first-fit-decreasing (every size <= room)."""
    loads = np.zeros(len(sizes), dtype=np.int64)
    used = 0
    for size in np.sort(np.asarray(sizes, dtype=np.int64))[::-1].tolist():
        if 2 * size > room:
            # Every used bin holds an item >= size, so more than room - size: only a new bin fits.
            loads[used] = size
            used += 1
            continue
        # Bin `used` is empty, so the first bin that fits is among the first used + 1.
        k = int(np.argmax(loads[: used + 1] <= room - size))
        used += k == used
        loads[k] += size
    return used


def pack_best_fit(sizes: np.ndarray, room: int, count: int,
                  groups: np.ndarray | None = None) -> np.ndarray | None:
    """Largest first to the fullest bin it fits (ties: lowest bin) holding no item of its group;
    only empty bins once the items left are as many as the empty bins. None if an item fits nowhere."""
    if count > len(sizes):
        return None
    fit = BestFit(count)
    members = [0] * count
    empties = list(range(count))
    bin_of = np.empty(len(sizes), dtype=np.int64)
    holding = np.zeros((int(groups.max()) + 1, count), dtype=bool) if groups is not None else None
    size_of = np.asarray(sizes, dtype=np.int64).tolist()
    left = len(sizes)
    for i in np.argsort(-sizes, kind="stable").tolist():
        blocked = holding[groups[i]] if holding is not None else None
        if left <= len(empties):
            # Every empty bin has load 0: the lowest one not blocked.
            k = next((e for e in empties if blocked is None or not blocked[e]), -1) if size_of[i] <= room else -1
        else:
            k = fit.find(room - size_of[i], blocked)
        if k < 0:
            return None
        if not members[k]:
            empties.remove(k)
        fit.add(k, size_of[i])
        members[k] += 1
        bin_of[i] = k
        if holding is not None:
            holding[groups[i], k] = True
        left -= 1
    return bin_of


def pack_least_loaded(sizes: np.ndarray, room: int, count: int,
                      groups: np.ndarray | None = None) -> np.ndarray | None:
    """Largest first to the least-loaded bin it fits (ties: lowest bin) holding no item of its group:
    near-equal loads, the start that balancing finishes best when items are few per bin. None if an
    item fits nowhere (or there are fewer items than bins)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    if count > len(sizes):
        return None
    loads = np.zeros(count, dtype=np.int64)
    holding = np.zeros((int(groups.max()) + 1, count), dtype=bool) if groups is not None else None
    bin_of = np.empty(len(sizes), dtype=np.int64)
    blocked_load = np.iinfo(np.int64).max
    for i in np.argsort(-sizes, kind="stable").tolist():
        open_bins = loads <= room - sizes[i]
        if holding is not None:
            open_bins &= ~holding[groups[i]]
        k = int(np.argmin(np.where(open_bins, loads, blocked_load)))
        if not open_bins[k]:
            return None
        loads[k] += sizes[i]
        bin_of[i] = k
        if holding is not None:
            holding[groups[i], k] = True
    # Every bin is used: an empty bin is the least loaded and blocks no group.
    return bin_of


class BestFit:
    """Bin loads kept in order for best fit: the fullest bin with load <= a limit (ties: the
    lowest bin), skipping blocked bins, in O(log K) plus the blocked bins passed over."""

    def __init__(self, count: int) -> None:
        self.loads = [0] * count
        # (load, -bin) ascending: the last key at or below (limit, 0) is the answer.
        self._keys = [(0, -k) for k in range(count - 1, -1, -1)]

    def find(self, limit: int, blocked: np.ndarray | None = None) -> int:
        """The fullest bin with load <= limit and not blocked[bin]; -1 if none."""
        at = bisect.bisect_right(self._keys, (limit, 0))
        while at:
            at -= 1
            k = -self._keys[at][1]
            if blocked is None or not blocked[k]:
                return k
        return -1

    def add(self, k: int, size: int) -> None:
        load = self.loads[k]
        del self._keys[bisect.bisect_left(self._keys, (load, -k))]
        self.loads[k] = load + size
        bisect.insort(self._keys, (load + size, -k))


def critical_path(works: np.ndarray, dp: int) -> int:
    """Σ over slots of the largest work, slots = the works sorted descending, D at a time."""
    return int(np.sort(np.asarray(works, dtype=np.int64))[::-1][::dp].sum())


def naive_critical_path_change(works: np.ndarray, dp: int, lowered: int, delta_low: int,
                               raised: int, delta_high: int) -> int:
    """CP after works[lowered] -= delta_low and works[raised] += delta_high, minus CP before."""
    after = np.asarray(works, dtype=np.int64).copy()
    after[lowered] -= delta_low
    after[raised] += delta_high
    return critical_path(after, dp) - critical_path(works, dp)


class CriticalPathChange:
    """Prices changes of two works against the current works (see the module docstring).

    `ranks`, when given, is kept by the caller: ranks[x] = #{works < x} for 0 <= x < len(ranks)
    (`rank_table`), and every priced value lies in that range; a lookup then replaces the binary
    search per value, which dominates when thousands of candidates are priced per round.
    """

    def __init__(self, works: np.ndarray, dp: int, ranks: np.ndarray | None = None) -> None:
        works = np.asarray(works, dtype=np.int64)
        ascending = np.sort(works)
        count = len(ascending)
        self.works = works
        self.ascending = ascending
        self._ranks = ranks
        # Interval k = (ascending[k - 1], ascending[k]] (ascending[-1] read as 0) has N = count - k;
        # interval `count` is everything above the largest work, N = 0.
        lower = np.concatenate([[0], ascending])
        length = np.concatenate([ascending - lower[:-1], [0]])
        # F_r(x) = #{t in [1, x] : N(t) ≡ r} = base_r[k] + slope_r[k]·x on interval k; rows r = 0 and 1 mod D.
        self._slope = _slopes(count, dp)
        covered = length * self._slope
        self._base = np.cumsum(covered, axis=1) - covered - self._slope * lower
        # The highest t of an N ≡ 1 interval below interval k (-1: none), for `fall_thresholds`.
        tops = np.where((self._slope[1][:count] > 0) & (length[:count] > 0), ascending, -1)
        self._top_below = np.concatenate([[-1], np.maximum.accumulate(tops)]) if count else np.array([-1])
        k = self.rank(works)
        # The highest t <= w with N(t) ≡ 1 for each work w (-1: none). A work w >= 1 lies in
        # interval k = #{works < w}; when N ≡ 1 there, t = w itself counts.
        self._top = np.where((self._slope[1][k] > 0) & (works >= 1), works, self._top_below[k])
        self.zero_at = self._base[0][k] + self._slope[0][k] * works
        """F_0 at each work."""
        self.one_at = self._base[1][k] + self._slope[1][k] * works
        """F_1 at each work."""

    def rank(self, x: np.ndarray) -> np.ndarray:
        """The interval k holding each x: #{works < x}."""
        if self._ranks is not None:
            return self._ranks[x]
        return np.searchsorted(self.ascending, x, side="left")

    def counts(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(F_0(x), F_1(x)): #{t in [1, x] : N(t) ≡ 0}, and ≡ 1, mod D, for each x >= 0."""
        k = self.rank(x)
        return (self._base[0][k] + self._slope[0][k] * x, self._base[1][k] + self._slope[1][k] * x)

    def price(self, low: np.ndarray, delta: np.ndarray, high: np.ndarray) -> np.ndarray:
        """CP change when a work `low` falls by `delta` (>= 0) and another work `high` rises by `delta`."""
        zero_low, one_low = self.counts(low)
        zero_high, one_high = self.counts(high)
        return self._price(low, delta, high, zero_low, one_low, zero_high, one_high)

    def price_bins(self, source: np.ndarray, delta: np.ndarray, target: np.ndarray) -> np.ndarray:
        """`price` of works[source] falling by `delta` and works[target] rising by it."""
        return self._price(self.works[source], delta, self.works[target], self.zero_at[source],
                           self.one_at[source], self.zero_at[target], self.one_at[target])

    def _price(self, low: np.ndarray, delta: np.ndarray, high: np.ndarray, zero_low: np.ndarray,
               one_low: np.ndarray, zero_high: np.ndarray, one_high: np.ndarray) -> np.ndarray:
        fallen, risen = low - delta, high + delta
        # N falls by one on (fallen, low] and rises by one on (high, risen], except on their
        # overlap: (high, low] when fallen <= high < low, (fallen, risen] when high < fallen < risen.
        # Price the rise and the fall outside it.
        around = (fallen <= high) & (high < low)
        inside = (high < fallen) & (fallen < risen)
        rise_to = np.where(inside, fallen, risen)
        fall_to = np.where(inside, risen, fallen)
        k_rise, k_fall = self.rank(rise_to), self.rank(fall_to)
        rise = self._base[0][k_rise] + self._slope[0][k_rise] * rise_to - np.where(around, zero_low, zero_high)
        fall = np.where(around, one_high, one_low) - self._base[1][k_fall] - self._slope[1][k_fall] * fall_to
        return rise - fall

    def can_lower(self, source: np.ndarray, delta: np.ndarray, target: np.ndarray) -> np.ndarray:
        """False where works[source] falling by `delta` and works[target] rising by it cannot lower
        the critical path: outside their overlap, the fall crosses no N ≡ 1 level (saves nothing)."""
        low, high = self.works[source], self.works[target]
        fallen, risen = low - delta, high + delta
        # Outside the overlap the fall is (fallen, high] when fallen <= high < low, (risen, low]
        # when high < fallen < risen, else (fallen, low] (see `_price`).
        around = (fallen <= high) & (high < low)
        start = np.where((high < fallen) & (fallen < risen), risen, fallen)
        return np.where(around, self._top[target], self._top[source]) > start

    def fall_thresholds(self) -> np.ndarray:
        """`fall_thresholds` of the priced works."""
        return np.where(self._top >= 1, self.works - self._top, np.iinfo(np.int64).max // 4)


@functools.lru_cache(maxsize=64)
def _slopes(count: int, dp: int) -> np.ndarray:
    """[2, count + 1]: whether N = count - k ≡ 0 (row 0), and ≡ 1 (row 1), mod D on interval k."""
    level = (count - np.arange(count + 1)) % dp
    slopes = (level == np.array([[0], [1 % dp]])).astype(np.int64)
    slopes.flags.writeable = False
    return slopes


def rank_table(works: np.ndarray, limit: int) -> np.ndarray:
    """ranks[x] = #{works < x} for 0 <= x <= limit (works >= 0): `CriticalPathChange`'s lookup."""
    ascending = np.sort(np.asarray(works, dtype=np.int64))
    assert len(ascending) == 0 or ascending[0] >= 0
    edges = np.concatenate([[-1], np.minimum(ascending, limit), [limit]])
    return np.repeat(np.arange(len(ascending) + 1, dtype=np.int64), np.diff(edges))


def fall_thresholds(works: np.ndarray, dp: int) -> np.ndarray:
    """Per work w: the largest δ for which lowering w by δ saves nothing (w - the highest t <= w
    with N(t) ≡ 1 mod D; a large sentinel when there is none). Lowering by more saves >= 1.

    With the works sorted descending s_0 >= s_1 >= ... (s_K read as 0), N(t) = j on (s_j, s_{j-1}],
    so N ≡ 1 on the levels (s_j, s_{j-1}] with j ≡ 1 mod D: slot leaders above their slot mates.
    """
    return CriticalPathChange(works, dp).fall_thresholds()


def balance(sizes: np.ndarray, bin_of: np.ndarray, count: int, dp: int, *, base: int, capacity: int,
            max_rounds: int, batch: int = 128, groups: np.ndarray | None = None) -> np.ndarray:
    """Lower the critical path of bins with works base + Σ sizes by moves and swaps of items.

    Each round prices every move (an item to another bin it fits, its own bin keeping an item)
    and every swap of a larger with a smaller item of another bin whose bin can take the
    difference, except those whose lowered work crosses no N ≡ 1 level outside the overlap with
    the raised one (they cannot lower CP; `fall_thresholds`, `CriticalPathChange.can_lower`) and
    those that would put two items of one group in a bin; then takes the `batch` best priced
    candidates (ties: moves before swaps, each in enumeration order), each only if it is still
    valid and the recomputed critical path drops. Stops when a round takes nothing or after
    `max_rounds`. Deterministic. Returns the new `bin_of` (the input is not modified).
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    bin_of = np.asarray(bin_of, dtype=np.int64).copy()
    works = base + np.bincount(bin_of, weights=sizes, minlength=count).astype(np.int64)
    assert base >= 0 and works.max(initial=0) <= capacity, "the rank table covers works in [0, capacity]"
    members = np.bincount(bin_of, minlength=count)
    by_size = np.argsort(sizes, kind="stable")
    ascending_sizes = sizes[by_size]
    # The first size position of a strictly larger item, for each size position.
    above = np.searchsorted(ascending_sizes, ascending_sizes, side="right")
    if groups is not None:
        holding = np.zeros((int(groups.max()) + 1, count), dtype=bool)
        holding[groups, bin_of] = True
    # Every priced value lies in [0, capacity]; up to a size, a rank table (updated with the
    # works) beats a binary search per value.
    ranks = rank_table(works, capacity) if capacity <= _RANK_TABLE_MAX else None
    # The works as a sorted list: the critical path of a trial is a slice of it, summed.
    ordered = sorted(works.tolist())
    lead = (count - 1) % dp
    current = sum(ordered[lead::dp])
    size_of = sizes.tolist()
    for _ in range(max_rounds if dp > 1 else 0):
        pricing = CriticalPathChange(works, dp, ranks)
        threshold = pricing.fall_thresholds()[bin_of]
        # Moves: an item whose removal crosses an N ≡ 1 level, to every bin it fits.
        movable = np.flatnonzero((sizes > threshold) & (members[bin_of] > 1))
        by_work = np.argsort(works, kind="stable")
        fits = np.searchsorted(works[by_work], capacity - sizes[movable], side="right")
        items = np.repeat(movable, fits)
        targets = by_work[np.arange(len(items)) - np.repeat(np.cumsum(fits) - fits, fits)]
        # Swaps: x's bin falls by sizes[x] - sizes[y] (past its threshold), y's bin rises by as
        # much. In size order, the larger partners x that y's bin can take are a range.
        bin_by_size = bin_of[by_size]
        within = np.searchsorted(ascending_sizes, ascending_sizes + (capacity - works[bin_by_size]), side="right")
        spans = within - above
        smaller = np.repeat(np.arange(len(sizes)), spans)
        larger = np.arange(len(smaller)) - np.repeat(np.cumsum(spans) - spans - above, spans)
        # Candidate c: a move (c < len(items)), then a swap of by_size[larger] with by_size[smaller];
        # those that cannot lower the critical path are dropped before pricing (most are).
        source_bins = np.concatenate([bin_of[items], bin_by_size[larger]])
        deltas = np.concatenate([sizes[items], ascending_sizes[larger] - ascending_sizes[smaller]])
        target_bins = np.concatenate([targets, bin_by_size[smaller]])
        allowed = (source_bins != target_bins) & pricing.can_lower(source_bins, deltas, target_bins)
        if groups is not None:
            first = np.concatenate([groups[items], groups[by_size[larger]]])
            second = np.concatenate([np.full(len(items), -1), groups[by_size[smaller]]])
            # A move must not join its group; a swap of two groups must not join either.
            allowed &= ((first == second) | ~holding[first, target_bins]) & ((second < 0) | (first == second)
                                                                             | ~holding[second, source_bins])
        chosen = np.flatnonzero(allowed)
        changes = pricing.price_bins(source_bins[chosen], deltas[chosen], target_bins[chosen])
        better = np.flatnonzero(changes < 0)
        if not len(better):
            break
        if len(better) > batch:
            # Only changes up to the batch-th smallest (ties included) can be among the best.
            better = better[changes[better] <= np.partition(changes[better], batch - 1)[batch - 1]]
        # Ties go to the earlier candidate: moves, then swaps by x and by y's size position.
        candidate = chosen[better]
        move = candidate < len(items)
        swap = candidate[~move] - len(items)
        position = candidate.copy()
        position[~move] = len(items) + by_size[larger[swap]] * len(sizes) + smaller[swap]
        best = candidate[np.lexsort((position, changes[better]))][:batch]
        # Per candidate: the item x leaving its bin, and either a target bin (a move, y = -1)
        # or the item y it swaps with (target = -1: y's bin).
        move = best < len(items)
        swap = best[~move] - len(items)
        xs, ys, ts = np.full((3, len(best)), -1, dtype=np.int64)
        xs[move], ts[move] = items[best[move]], targets[best[move]]
        xs[~move], ys[~move] = by_size[larger[swap]], by_size[smaller[swap]]
        xs, ys, ts = xs.tolist(), ys.tolist(), ts.tolist()
        bin_list, work_list, member_list = bin_of.tolist(), works.tolist(), members.tolist()
        taken = 0
        for x, y, target in zip(xs, ys, ts):
            source = bin_list[x]
            if y < 0:
                delta = size_of[x]
                if source == target or member_list[source] < 2:
                    continue
            else:
                target = bin_list[y]
                delta = size_of[x] - size_of[y]
                if source == target:
                    continue
            if work_list[target] + delta > capacity:
                continue
            if groups is not None and (holding[groups[x], target] and (y < 0 or groups[y] != groups[x])
                                       or y >= 0 and groups[y] != groups[x] and holding[groups[y], source]):
                continue
            low, high = work_list[source], work_list[target]
            trial = ordered.copy()
            del trial[bisect.bisect_left(trial, low)]
            bisect.insort(trial, low - delta)
            del trial[bisect.bisect_left(trial, high)]
            bisect.insort(trial, high + delta)
            path = sum(trial[lead::dp])
            if path >= current:
                continue
            ordered, current = trial, path
            taken += 1
            work_list[source], work_list[target] = low - delta, high + delta
            if ranks is not None:
                ranks[low - delta + 1 : low + 1] += 1
                ranks[high + 1 : high + delta + 1] -= 1
            bin_list[x] = target
            if groups is not None:
                holding[groups[x], source], holding[groups[x], target] = False, True
            if y >= 0:
                bin_list[y] = source
                if groups is not None:
                    holding[groups[y], target], holding[groups[y], source] = False, True
                    holding[groups[x], target] = True
            else:
                member_list[source] -= 1
                member_list[target] += 1
        if not taken:
            break
        bin_of = np.asarray(bin_list, dtype=np.int64)
        works = np.asarray(work_list, dtype=np.int64)
        members = np.asarray(member_list, dtype=np.int64)
    return bin_of
