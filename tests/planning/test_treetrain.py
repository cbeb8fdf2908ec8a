"""The treetrain-ortools baseline: parts, the exact sharing model, equal counts per replica."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from harts.planning import treetrain as tt
from harts.planning.microbatch import plan, validate
from harts.planning.rank_work import RankWork
from harts.trees.trie import PrefixIndex

from .microbatch_helpers import rollout_step

SHAPE = dict(num_tasks=4, branches=(3, 9), shared=25, prompt=(2, 8), continuation=(5, 50))


@pytest.fixture
def setting():
    rng = np.random.default_rng(42)
    step = rollout_step(rng, **SHAPE)
    index = PrefixIndex.from_step(step)
    return rng, step, index, RankWork(index)


def test_parts_are_whole_trees_or_root_level_subtrees(setting):
    _, step, index, rw = setting
    capacity = int(step.lengths.max()) + 10
    parts = tt._tree_parts(step, rw, capacity)
    assert sorted(r for p in parts for r in p) == list(range(rw.num))
    for tree in set(step.trees):
        ranks = sorted(int(rw.rank[k]) for k in range(step.num_trajectories) if step.trees[k] == tree)
        mine = [p for p in parts if set(p) <= set(ranks)]
        assert sorted(r for p in mine for r in p) == ranks
        if rw.trie(ranks) <= capacity:
            assert mine == [ranks]
        else:
            assert len(mine) >= 2 and all(rw.trie(p) <= capacity for p in mine)
            # A part is a subtree: what its members share exceeds what they share with the rest.
            for part in mine:
                others = [r for r in ranks if r not in part]
                inside = min((rw.lcp(a, b) for a, b in zip(part, part[1:])), default=rw.lengths_list[part[0]])
                assert all(rw.lcp(a, b) < inside or len(part) == 1 for a in part for b in others)


def test_sharing_model_prices_any_set_of_parts_exactly(setting):
    rng, step, index, rw = setting
    parts = tt._tree_parts(step, rw, int(step.lengths.max()) + 5)
    sharing = tt._Sharing(index, rw)
    own, nodes = sharing.nodes(parts)
    for _ in range(100):
        chosen = sorted(rng.choice(len(parts), int(rng.integers(1, len(parts) + 1)), replace=False).tolist())
        model = sum(own[p] for p in chosen) + sum(length for length, members in nodes if set(members) & set(chosen))
        assert model == rw.trie(sorted(r for p in chosen for r in parts[p]))


@pytest.mark.parametrize("dp", [1, 2, 3], ids=lambda d: f"D{d}")
def test_plans_validate_with_equal_counts_per_replica(setting, dp):
    _, step, index, rw = setting
    result = plan(step, int(step.lengths.max()) + 40, dp, "treetrain-ortools", time_limit_s=2.0)
    validate(result, step, index)
    replicas = result.details["replicas"]
    assert len(replicas) == dp and all(r["status"] in ("OPTIMAL", "FEASIBLE") for r in replicas)
    for r in range(dp):
        works = [mb.work for mb in result.microbatches if mb.replica == r]
        assert works == sorted(works, reverse=True)


def test_replica_solve_is_optimal_on_a_small_replica(setting):
    """CP-SAT's bins equal the best of every partition of a few parts (same lexicographic goal)."""
    _, step, index, rw = setting
    capacity = int(step.lengths.max()) + 30
    parts = tt._tree_parts(step, rw, capacity)[:6]
    bins, info = tt._solve_replica(rw, tt._Sharing(index, rw), parts, capacity, tt.TreeTrainConfig(), count=None)
    assert info["status"] == "OPTIMAL"
    best = None
    for assignment in itertools.product(range(len(parts)), repeat=len(parts)):
        groups: dict[int, list[int]] = {}
        for p, b in enumerate(assignment):
            groups.setdefault(b, []).extend(parts[p])
        works = [rw.trie(sorted(g)) for g in groups.values()]
        if max(works) <= capacity:
            key = (sum(works), len(works))
            best = key if best is None or key < best else best
    assert (sum(rw.trie(b) for b in bins), len(bins)) == best


def test_counts_are_equalised_by_splitting_parts():
    from ..trees.helpers import make_step

    # Parts by size: tree b (10 tokens, two trajectories), a (9), tree c (5). LPT: b -> r0, a -> r1,
    # c -> r1. Replica 1 needs two microbatches (9 + 5 > 12); replica 0 holds one part that
    # fits in one, so it is split into b's two root-level subtrees and solved again.
    step = make_step([[6] * 8 + [1], [6] * 8 + [2], [1] * 9, [5, 5, 5, 1], [5, 5, 5, 2]],
                     trees=["b", "b", "a", "c", "c"])
    result = plan(step, 12, 2, "treetrain-ortools", time_limit_s=2.0)
    validate(result, step)
    assert result.num_microbatches == 4
    assert result.details["replicas"][0]["equalised"]["parts"] == 2
    assert sorted(mb.work for mb in result.microbatches) == [5, 9, 9, 9]


def test_counts_are_equalised_by_lending_trajectories():
    from ..trees.helpers import make_step

    # LPT: b (10) -> r0, a (9) -> r1, tree c (5) -> r1: replica 1 needs two microbatches
    # (9 + 5 > 12), replica 0 holds one trajectory, so it borrows one of c's from replica 1.
    step = make_step([[6] * 10, [1] * 9, [5, 5, 5, 1], [5, 5, 5, 2]], trees=["b", "a", "c", "c"])
    result = plan(step, 12, 2, "treetrain-ortools", time_limit_s=2.0)
    validate(result, step)
    assert result.details["lent_to"] == {"0": [1]}
    assert result.num_microbatches == 4


def test_counts_that_cannot_be_equalised_are_an_error():
    from ..trees.helpers import make_step

    step = make_step([[1] * 9, [2] * 9, [3] * 9])
    with pytest.raises(ValueError, match="3 trajectories cannot fill 2 microbatches on each of 2 replicas"):
        plan(step, 10, 2, "treetrain-ortools", time_limit_s=2.0)


@pytest.mark.parametrize("time_limit", [0.0, -1.0, float("nan"), float("inf")], ids=["zero", "negative", "nan", "inf"])
def test_time_limit_must_be_finite_and_positive(time_limit):
    with pytest.raises(ValueError, match="time_limit_s must be a finite number > 0"):
        tt.TreeTrainConfig(time_limit_s=time_limit)
