"""RankWork's rank arithmetic against the trie built by PrefixIndex.segment_tree."""

from __future__ import annotations

import numpy as np
import pytest

from harts.planning.rank_work import RankWork, split_to_multiple
from harts.trees.trie import PrefixIndex

from .microbatch_helpers import rollout_step

SHAPES = {
    "shared-prefix": dict(num_tasks=3, branches=(2, 7), shared=15, prompt=(1, 6), continuation=(1, 30)),
    "forest": dict(num_tasks=4, branches=(1, 5), shared=0, prompt=(0, 3), continuation=(1, 12)),
    "duplicates": dict(num_tasks=2, branches=(3, 6), shared=5, prompt=(1, 3), continuation=(1, 4), duplicate=True),
}


@pytest.fixture(params=SHAPES, ids=list(SHAPES))
def setting(request):
    rng = np.random.default_rng(42)
    step = rollout_step(rng, **SHAPES[request.param])
    index = PrefixIndex.from_step(step)
    return rng, index, RankWork(index)


def _trie(index: PrefixIndex, rw: RankWork, ranks) -> int:
    return index.segment_tree(rw.order[np.asarray(sorted(ranks), dtype=np.int64)]).num_compact_tokens


def test_trie_share_and_insert_match_the_segment_tree(setting):
    rng, index, rw = setting
    for _ in range(200):
        size = int(rng.integers(1, rw.num + 1))
        ranks = sorted(rng.choice(rw.num, size, replace=False).tolist())
        assert rw.trie(ranks) == _trie(index, rw, ranks)
        x = ranks[int(rng.integers(len(ranks)))]
        rest = [r for r in ranks if r != x]
        assert rw.lengths_list[x] - rw.share(ranks, x) == rw.trie(ranks) - rw.trie(rest)
        skip = ranks[int(rng.integers(len(ranks)))]
        without = [r for r in rest if r != skip]
        if skip != x:
            assert rw.lengths_list[x] - rw.share(ranks, x, skip=skip) == _trie(index, rw, without + [x]) - (
                _trie(index, rw, without) if without else 0)
        if len(rest) >= 2:
            cut = int(rng.integers(1, len(rest)))
            pick = rng.permutation(len(rest))
            block = sorted(rest[i] for i in pick[:cut])
            others = sorted(rest[i] for i in pick[cut:])
            assert rw.insert_cost(others, block) == _trie(index, rw, rest) - _trie(index, rw, others)
            lo = int(rng.integers(0, len(rest)))
            contiguous = rest[lo : lo + int(rng.integers(1, len(rest) - lo + 1))]
            outside = [r for r in rest if r not in contiguous]
            assert rw.insert_cost(outside, contiguous) == _trie(index, rw, rest) - _trie(index, rw, outside)


def test_lcp_and_run_cost(setting):
    rng, index, rw = setting
    for _ in range(200):
        a, b = sorted(rng.choice(rw.num, 2, replace=False).tolist())
        assert rw.lcp(a, b) == index.lcp_of(int(rw.order[a]), int(rw.order[b]))
        assert rw.lcp(b, a) == rw.lcp(a, b)
        assert rw.run_cost(a, b + 1) == _trie(index, rw, range(a, b + 1))
    starts = rng.integers(0, rw.num, 50)
    ends = starts + 1 + rng.integers(0, rw.num - starts)
    assert rw.run_costs(starts, ends).tolist() == [rw.run_cost(i, j) for i, j in zip(starts.tolist(), ends.tolist())]
    assert rw.common_prefix == min(index.lcp_of(int(rw.order[0]), int(rw.order[r])) for r in range(1, rw.num))
    assert rw.deepest == [max(index.lcp_of(int(rw.order[a]), int(rw.order[b])) for b in range(rw.num) if b != a)
                          for a in range(rw.num)]


def test_cheapest_split_and_split_to_multiple(setting):
    rng, index, rw = setting
    ranks = list(range(rw.num))
    cost, position = rw.cheapest_split(ranks)
    assert cost == _trie(index, rw, ranks[:position]) + _trie(index, rw, ranks[position:]) - rw.trie(ranks)
    assert cost == min(rw.lcp(a, b) for a, b in zip(ranks, ranks[1:]))
    bins = split_to_multiple(rw, [ranks], 3)
    assert len(bins) == 3 and sorted(r for b in bins for r in b) == ranks
    assert split_to_multiple(rw, [[r] for r in ranks[:2]], 3) is None
