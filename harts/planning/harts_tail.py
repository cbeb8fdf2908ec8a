"""The HARTS planner's slot-tail pass (`refine_tail`): the most imbalanced slots of a plan made more even without
raising its objective.

The objective's slot term, the critical path Σ_slots max_k work_k, is the sum of each slot's absolute gap
(max - mean) plus W/D, so a descent on it leaves slots whose gap is small in tokens but large against their mean:
on GRPO steps, where groups larger than T are split into pieces of a few thousand tokens, the lightest slots keep
2-5% imbalance (max/mean - 1, DESIGN §2) beside slots at 0.1%. This pass works on the relative imbalance itself.

Changes: move a unit of one microbatch to another, or swap two units of two microbatches. A unit is a run of a
microbatch's sorted members: one of its clusters (members sharing more than g0, the step's common prefix) or a
root-level subtree of one, recursively to `tail_unit_depth` levels (one by default: a split group's samples
under its prompt). A change is taken only when the plan's objective (W, critical path, largest
replica) does not rise and the slot imbalances, sorted in decreasing order, fall lexicographically (the largest
falls, or stays and the next falls, ...): so no change gives back tokens, and the pass ends. Slots are those of
the greedy assignment (`plans.greedy_assignment`), so a plan is its microbatches' works.

Search: the slots above `tail_target`, most imbalanced first; for the slot in focus, every move of a unit out of
its heaviest microbatch (to any other), into one of its other microbatches (from any other), and every swap of a
unit of one of its microbatches with a unit of any other microbatch, within the capacity and not raising W.
Prices: removing a unit saves its trie minus what it shares with its neighbours in the member list; inserting it
costs trie(unit) - g0 where the microbatch holds no member of its cluster (clusters share exactly g0), else its trie
less what it shares with its sorted neighbours there (`_Plan.insertion`, `RankWork.insert_cost` given both tries).
A microbatch's trie is g0 plus each cluster's part beyond g0, so a swap of units of two clusters is priced by adding
the two moves, and a swap within one cluster on the member lists without the leaving unit: every price is exact.
The candidates are ranked by the focus slot's new imbalance with its microbatches kept together, and the best
`tail_candidates` are weighed on the whole plan (every slot's imbalance, W, critical path, largest replica); the
best that lowers the sorted imbalances is taken. When no candidate helps a slot, the next is tried; the pass ends
when none helps or after `tail_max_changes` changes.

Tested in tests/planning/test_harts_tail.py: prices against recounted tries, the invariants (coverage, count,
capacity, never more W, never a larger objective, sorted imbalances never larger) on random GRPO-shaped steps,
and `slot_imbalances` against the slots of `plans.greedy_assignment`.
"""

from __future__ import annotations

import bisect

import numpy as np

from harts.planning.harts_search import HartsConfig
from harts.planning.plans import objective
from harts.planning.rank_work import RankWork


