"""Whole-cluster packing: clusters into K microbatches, then slot balancing by moves and swaps.

A cluster is a maximal run of the sorted order whose neighbours share more than g0, the prefix
every trajectory of the step shares (`RankWork.common_prefix`); two trajectories of different
clusters share exactly g0. A microbatch of whole clusters therefore has work g0 + Σ m_c with
m_c = trie(c) - g0, and a plan of K such microbatches has W = C + (K - 1)·g0: W depends on K
alone, and since every adjacent LCP is >= g0 the bound of `harts.planning.bounds` shows that no
plan with K or more microbatches has less W. So the work of a whole-cluster plan is settled by
its count, and what is left is the slot critical path: this module packs item sizes (the m_c)
into bins of room T - g0 and balances them; `harts_planner` turns bins into microbatches.

Provides (items: int64 sizes [P]; bins: `bin_of` int64 [P], 0 <= bin < count):
- `first_fit_count(sizes, room)`: bins used by first-fit-decreasing (K is it rounded up to D);
- `pack_best_fit(sizes, room, count)`: largest first to the fullest bin it fits, keeping one
  item for every still-empty bin (bins filled near the room form tight slots at the top);
- `critical_path(works, dp)`: Σ over slots of the largest work under the sorted grouping of
  `harts.planning.microbatch.objective`;
- `CriticalPathChange(works, dp).price(...)`: the exact change of the critical path when one
  work falls by δ and another rises by δ, vectorised; `naive_critical_path_change` (sort and
  sum) is its reference;
- `balance(sizes, bin_of, count, dp, base, capacity, max_rounds)`: descent over moves of one
  item and swaps of two items that lowers the critical path; never raises it, never leaves a
  bin empty, never exceeds the capacity (tested on random instances).

Identity behind the pricing: with N(t) = #{k : work_k >= t}, slot s of the sorted grouping has
its largest work >= t iff N(t) > s·D, so CP = Σ_{t >= 1} ⌈N(t)/D⌉. Lowering one work from u to
u - δ lowers CP by #{t in (u - δ, u] : N(t) ≡ 1 mod D}; raising one from v to v + δ raises it
by #{t in (v, v + δ] : N(t) ≡ 0 mod D}; where the two intervals overlap N is unchanged. Prefix
sums of both counts over the sorted works price every candidate in O(log K).

Legend: P items, K (`count`) bins, D replicas (`dp`).
"""

from __future__ import annotations

import numpy as np


def first_fit_count(sizes: np.ndarray, room: int) -> int:
    """Bins used by first-fit-decreasing (every size <= room)."""
    loads = np.zeros(len(sizes), dtype=np.int64)
    used = 0
    for size in np.sort(np.asarray(sizes, dtype=np.int64))[::-1].tolist():
        fits = np.flatnonzero(loads[:used] <= room - size)
        k = int(fits[0]) if len(fits) else used
        used += k == used
        loads[k] += size
    return used


def pack_best_fit(sizes: np.ndarray, room: int, count: int,
                  groups: np.ndarray | None = None) -> np.ndarray | None:
    """Largest first to the fullest bin it fits (ties: lowest bin) holding no item of its group;
    only empty bins once the items left are as many as the empty bins. None if an item fits nowhere."""
    if count > len(sizes):
        return None
    loads = np.zeros(count, dtype=np.int64)
    members = np.zeros(count, dtype=np.int64)
    bin_of = np.empty(len(sizes), dtype=np.int64)
    held = _Held(groups, count)
    left = len(sizes)
    empty = count
    for i in np.argsort(-sizes, kind="stable").tolist():
        fits = held.free(i, loads) <= room - sizes[i]
        if left <= empty:
            fits &= members == 0
        candidates = np.flatnonzero(fits)
        if not len(candidates):
            return None
        k = int(candidates[np.argmax(loads[candidates])])
        empty -= members[k] == 0
        loads[k] += sizes[i]
        members[k] += 1
        bin_of[i] = k
        held.add(i, k)
        left -= 1
    return bin_of


