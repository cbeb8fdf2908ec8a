import numpy as np

from tests.trees.helpers import make_step, random_sequences


def random_step(seed, num=12, max_len=40, vocab=3):
    rng = np.random.default_rng(seed)
    return make_step(random_sequences(rng, num, max_len, vocab))


def random_splits(step, members, seed):
    """Up to 3 attention splits inside each member (groups with ancestors in a baseline layout)."""
    rng = np.random.default_rng(seed)
    return [np.sort(rng.choice(np.arange(1, n), size=min(3, n - 1), replace=False)) if n > 1 else np.zeros(0)
            for n in step.lengths[members]]