def slot_imbalances(works: np.ndarray, dp: int) -> np.ndarray:
    """[..., K] works -> [..., K/D] max/mean - 1 of each slot of the greedy assignment (0 for an all-empty slot),
    in slot order (slot 0 holds the heaviest microbatches)."""
    works = np.asarray(works)
    slots = -np.sort(-works, axis=-1).reshape(*works.shape[:-1], works.shape[-1] // dp, dp)
    mean = slots.sum(axis=-1) / dp
    return np.where(mean > 0, slots[..., 0] / np.where(mean > 0, mean, 1) - 1, 0.0)


class _Plan:
    """Microbatches (sorted rank lists), their works, each cluster's members per microbatch, and each microbatch's
    units as arrays: member-list slices [lo, hi), the work their removal saves, trie - g0, cluster."""

    def __init__(self, rw: RankWork, bins: list[list[int]], capacity: int, depth: int) -> None:
        self.rw = rw
        self.capacity = capacity
        self.depth = depth
        self.g0 = rw.common_prefix
        starts = np.ones(rw.num, dtype=bool)
        starts[1:] = rw.lcp_adjacent[1:] == self.g0
        self.cluster_of = np.cumsum(starts) - 1
        self.bins = [list(b) for b in bins]
        self.works = np.asarray([rw.trie(b) for b in self.bins], dtype=np.int64)
        self.holds = np.zeros((int(self.cluster_of[-1]) + 1, len(bins)), dtype=np.int64)
        for k, members in enumerate(self.bins):
            np.add.at(self.holds[:, k], self.cluster_of[members], 1)
        self.units = [self._units(k) for k in range(len(bins))]

    def _units(self, k: int) -> dict[str, np.ndarray]:
        rw, members = self.rw, self.bins[k]
        slices: list[tuple[int, int]] = []
        pending = []
        start = 0
        for cluster in rw.clusters(members):
            pending.append((start, start + len(cluster), 0))
            start += len(cluster)
        while pending:
            lo, hi, level = pending.pop()
            if hi - lo < len(members):
                slices.append((lo, hi))
            if level < self.depth and hi - lo >= 2:
                at = lo
                for part in rw.root_subtrees(members[lo:hi]):
                    pending.append((at, at + len(part), level + 1))
                    at += len(part)
        slices.sort()
        count = len(members)
        # Consecutive members' LCPs: the trie of members[lo:hi] is Σ L - Σ shared[lo + 1 : hi].
        shared = np.zeros(count + 1, dtype=np.int64)
        shared[1:count] = [rw.lcp(a, b) for a, b in zip(members, members[1:])]
        lengths = np.cumsum(np.concatenate([[0], rw.L[members]]))
        links = np.cumsum(shared)
        lo = np.asarray([s for s, _ in slices], dtype=np.int64)
        hi = np.asarray([e for _, e in slices], dtype=np.int64)
        trie = lengths[hi] - lengths[lo] - (links[np.maximum(hi - 1, lo)] - links[lo])
        # Removing a slice drops its links to both neighbours and joins them (their LCP is the smaller link).
        inner = (lo > 0) & (hi < count)
        save = trie - shared[lo] - np.where(hi < count, shared[np.minimum(hi, count)], 0)
        save = save + np.where(inner, np.minimum(shared[lo], shared[np.minimum(hi, count)]), 0)
        return {"lo": lo, "hi": hi, "save": save, "plain": trie - self.g0,
                "cluster": self.cluster_of[np.asarray(members, dtype=np.int64)[lo]] if len(lo) else lo}

    def ranks(self, k: int, u: int) -> list[int]:
        units = self.units[k]
        return self.bins[k][int(units["lo"][u]) : int(units["hi"][u])]

    def gains(self, unit_bin: np.ndarray, unit: np.ndarray, plain: np.ndarray, cluster: np.ndarray,
              target: np.ndarray) -> np.ndarray:
        """Work microbatch target[i] gains with unit[i] of microbatch unit_bin[i] added (arrays broadcast)."""
        unit_bin, unit, plain, cluster, target = np.broadcast_arrays(unit_bin, unit, plain, cluster, target)
        gains = plain.astype(np.int64)
        for i in zip(*np.nonzero((self.holds[cluster, target] > 0) & (unit_bin != target))):
            t = int(target[i])
            gains[i] = self.insertion(self.bins[t], int(self.works[t]), self.ranks(int(unit_bin[i]), int(unit[i])),
                                      int(plain[i]) + self.g0)
        return gains

    def insertion(self, members: list[int], members_trie: int, block: list[int], block_trie: int) -> int:
        """trie(members ∪ block) - trie(members) for a sorted block disjoint from the sorted members, given both tries
        (`RankWork.insert_cost` without recounting them)."""
        rw = self.rw
        at = bisect.bisect_left(members, block[0])
        if at < len(members) and members[at] < block[-1]:
            return rw.trie(sorted(members + block)) - members_trie
        cost = block_trie
        if at > 0:
            cost -= rw.lcp(members[at - 1], block[0])
        if at < len(members):
            cost -= rw.lcp(block[-1], members[at])
            if at > 0:
                cost += rw.lcp(members[at - 1], members[at])
        return cost

    def swap_works(self, f: int, mine: np.ndarray, unit_bin: np.ndarray, unit: np.ndarray, save: np.ndarray,
                   plain: np.ndarray, cluster: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[P, Q] new works of microbatch f and of unit_bin[q] when unit mine[p] of f and unit q trade places
        (unit_bin[q] != f). Units of two clusters: the two moves added; of one cluster: priced on the member lists
        without the leaving unit (whose trie is the work less the unit's removal saving)."""
        own = self.units[f]
        into_f = self.gains(unit_bin, unit, plain, cluster, f)
        out_of_f = self.gains(f, mine[:, None], own["plain"][mine][:, None], own["cluster"][mine][:, None],
                              np.arange(len(self.bins))[None, :])
        new_f = self.works[f] - own["save"][mine][:, None] + into_f[None, :]
        new_b = self.works[unit_bin][None, :] - save[None, :] + out_of_f[:, unit_bin]
        kept: dict[tuple[int, int], tuple[list[int], int]] = {}

        def without(k: int, u: int) -> tuple[list[int], int]:
            if (k, u) not in kept:
                kept[k, u] = (_without(self.bins[k], self.ranks(k, u)), int(self.works[k] - self.units[k]["save"][u]))
            return kept[k, u]

        g0 = self.g0
        for p, q in zip(*np.nonzero(own["cluster"][mine][:, None] == cluster[None, :])):
            u, b, v = int(mine[p]), int(unit_bin[q]), int(unit[q])
            kept_f, trie_f = without(f, u)
            kept_b, trie_b = without(b, v)
            new_f[p, q] = trie_f + self.insertion(kept_f, trie_f, self.ranks(b, v), int(plain[q]) + g0)
            new_b[p, q] = trie_b + self.insertion(kept_b, trie_b, self.ranks(f, u), int(own["plain"][u]) + g0)
        return new_f, new_b

    def apply(self, a: int, u: int, b: int, v: int) -> None:
        """Unit u of microbatch a to b and (v >= 0) unit v of b to a."""
        moving = self.ranks(a, u)
        back = self.ranks(b, v) if v >= 0 else []
        self.bins[a] = sorted(_without(self.bins[a], moving) + back)
        self.bins[b] = sorted(_without(self.bins[b], back) + moving)
        for ranks, source, target in ((moving, a, b), (back, b, a)):
            if ranks:
                cluster = int(self.cluster_of[ranks[0]])
                self.holds[cluster, source] -= len(ranks)
                self.holds[cluster, target] += len(ranks)
        for k in (a, b):
            self.works[k] = self.rw.trie(self.bins[k])
            self.units[k] = self._units(k)


def refine_tail(rw: RankWork, bins: list[list[int]], capacity: int, dp: int,
                config: HartsConfig) -> tuple[list[list[int]], int]:
    """(bins, changes taken): `bins` with its most imbalanced slots evened out (module docstring); the input is not
    modified. Needs K a multiple of D and no empty microbatch."""
    assert len(bins) % dp == 0 and all(bins)
    state = _Plan(rw, bins, capacity, config.tail_unit_depth)
    if dp == 1:
        return state.bins, 0
    key = objective(state.works, dp)
    imbalance = slot_imbalances(state.works, dp)
    stuck: set[int] = set()
    changes = 0
    while changes < config.tail_max_changes:
        focus = [s for s in np.argsort(-imbalance, kind="stable").tolist()
                 if imbalance[s] > config.tail_target and s not in stuck]
        if not focus:
            break
        change = _best_change(state, focus[0], dp, key, imbalance, config.tail_candidates)
        if change is None:
            stuck.add(focus[0])
            continue
        state.apply(*change)
        key = objective(state.works, dp)
        imbalance = slot_imbalances(state.works, dp)
        stuck.clear()
        changes += 1
    return state.bins, changes


def _best_change(state: _Plan, slot: int, dp: int, key: tuple[int, int, int], imbalance: np.ndarray,
                 num_candidates: int) -> tuple[int, int, int, int] | None:
    """(a, u, b, v): the change (unit u of microbatch a to b, and unit v of b to a unless v < 0) that lowers the
    sorted slot imbalances most among the ranked candidates of `slot`, without raising `key`; None if none."""
    works, capacity = state.works, state.capacity
    count = len(works)
    members = np.argsort(-works, kind="stable")[slot * dp : (slot + 1) * dp]
    lead = int(members[0])
    # Every unit of the plan: its microbatch, index there, removal saving, trie - g0 and cluster.
    unit_bin = np.concatenate([np.full(len(state.units[k]["lo"]), k) for k in range(count)])
    unit = np.concatenate([np.arange(len(state.units[k]["lo"])) for k in range(count)])
    save, plain, cluster = (np.concatenate([state.units[k][name] for k in range(count)])
                            for name in ("save", "plain", "cluster"))
    # Candidates: source a and unit u, target b and unit v (-1: a move), the new works of a and b.
    parts: list[tuple[np.ndarray, ...]] = []

    def add(a, u, b, v, new_a, new_b, keep) -> None:
        a, u, b, v, new_a, new_b, keep = np.broadcast_arrays(a, u, b, v, new_a, new_b, keep)
        keep = keep & (new_a <= capacity) & (new_b <= capacity) & (new_a + new_b <= works[a] + works[b])
        if keep.any():
            parts.append(tuple(x[keep] for x in (a, u, b, v, new_a, new_b)))

    # Moves out of the heaviest microbatch, to any other.
    mine = unit_bin == lead
    targets = np.arange(count)[None, :]
    gain = state.gains(lead, unit[mine][:, None], plain[mine][:, None], cluster[mine][:, None], targets)
    add(lead, unit[mine][:, None], targets, -1, works[lead] - save[mine][:, None], works[targets] + gain,
        targets != lead)
    # Moves into each other microbatch of the slot, from any microbatch but the heaviest.
    for m in members[1:].tolist():
        source = (unit_bin != m) & (unit_bin != lead)
        gain = state.gains(unit_bin[source], unit[source], plain[source], cluster[source], m)
        add(unit_bin[source], unit[source], m, -1, works[unit_bin[source]] - save[source], works[m] + gain, True)
    # Swaps of a unit of each of the slot's microbatches with a unit of another: the heaviest falls, the others rise.
    for f in members.tolist():
        mine = unit_bin == f
        if not mine.any():
            continue
        other = ~mine
        new_f, new_b = state.swap_works(f, unit[mine], unit_bin[other], unit[other], save[other], plain[other],
                                        cluster[other])
        useful = (new_f < works[f]) if f == lead else (new_f > works[f])
        add(f, unit[mine][:, None], unit_bin[other][None, :], unit[other][None, :], new_f, new_b, useful)
    if not parts:
        return None
    a, u, b, v, new_a, new_b = (np.concatenate(column) for column in zip(*parts))
    # Rank by the focus slot's imbalance with its microbatches kept together.
    position = np.full(count, -1)
    position[members] = np.arange(dp)
    values = np.tile(works[members], (len(a), 1))
    rows = np.arange(len(a))
    for changed, new in ((a, new_a), (b, new_b)):
        inside = position[changed] >= 0
        values[rows[inside], position[changed][inside]] = new[inside]
    local = values.max(axis=1) / (values.sum(axis=1) / dp) - 1
    order = np.argsort(local, kind="stable")[:num_candidates]
    order = order[local[order] < imbalance[slot]]
    if not len(order):
        return None
    a, u, b, v, new_a, new_b = a[order], u[order], b[order], v[order], new_a[order], new_b[order]
    rows = np.arange(len(a))
    trial = np.tile(works, (len(a), 1))
    trial[rows, a] = new_a
    trial[rows, b] = new_b
    total = trial.sum(axis=1)
    critical = -np.sort(-trial, axis=1)[:, ::dp].sum(axis=1)
    now = -np.sort(-imbalance)
    after = -np.sort(-slot_imbalances(trial, dp), axis=1)
    # Lower sorted imbalances: smaller at the first slot where they differ.
    differs = after != now
    first = np.argmax(differs, axis=1)
    better = differs.any(axis=1) & (after[rows, first] < now[first])
    # W and the critical path first (vectorised), then the whole objective of the best.
    better &= (total < key[0]) | ((total == key[0]) & (critical <= key[1]))
    for i in np.lexsort(after.T[::-1]).tolist():
        if better[i] and objective(trial[i], dp) <= key:
            return int(a[i]), int(u[i]), int(b[i]), int(v[i])
    return None


def _without(members: list[int], block: list[int]) -> list[int]:
    gone = set(block)
    return [r for r in members if r not in gone]
