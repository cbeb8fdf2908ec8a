"""Fragment packing: root-level subtrees, the packing's guarantees and its work, on random and hand-built trees."""

from __future__ import annotations

import numpy as np
import pytest

from harts.planning.fragment_packing import FragmentPacker, tree_parts
from harts.planning.rank_work import RankWork
from harts.trees.trie import PrefixIndex

from ..trees.helpers import make_step
from .microbatch_helpers import rollout_step


def _clusters(rw: RankWork) -> list[list[int]]:
    g0 = rw.common_prefix
    starts = [0] + [r for r in range(1, rw.num) if rw.lcp_adjacent[r] == g0] + [rw.num]
    return [list(range(a, b)) for a, b in zip(starts, starts[1:])]


def _setting(seed: int):
    rng = np.random.default_rng([7, seed])
    step = rollout_step(rng, num_tasks=int(rng.integers(3, 9)), branches=(2, 12), shared=20, prompt=(2, 9),
                        continuation=(5, 60))
    index = PrefixIndex.from_step(step)
    rw = RankWork(index)
    # Small enough that several trees exceed it, large enough for every trajectory.
    capacity = int(max(step.lengths.max() + 5, 0.6 * max(rw.trie(c) for c in _clusters(rw))))
    return index, rw, capacity


def test_root_subtrees_split_where_only_the_common_prefix_is_shared():
    shared = [9] * 4
    step = make_step([shared + [1, 1, 5], shared + [1, 1, 6], shared + [2, 7], shared + [3], shared + [3, 8]])
    rw = RankWork(PrefixIndex.from_step(step))
    names = [rw.order.tolist().index(k) for k in range(5)]
    groups = rw.root_subtrees(list(range(5)))
    assert [sorted(rw.order[g].tolist()) for g in groups] == [[0, 1], [2], [3, 4]]
    assert sorted(r for g in groups for r in g) == sorted(names)


@pytest.mark.parametrize("seed", range(6), ids=lambda s: f"seed{s}")
def test_tree_parts_fit_and_cover(seed):
    _, rw, capacity = _setting(seed)
    for cluster in _clusters(rw):
        parts = tree_parts(rw, cluster, capacity)
        assert sorted(r for p in parts for r in p) == cluster
        assert all(rw.trie(p) <= capacity for p in parts)
        if rw.trie(cluster) > capacity:
            assert len(parts) >= 2
            # Parts are subtrees: they share more inside than with any other part.
            for a in parts:
                inner = min((rw.lcp(x, y) for x, y in zip(a, a[1:])), default=None)
                outside = max(rw.lcp(x, y) for b in parts if b is not a for x in a for y in b)
                assert inner is None or inner > outside


@pytest.mark.parametrize("seed", range(8), ids=lambda s: f"seed{s}")
def test_pack_covers_fits_and_counts(seed):
    index, rw, capacity = _setting(seed)
    clusters = _clusters(rw)
    packer = FragmentPacker(rw, clusters, capacity)
    packed = 0
    for count in range(1, 3 * len(clusters)):
        bins = packer.pack(count)
        if bins is None:
            continue
        packed += 1
        assert len(bins) == count and all(bins)
        assert sorted(r for b in bins for r in b) == list(range(rw.num))
        for b in bins:
            assert b == sorted(b)
            assert index.segment_tree(rw.order[np.asarray(b)]).num_compact_tokens == rw.trie(b) <= capacity
    assert packed >= 2


def test_a_tree_fitting_nowhere_is_spread_over_the_roomiest_microbatches():
    """Two trees of 20 (T = 22) take a microbatch each; the third (27: a 3-token prompt, then
    branches of 10, 10 and 2) fits none whole, so its subtrees go to the roomiest microbatches, two
    of them, each holding the prompt: W = C + (K - 1)·g0 + the prompt once more."""
    g0 = [9, 9]
    big_a = g0 + [1] * 18
    big_b = g0 + [2] * 18
    third = [g0 + [3, 3, 3] + [4] * 10, g0 + [3, 3, 3] + [5] * 10, g0 + [3, 3, 3] + [6] * 2]
    step = make_step([big_a, big_b, *third])
    rw = RankWork(PrefixIndex.from_step(step))
    capacity = 22
    clusters = _clusters(rw)
    assert [rw.trie(c) for c in clusters] == [20, 20, 2 + 3 + 22]
    bins = FragmentPacker(rw, clusters, capacity).pack(4)
    assert bins is not None
    works = sorted(rw.trie(b) for b in bins)
    # The big trees alone (20 each); the third tree's subtrees: {4-branch}: 15, {5-branch}: 15,
    # {6-branch}: 7, two per microbatch at most (22): 15 + 7 - 5 = 17 and 15.
    assert works == [15, 17, 20, 20]
    assert sum(works) == rw.run_cost(0, rw.num) + 3 * 2 + 3


def test_empty_microbatches_take_a_cluster_or_a_subtree():
    """More microbatches than the greedy fills: an empty one takes the smallest whole cluster of a
    microbatch holding several (W unchanged), or else splits a subtree off the largest piece."""
    g0 = [9]
    sequences = [g0 + [1, 1], g0 + [2, 2, 2], g0 + [3, 7], g0 + [3, 8]]
    step = make_step(sequences)
    rw = RankWork(PrefixIndex.from_step(step))
    packer = FragmentPacker(rw, _clusters(rw), 100)
    three = packer.pack(3)
    assert sorted(len(b) for b in three) == [1, 1, 2]
    assert sum(rw.trie(b) for b in three) == rw.run_cost(0, rw.num) + 2 * 1
    four = packer.pack(4)
    assert sorted(len(b) for b in four) == [1, 1, 1, 1]
    # The split repeats the last tree's prefix beyond g0 (the token 3) once more.
    assert sum(rw.trie(b) for b in four) == rw.run_cost(0, rw.num) + 3 * 1 + 1
    assert packer.pack(5) is None
