"""The HARTS planner's refinement (`refine`) of a plan of the DP tiers (or of the cluster packing, when some cluster
cuts cheaply), each change accepted only when it lowers the objective it targets:
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
Moves and swaps that cannot beat the best change found are not priced: what a trajectory shares with any set is
at most what it shares with its sorted neighbours (`RankWork.deepest`), which bounds a change's W from below. The
refined plan is returned only if its objective is no worse than the input's; with `work_optimal` (the input's W
equals the plan lower bound) only balancing runs. Tested stage by stage in tests/planning/test_harts_planner.py
(descent, elimination and its ejection chain, repacking, balance: each keeps a valid partition and never raises its
objective), and plan for plan against the plans recorded before these bounds.
"""

from __future__ import annotations

import bisect
import heapq

import numpy as np

from harts.planning.harts_search import HartsConfig, bins_key
from harts.planning.plans import objective
from harts.planning.rank_work import RankWork, split_to_multiple

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
    original = bins_key(rw, bins, dp)
    state = _State(rw, bins, capacity)
    if not work_optimal:
        state = _lower_work(state, config, dp)
    _balance(state, dp, config)
    refined = state.nonempty()
    assert len(refined) % dp == 0
    return refined if bins_key(rw, refined, dp) <= original else [list(b) for b in bins]


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
    deepest = rw.deepest
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
            # A move lowers W only into a microbatch that x shares more with than with its own: none when x
            # already shares there the most it shares with any rank.
            for target in sorted(candidates) if lengths[x] - saved < deepest[x] else ():
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
    bin_of = state.bin_of.tolist()
    for emptied in sorted((k for k, b in enumerate(state.bins) if b), key=lambda k: (state.works[k], k)):
        members = state.bins[emptied]
        if not members or len(members) > config.eliminate_max_members:
            continue
        scratch: dict[int, tuple[list[int], int]] = {}
        # The microbatch of each rank that a scratch change holds: a rank is in one scratch list at most.
        moved: dict[int, int] = {}

        def current(k: int) -> tuple[list[int], int]:
            return scratch.get(k, (state.bins[k], state.works[k]))

        def homes(lo: int, hi: int) -> set[int]:
            return {moved.get(r, k) for r, k in zip(range(lo, hi), bin_of[lo:hi])}

        roomiest = _roomiest(state, config.room_candidates)
        cost = 0
        for x in sorted(members, key=lambda r: (-lengths[r], r)):
            targets = homes(max(0, x - window), min(rw.num, x + window + 1))
            best: tuple[int, dict[int, tuple[list[int], int]]] | None = None
            for target in sorted((targets | set(roomiest)) - {emptied}):
                held, before = current(target)
                if not held:
                    continue
                work = before + lengths[x] - rw.share(held, x)
                if work <= capacity:
                    if best is None or work - before < best[0]:
                        best = (work - before, {target: (sorted(held + [x]), work)})
                    continue
                joined = sorted(held + [x])
                for y in held:
                    kept_work = work - lengths[y] + rw.share(joined, y)
                    if kept_work > capacity:
                        continue
                    thirds = homes(max(0, y - 4), min(rw.num, y + 5)) | set(roomiest[:4])
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
            for k, (held, _) in best[1].items():
                moved.update(dict.fromkeys(held, k))
            if cost >= state.works[emptied]:
                break
        else:
            if cost < state.works[emptied]:
                changes = {k: m for k, (m, _) in scratch.items()}
                changes[emptied] = []
                state.replace(changes)
                bin_of = state.bin_of.tolist()
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
    deepest = rw.deepest
    # W changes by s_x - share(members - x, y) + s_y - share(held - y, x), s_z being what z shares in its own
    # microbatch; neither share exceeds what y and x share with any rank, which bounds the change from below.
    floor = lengths[x] - saved - deepest[x]
    best_delta, best = 0, None
    for y in range(max(0, x - window), min(rw.num, x + window + 1)):
        target = int(state.bin_of[y])
        if target == source:
            continue
        held = state.bins[target]
        kept = rw.share(held, y)
        if floor + kept - deepest[y] >= best_delta:
            continue
        work_source = state.works[source] - saved + lengths[y] - rw.share(members, y, skip=x)
        work_target = state.works[target] - lengths[y] + kept + lengths[x] - rw.share(held, x, skip=y)
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
