"""One intra-op thread in this process (each spawned rank gets cpu_count // world from launch), and a small
step on disk whose trajectories share prefixes (forks mid-chunk for the tiny model's 16-row chunks)."""

import numpy as np
import pytest

from harts.trees.io import write_step
from tests.fixtures import one_thread  # noqa: F401  (autouse fixture)
from tests.objective.helpers import random_tree_step


@pytest.fixture(scope="session")
def tree_step_path(tmp_path_factory):
    """(path, Step): 8 trajectories of at most 48 tokens over a 5-token vocabulary, seed 42."""
    step = random_tree_step(np.random.default_rng(42), num=8, max_len=48, vocab=5).step
    path = tmp_path_factory.mktemp("bench") / "step.jsonl"
    write_step(step, path)
    return str(path), step
