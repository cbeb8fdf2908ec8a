"""Work of sets of trajectories in sorted-rank space, from lengths and adjacent LCPs only.

`RankWork(index)` renames trajectories by their lexicographic rank r (0 <= r < N) and answers,
without touching tokens:
- `lcp(a, b)`: LCP of ranks a != b = min(lcp[min+1 .. max]) (sparse table, O(1));
- `run_cost(i, j)`: trie size of the contiguous run i..j-1 = Σ len - Σ adjacent LCP (prefix sums;
  `run_costs` for arrays of runs);
- `trie(ranks)`: trie size of any sorted rank list = Σ len - Σ LCP of consecutive members (the
  trie of a set is the trie of its sorted sequence, so this holds for non-contiguous sets too);
- `share(ranks, x, skip)`: the longest prefix x shares with a sorted set (its sorted neighbours
  there, optionally ignoring one member), so adding x costs len(x) - share and removing it
  saves the same;
- `insert_cost(ranks, block)` and `cheapest_split(ranks)`: the same arithmetic for blocks;
- `deepest[r]`: the most rank r shares with any other (its larger adjacent LCP), a bound on every `share`;
- `root_subtrees(ranks)` and `clusters(members)`: a sorted set split under its own root fork, or
  where only the step's common prefix g0 is shared (task trees).

Also the helpers shared by the planners to reach K ≡ 0 mod D: `split_to_multiple` (cheapest
splits), `pad_to_dp` (empty microbatches, only below D trajectories) and `no_plan_error`.

Legend: N trajectories; L[r] tokens of rank r; lcp[r] = LCP(rank r - 1, rank r), lcp[0] = 0.
Tested against `PrefixIndex.segment_tree(members).num_compact_tokens` on random sets.
"""

from __future__ import annotations

import bisect
import functools

import numpy as np

from harts.trees.trie import PrefixIndex


