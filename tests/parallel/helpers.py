"""Shared inputs of the parallel tests: a small step whose trajectories share prefixes, in 4 microbatches."""

from __future__ import annotations

import numpy as np

from tests.objective.helpers import random_tree_step


def tree_step_and_microbatches(seed: int = 42, *, num: int = 8, max_len: int = 60, num_microbatches: int = 4):
    """(step, microbatches): K = 4 microbatches of 2 trajectories (K mod 2 = 0 for dp2)."""
    rng = np.random.default_rng(seed)
    step = random_tree_step(rng, num=num, max_len=max_len, vocab=3).step
    order = rng.permutation(num)
    return step, [np.sort(part) for part in np.array_split(order, num_microbatches)]