class _Held:
    """Which bins hold an item of each group (pieces of one cluster never share a bin)."""

    def __init__(self, groups: np.ndarray | None, count: int) -> None:
        self.groups = groups
        if groups is not None:
            self.holding = np.zeros((int(groups.max()) + 1, count), dtype=bool)

    def free(self, item: int, loads: np.ndarray) -> np.ndarray:
        """The loads, with bins holding the item's group made full."""
        if self.groups is None:
            return loads
        return np.where(self.holding[self.groups[item]], np.iinfo(np.int64).max // 4, loads)

    def add(self, item: int, k: int) -> None:
        if self.groups is not None:
            self.holding[self.groups[item], k] = True


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
    """Prices changes of two works against the current works (see the module docstring)."""

    def __init__(self, works: np.ndarray, dp: int) -> None:
        ascending = np.sort(np.asarray(works, dtype=np.int64))
        count = len(ascending)
        self.ascending = ascending
        # Interval k = (ascending[k - 1], ascending[k]] (ascending[-1] read as 0) has N = count - k;
        # interval `count` is everything above the largest work, N = 0.
        lower = np.concatenate([[0], ascending])
        length = np.diff(np.concatenate([lower, [lower[-1]]]))
        level = (count - np.arange(count + 1)) % dp
        # F_r(x) = #{t in [1, x] : N(t) ≡ r} = base_r[k] + slope_r[k]·x on interval k, r = 0 and 1 mod D.
        self._base, self._slope = [], []
        for residue in (0, 1 % dp):
            slope = (level == residue).astype(np.int64)
            cumulative = np.concatenate([[0], np.cumsum(length * slope)[:-1]])
            self._base.append(cumulative - slope * lower)
            self._slope.append(slope)

    def counts(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(F_0(x), F_1(x)): #{t in [1, x] : N(t) ≡ 0}, and ≡ 1, mod D, for each x >= 0."""
        k = np.searchsorted(self.ascending, x, side="left")
        return (self._base[0][k] + self._slope[0][k] * x, self._base[1][k] + self._slope[1][k] * x)

    def price(self, low: np.ndarray, delta: np.ndarray, high: np.ndarray) -> np.ndarray:
        """CP change when a work `low` falls by `delta` (>= 0) and another work `high` rises by `delta`."""
        zero_low, one_low = self.counts(low)
        zero_high, _ = self.counts(high)
        return self.price_known(low, delta, high, one_low, zero_high)

    def price_known(self, low: np.ndarray, delta: np.ndarray, high: np.ndarray, one_low: np.ndarray,
                    zero_high: np.ndarray) -> np.ndarray:
        """`price` given F_1(low) and F_0(high) (for works, known once per round)."""
        _, one_fallen = self.counts(low - delta)
        zero_risen, _ = self.counts(high + delta)
        return (zero_risen - zero_high) - (one_low - one_fallen) + self.overlap(low, delta, high)

    def overlap(self, low: np.ndarray, delta: np.ndarray, high: np.ndarray) -> np.ndarray:
        """The correction of the overlap of (low - delta, low] and (high, high + delta], where N
        does not change: both counts there, undone."""
        start = np.maximum(low - delta, high)
        stop = np.minimum(low, high + delta)
        fix = np.zeros(len(start), dtype=np.int64)
        both = np.flatnonzero(stop > start)
        if len(both):
            zero_stop, one_stop = self.counts(stop[both])
            zero_start, one_start = self.counts(start[both])
            fix[both] = (one_stop - one_start) - (zero_stop - zero_start)
        return fix


def fall_thresholds(works: np.ndarray, dp: int) -> np.ndarray:
    """Per work w: the largest δ for which lowering w by δ saves nothing (w - the highest t <= w
    with N(t) ≡ 1 mod D; a large sentinel when there is none). Lowering by more saves >= 1.

    With the works sorted descending s_0 >= s_1 >= ... (s_K read as 0), N(t) = j on (s_j, s_{j-1}],
    so N ≡ 1 on the levels (s_j, s_{j-1}] with j ≡ 1 mod D: slot leaders above their slot mates.
    """
    works = np.asarray(works, dtype=np.int64)
    descending = np.concatenate([np.sort(works)[::-1], [0]])
    j = np.arange(1 % dp or dp, len(works) + 1, dp)
    low, high = descending[j], descending[j - 1]
    nonempty = low < high
    low, high = low[nonempty], high[nonempty]
    reach = low[None, :] < works[:, None]
    top = np.where(reach, np.minimum(works[:, None], high[None, :]), -1).max(axis=1, initial=-1)
    return np.where(top >= 0, works - top, np.iinfo(np.int64).max // 4)


def balance(sizes: np.ndarray, bin_of: np.ndarray, count: int, dp: int, *, base: int, capacity: int,
            max_rounds: int, batch: int = 128, groups: np.ndarray | None = None) -> np.ndarray:
    """Lower the critical path of bins with works base + Σ sizes by moves and swaps of items.

    Each round prices every move (an item to another bin it fits, its own bin keeping an item)
    and every swap of a larger with a smaller item of another bin whose bin can take the
    difference, except those whose lowered work crosses no N ≡ 1 level (they cannot lower CP;
    `fall_thresholds`) and those that would put two items of one group in a bin; then takes
    the `batch` best priced candidates in order, each only if it is still valid and the
    recomputed critical path drops. Stops when a round takes nothing or after `max_rounds`.
    Deterministic. Returns the new `bin_of` (the input is not modified).
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    bin_of = np.asarray(bin_of, dtype=np.int64).copy()
    works = base + np.bincount(bin_of, weights=sizes, minlength=count).astype(np.int64)
    members = np.bincount(bin_of, minlength=count)
    by_size = np.argsort(sizes, kind="stable")
    ascending_sizes = sizes[by_size]
    if groups is not None:
        holding = np.zeros((int(groups.max()) + 1, count), dtype=bool)
        holding[groups, bin_of] = True
    current = critical_path(works, dp)
    for _ in range(max_rounds if dp > 1 else 0):
        pricing = CriticalPathChange(works, dp)
        zero_at, one_at = pricing.counts(works)
        threshold = fall_thresholds(works, dp)[bin_of]
        # Moves: an item whose removal crosses an N ≡ 1 level, to every bin it fits.
        movable = np.flatnonzero((sizes > threshold) & (members[bin_of] > 1))
        by_work = np.argsort(works, kind="stable")
        fits = np.searchsorted(works[by_work], capacity - sizes[movable], side="right")
        items = np.repeat(movable, fits)
        targets = by_work[np.arange(len(items)) - np.repeat(np.cumsum(fits) - fits, fits)]
        allowed = targets != bin_of[items]
        if groups is not None:
            allowed &= ~holding[groups[items], targets]
        items, targets = items[allowed], targets[allowed]
        sources = bin_of[items]
        move_change = pricing.price_known(works[sources], sizes[items], works[targets],
                                          one_at[sources], zero_at[targets])
        # Swaps: x's bin falls by sizes[x] - sizes[y] > its threshold, y's bin rises by as much;
        # the partners of x are a range of the items by size.
        lowest = np.searchsorted(ascending_sizes, sizes - (capacity - works.min()), side="left")
        highest = np.maximum(np.searchsorted(ascending_sizes, sizes - threshold, side="left"), lowest)
        spans = highest - lowest
        swap_larger = np.repeat(np.arange(len(sizes)), spans)
        swap_smaller = by_size[np.arange(len(swap_larger)) - np.repeat(np.cumsum(spans) - spans - lowest, spans)]
        left, right = bin_of[swap_larger], bin_of[swap_smaller]
        step = sizes[swap_larger] - sizes[swap_smaller]
        allowed = (left != right) & (works[right] <= capacity - step)
        if groups is not None:
            first, second = groups[swap_larger], groups[swap_smaller]
            allowed &= (first == second) | ~(holding[first, right] | holding[second, left])
        chosen = np.flatnonzero(allowed)
        swap_larger, swap_smaller = swap_larger[chosen], swap_smaller[chosen]
        left, right = left[chosen], right[chosen]
        swap_change = pricing.price_known(works[left], step[chosen], works[right], one_at[left], zero_at[right])

        changes = np.concatenate([move_change, swap_change])
        better = np.flatnonzero(changes < 0)
        if not len(better):
            break
        taken = 0
        for c in better[np.argsort(changes[better], kind="stable")][:batch].tolist():
            if c < len(items):
                x, y = int(items[c]), -1
                source, target = int(bin_of[x]), int(targets[c])
                delta = int(sizes[x])
                if source == target or members[source] < 2:
                    continue
            else:
                x, y = int(swap_larger[c - len(items)]), int(swap_smaller[c - len(items)])
                source, target = int(bin_of[x]), int(bin_of[y])
                delta = int(sizes[x] - sizes[y])
                if source == target:
                    continue
            if works[target] + delta > capacity:
                continue
            if groups is not None and (holding[groups[x], target] and (y < 0 or groups[y] != groups[x])
                                       or y >= 0 and groups[y] != groups[x] and holding[groups[y], source]):
                continue
            works[source] -= delta
            works[target] += delta
            trial = critical_path(works, dp)
            if trial >= current:
                works[source] += delta
                works[target] -= delta
                continue
            current = trial
            taken += 1
            bin_of[x] = target
            if groups is not None:
                holding[groups[x], source], holding[groups[x], target] = False, True
            if y >= 0:
                bin_of[y] = source
                if groups is not None:
                    holding[groups[y], target], holding[groups[y], source] = False, True
                    holding[groups[x], target] = True
            else:
                members[source] -= 1
                members[target] += 1
        if not taken:
            break
    return bin_of
