import numpy as np
import pytest

from harts.objective.targets import semantic_targets, semantic_targets_from_step

from .helpers import random_tree_step


def test_hand_built():
    offsets = np.array([0, 3, 5, 6])
    tokens = np.array([10, 11, 12, 20, 21, 30])
    loss_mask = np.array([0, 1, 0, 0, 1, 0])
    advantages = np.array([9.0, 1.0, 2.0, 9.0, -1.0, 9.0])
    old = np.array([0.0, -0.1, -0.2, 0.0, -0.4, 0.0])
    shifted = semantic_targets(offsets, tokens, loss_mask, advantages, old_logprobs=old)
    assert shifted.targets.tolist() == [11, 12, 0, 21, 0, 0]
    assert shifted.loss_mask.tolist() == [True, False, False, True, False, False]
    assert shifted.advantages.tolist() == [1.0, 2.0, 0.0, -1.0, 0.0, 0.0]
    assert np.allclose(shifted.old_logprobs, [-0.1, -0.2, 0.0, -0.4, 0.0, 0.0])
    assert shifted.ref_logprobs is None
    assert shifted.trajectory_index.tolist() == [0, 0, 0, 1, 1, 2]


def test_random_steps_against_loop():
    rng = np.random.default_rng(42)
    step = random_tree_step(rng, num=20, max_len=15, vocab=4).step
    shifted = semantic_targets_from_step(step)
    advantages = step.advantages()
    for k in range(step.num_trajectories):
        lo, hi = int(step.offsets[k]), int(step.offsets[k + 1])
        for p in range(lo, hi):
            has_next = p + 1 < hi
            assert shifted.trajectory_index[p] == k
            assert shifted.loss_mask[p] == (has_next and step.loss_mask[p + 1] == 1)
            assert shifted.targets[p] == (step.tokens[p + 1] if has_next else 0)
            for got, source in (
                (shifted.advantages, advantages), (shifted.old_logprobs, step.old_logprobs),
                (shifted.ref_logprobs, step.ref_logprobs),
            ):
                assert got[p] == (source[p + 1] if has_next else 0.0)


@pytest.mark.parametrize(
    "case,match",
    [
        ("mask-on-first-token", r"loss_mask\[3\] is 1"),
        ("short-advantages", "advantages has shape"),
        ("empty-trajectory", "strictly increase"),
    ],
)
def test_bad_inputs(case, match):
    offsets = np.array([0, 3, 5])
    tokens = np.arange(5)
    loss_mask = np.array([0, 1, 1, 0, 1])
    advantages = np.zeros(5)
    if case == "mask-on-first-token":
        loss_mask = np.array([0, 1, 1, 1, 1])
    elif case == "short-advantages":
        advantages = np.zeros(4)
    else:
        offsets = np.array([0, 3, 3, 5])
    with pytest.raises(ValueError, match=match):
        semantic_targets(offsets, tokens, loss_mask, advantages)
