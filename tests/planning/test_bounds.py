"""Plan lower bounds against brute force over every set partition of small steps."""

from __future__ import annotations

import numpy as np
import pytest

from harts.planning import bounds
from harts.planning.microbatch import plan, validate
from harts.planning.rank_work import RankWork
from harts.trees.trie import PrefixIndex

from ..trees.helpers import make_step
from .microbatch_helpers import all_partitions, rollout_step

SHAPES = {
    "shared-prefix": dict(num_tasks=3, branches=(1, 3), shared=6, prompt=(1, 4), continuation=(1, 12)),
    "forest": dict(num_tasks=3, branches=(1, 3), shared=0, prompt=(0, 3), continuation=(1, 12)),
    "one-tree": dict(num_tasks=1, branches=(2, 8), shared=4, prompt=(1, 3), continuation=(1, 10)),
}


def _optimum(index: PrefixIndex, capacity: int, dp: int) -> tuple[int, int | None, int | None]:
    """(fewest microbatches ignoring D, fewest and least W of plans with K ≡ 0 mod D), by brute force."""
    num = len(index.lengths)
    subset_work: dict[tuple[int, ...], int] = {}
    fewest_any = num
    fewest = least = None
    for blocks in all_partitions(num):
        works = []
        for block in map(tuple, blocks):
            if block not in subset_work:
                subset_work[block] = index.segment_tree(np.asarray(block)).num_compact_tokens
            works.append(subset_work[block])
        if max(works) > capacity:
            continue
        fewest_any = min(fewest_any, len(blocks))
        if num >= dp and len(blocks) % dp:
            continue
        fewest = len(blocks) if fewest is None else min(fewest, len(blocks))
        least = sum(works) if least is None else min(least, sum(works))
    return fewest_any, fewest, least


@pytest.mark.parametrize("dp", [1, 2, 3], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_bounds_never_exceed_the_optimum(shape, dp):
    rng = np.random.default_rng(42)
    checked = tight_work = tight_count = 0
    for _ in range(60):
        step = rollout_step(rng, **SHAPES[shape])
        if not 2 <= step.num_trajectories <= 7:
            continue
        index = PrefixIndex.from_step(step)
        rw = RankWork(index)
        longest = int(step.lengths.max())
        capacity = longest + int(rng.integers(0, longest + 1))
        fewest_any, fewest, least = _optimum(index, capacity, dp)
        assert bounds._clique_count(rw, capacity) <= fewest_any
        assert bounds._cluster_count(rw, capacity) <= fewest_any
        if least is None:
            continue
        result = bounds.plan_bounds(rw, capacity, dp)
        assert result.num_microbatches <= fewest
        assert result.compact_tokens <= least
        checked += 1
        tight_count += result.num_microbatches == fewest > 1
        # In a forest cuts between trees are free, so the optimum is mostly C itself.
        tight_work += result.compact_tokens == least > (rw.run_cost(0, rw.num) if shape != "forest" else 0)
    assert checked >= 20
    # The bounds must also be attained where cuts cannot be avoided, or they prove nothing.
    assert tight_count >= 5 and tight_work >= 5


def _trees(num_trees: int, trunk: int, branches: int, branch: int) -> list[list[int]]:
    """Trees under a 10-token shared prefix: a task token, a trunk, then branches."""
    sequences = []
    for tree in range(num_trees):
        head = [0] * 10 + [100 + tree] + [1] * trunk
        sequences += [head + [10 + b] * branch for b in range(branches)]
    return sequences


@pytest.mark.parametrize("dp", [1, 2, 4], ids=lambda d: f"D{d}")
def test_cluster_bound_proves_whole_trees_cannot_pair(dp):
    # Trees of 30 rows below the 10-token prefix, T = 55: no two share a microbatch, and a tree
    # split into its branches (20 + 20 rows below the prefix) still needs the room of one.
    # Volume alone allows 4 microbatches, the clique 1; the clusters prove 5.
    step = make_step(_trees(5, trunk=9, branches=2, branch=10))
    index = PrefixIndex.from_step(step)
    rw = RankWork(index)
    assert bounds._clique_count(rw, 55) == 1
    assert bounds._cluster_count(rw, 55) == 5
    result = bounds.plan_bounds(rw, 55, dp)
    assert result.num_microbatches == -(-5 // dp) * dp
    planned = plan(step, 55, dp, "harts", index=index)
    validate(planned, step, index)
    assert planned.compact_tokens == result.compact_tokens
    assert planned.details["work_gap_to_bound"] == 0


def test_cluster_bound_charges_a_heavy_cluster_its_split_cost():
    # One tree of 41 rows below the 10-token prefix (two 20-token branches after its task token)
    # and eight single trajectories of 6 rows, T = 55: the tree whole leaves no room for a
    # single, but split (cost 1) each branch fills a microbatch with four singles: K = 2.
    step = make_step(_trees(1, trunk=0, branches=2, branch=20)
                     + [[0] * 10 + [200 + k] + [3] * 5 for k in range(8)])
    index = PrefixIndex.from_step(step)
    rw = RankWork(index)
    by_id = {trajectory: k for k, trajectory in enumerate(step.ids)}
    halves = [[by_id["t0"]] + [by_id[f"t{k}"] for k in range(2, 6)],
              [by_id["t1"]] + [by_id[f"t{k}"] for k in range(6, 10)]]
    assert [index.segment_tree(np.asarray(h)).num_compact_tokens for h in halves] == [55, 55]
    assert bounds._cluster_count(rw, 55) == 2
    assert bounds.plan_bounds(rw, 55, 1).num_microbatches == 2


def test_clique_bound_counts_long_trajectories_of_different_clusters():
    # Lengths 41 under a shared 10-token prefix: any two need 72 > 60 rows.
    step = make_step(_trees(6, trunk=20, branches=1, branch=10))
    rw = RankWork(PrefixIndex.from_step(step))
    assert bounds._clique_count(rw, 60) == 6
    assert bounds._clique_count(rw, 72) == 1
    assert bounds.plan_bounds(rw, 60, 3).num_microbatches == 6
    # K = 8 would need 8 non-empty microbatches of 6 trajectories: no plan, and the bound stays <= N.
    assert bounds.plan_bounds(rw, 60, 4).num_microbatches == 6
    with pytest.raises(ValueError, match="no plan"):
        plan(step, 60, 4, "harts")
