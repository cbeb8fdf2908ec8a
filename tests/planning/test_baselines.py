"""greedy-trie against a plain first-fit over real tries; per-trajectory FFD packing."""

from __future__ import annotations

import numpy as np
import pytest

from harts.planning.microbatch import plan, validate
from harts.trees.trie import PrefixIndex

from ..trees.helpers import make_step
from .microbatch_helpers import rollout_step

SHAPE = dict(num_tasks=4, branches=(2, 8), shared=25, prompt=(2, 8), continuation=(5, 50))


def naive_greedy_trie(step, capacity: int) -> list[list[int]]:
    """First fit in input order, each fit checked by building the microbatch's trie."""
    index = PrefixIndex.from_step(step)
    bins: list[list[int]] = []
    for x in range(step.num_trajectories):
        for members in bins:
            if index.segment_tree(np.asarray(members + [x])).num_compact_tokens <= capacity:
                members.append(x)
                break
        else:
            bins.append([x])
    return bins


@pytest.mark.parametrize("seed", range(5), ids=lambda s: f"seed{s}")
def test_greedy_trie_is_first_fit_over_tries(seed):
    rng = np.random.default_rng([42, seed])
    step = rollout_step(rng, **SHAPE)
    capacity = int(step.lengths.max()) + int(rng.integers(0, 200))
    expected = naive_greedy_trie(step, capacity)
    result = plan(step, capacity, 1, "greedy-trie")
    validate(result, step)
    got = sorted(sorted(step.ids.index(i) for i in mb.trajectory_ids) for mb in result.microbatches)
    assert got == sorted(sorted(b) for b in expected)


def test_greedy_trie_splits_to_a_multiple_of_dp():
    rng = np.random.default_rng(42)
    step = rollout_step(rng, **SHAPE)
    capacity = 10 * int(step.lengths.max())
    assert len(naive_greedy_trie(step, capacity)) == 1
    result = plan(step, capacity, 4, "greedy-trie")
    validate(result, step)
    assert result.num_microbatches == 4


@pytest.mark.parametrize("dp", [1, 3], ids=lambda d: f"D{d}")
def test_per_trajectory_packs_semantic_tokens(dp):
    step = make_step([[1] * 9, [1] * 8, [1] * 5, [1] * 4, [1] * 3, [1] * 1])
    result = plan(step, 12, dp, "per-trajectory")
    validate(result, step)
    assert result.work_model == "semantic"
    assert result.compact_tokens == step.num_semantic_tokens
    groups = sorted(sorted(len(step.trajectory_tokens(step.ids.index(i))) for i in mb.trajectory_ids)
                    for mb in result.microbatches)
    if dp == 1:
        # FFD on 9 8 5 4 3 1 into 12: {9, 3}, {8, 4}, {5, 1}.
        assert groups == [[1, 5], [3, 9], [4, 8]]
    else:
        assert result.num_microbatches == 3