class RankWork:
    def __init__(self, index: PrefixIndex) -> None:
        self.order = index.order
        """int64 [N] rank -> trajectory index."""
        self.rank = index.rank
        """int64 [N] trajectory index -> rank."""
        self.num = len(index.order)
        self.L = index.lengths[index.order].astype(np.int64)
        """int64 [N] tokens of each rank."""
        self.lcp_adjacent = index.lcp.astype(np.int64)
        self.lengths_list: list[int] = self.L.tolist()
        self.cum_len = np.concatenate([[0], np.cumsum(self.L)])
        """Σ L[:j] at j."""
        self.cum_lcp = np.concatenate([[0], np.cumsum(self.lcp_adjacent)])
        """Σ lcp[:j] at j."""
        self.common_prefix = int(self.lcp_adjacent[1:].min()) if self.num > 1 else 0
        """g0: the prefix every trajectory shares (0 when the step is a forest)."""

    @functools.cached_property
    def deepest(self) -> list[int]:
        """The most each rank shares with any other: the larger of its two adjacent LCPs (0 for a lone rank)."""
        after = np.concatenate([self.lcp_adjacent[1:], [0]])
        return np.maximum(self.lcp_adjacent, after).tolist()

    @functools.cached_property
    def _table(self) -> list[list[int]]:
        # Python lists: the refinement queries single pairs, where list indexing beats numpy.
        # Built on first use: whole-cluster packing never queries a pair.
        table = [self.lcp_adjacent.tolist()]
        span = 1
        while 2 * span <= self.num:
            previous = table[-1]
            table.append([min(a, b) for a, b in zip(previous[:-span], previous[span:])])
            span *= 2
        return table

    def lcp(self, a: int, b: int) -> int:
        if a > b:
            a, b = b, a
        assert a < b
        level = (b - a).bit_length() - 1
        row = self._table[level]
        x, y = row[a + 1], row[b + 1 - (1 << level)]
        return x if x < y else y

    def run_cost(self, i: int, j: int) -> int:
        """Trie size of ranks i .. j - 1 (i < j)."""
        return int(self.cum_len[j] - self.cum_len[i] - (self.cum_lcp[j] - self.cum_lcp[i + 1]))

    def run_costs(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        """`run_cost` of each pair of i[k] < j[k], vectorised."""
        return (self.cum_len[j] - self.cum_len[i]) - (self.cum_lcp[j] - self.cum_lcp[i + 1])

    def trie(self, ranks: list[int]) -> int:
        """Trie size of a sorted list of distinct ranks."""
        if not ranks:
            return 0
        lengths = self.lengths_list
        table = self._table
        total = lengths[ranks[0]]
        # The sparse-table query inlined: this loop is the refinement's hottest path.
        for a, b in zip(ranks, ranks[1:]):
            level = (b - a).bit_length() - 1
            row = table[level]
            x, y = row[a + 1], row[b + 1 - (1 << level)]
            total += lengths[b] - (x if x < y else y)
        return total

    def share(self, ranks: list[int], x: int, skip: int = -1) -> int:
        """Longest prefix rank x shares with the sorted list `ranks`, x and `skip` excluded."""
        at = bisect.bisect_left(ranks, x)
        before, after = at - 1, at
        if before >= 0 and ranks[before] == skip:
            before -= 1
        size = len(ranks)
        while after < size and (ranks[after] == x or ranks[after] == skip):
            after += 1
        table = self._table
        best = 0
        # Sparse-table queries inlined (hot path): LCP(a, b) = min(lcp[a + 1 .. b]).
        if before >= 0:
            a = ranks[before]
            level = (x - a).bit_length() - 1
            row = table[level]
            u, v = row[a + 1], row[x + 1 - (1 << level)]
            best = u if u < v else v
        if after < size:
            b = ranks[after]
            level = (b - x).bit_length() - 1
            row = table[level]
            u, v = row[x + 1], row[b + 1 - (1 << level)]
            if v < u:
                u = v
            if u > best:
                best = u
        return best

    def insert_cost(self, ranks: list[int], block: list[int]) -> int:
        """trie(ranks ∪ block) - trie(ranks) for a sorted block disjoint from the sorted `ranks`."""
        if not ranks:
            return self.trie(block)
        at = bisect.bisect_left(ranks, block[0])
        if at < len(ranks) and ranks[at] < block[-1]:
            # The block interleaves the members: recount the merged trie.
            return self.trie(sorted(ranks + block)) - self.trie(ranks)
        # Inserting between neighbours p < block < s replaces LCP(p, s) by LCP(p, b0) + LCP(b-1, s).
        cost = self.trie(block)
        if at > 0:
            cost -= self.lcp(ranks[at - 1], block[0])
        if at < len(ranks):
            cost -= self.lcp(block[-1], ranks[at])
        if 0 < at < len(ranks):
            cost += self.lcp(ranks[at - 1], ranks[at])
        return cost

    def root_subtrees(self, ranks: list[int]) -> list[list[int]]:
        """Sorted ranks (>= 2) split where consecutive members share only the set's common prefix: the
        subtrees under the set's root fork."""
        shared = [self.lcp(a, b) for a, b in zip(ranks, ranks[1:])]
        root = min(shared)
        runs = [[ranks[0]]]
        for depth, b in zip(shared, ranks[1:]):
            if depth == root:
                runs.append([b])
            else:
                runs[-1].append(b)
        return runs

    def clusters(self, members: list[int]) -> list[list[int]]:
        """Sorted members split where consecutive members share only the step's common prefix g0 (the
        task trees among them, or their pieces)."""
        if not members:
            return []
        out = [[members[0]]]
        for a, b in zip(members, members[1:]):
            if self.lcp(a, b) == self.common_prefix:
                out.append([b])
            else:
                out[-1].append(b)
        return out

    def cheapest_split(self, ranks: list[int]) -> tuple[int, int]:
        """(cost, position): splitting `ranks` into [:position] and [position:] adds `cost` work."""
        assert len(ranks) >= 2
        costs = [self.lcp(a, b) for a, b in zip(ranks, ranks[1:])]
        position = int(np.argmin(costs))
        return costs[position], position + 1


def pad_to_dp(bins: list[list[int]], num: int, dp: int) -> list[list[int]]:
    """Fewer than D trajectories: pad with empty microbatches up to D (the only case allowed)."""
    if num < dp and len(bins) < dp:
        return bins + [[] for _ in range(dp - len(bins))]
    return bins


def no_plan_error(num: int, dp: int, capacity: int) -> ValueError:
    return ValueError(
        f"no plan: {num} trajectories cannot form a multiple of D = {dp} non-empty microbatches "
        f"of at most {capacity:,} compact tokens"
    )


def split_to_multiple(rw: RankWork, bins: list[list[int]], dp: int) -> list[list[int]] | None:
    """K ≡ 0 mod D by the cheapest splits (each adds the LCP at its cut); None if too few members."""
    split = [list(b) for b in bins]
    while len(split) % dp:
        scored = [(rw.cheapest_split(b)[0], k) for k, b in enumerate(split) if len(b) >= 2]
        if not scored:
            return None
        k = min(scored)[1]
        position = rw.cheapest_split(split[k])[1]
        split[k:k + 1] = [split[k][:position], split[k][position:]]
    return split
