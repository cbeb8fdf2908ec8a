"""Random steps whose trajectories share prefixes, with their compact map (a real trie)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harts.trees.step import TOKEN_DTYPE, Step
from harts.trees.trie import PrefixIndex


@dataclass(frozen=True)
class RandomTree:
    step: Step
    compact_map: np.ndarray
    """int64 [S] semantic position -> compact row."""
    num_compact: int


def random_tree_step(rng: np.random.Generator, *, num: int, max_len: int, vocab: int) -> RandomTree:
    """Trajectories copying random prefixes of earlier ones; random masks, advantages, log-probs."""
    sequences: list[list[int]] = []
    for _ in range(num):
        length = int(rng.integers(2, max_len + 1))
        if sequences and rng.random() < 0.85:
            base = sequences[int(rng.integers(len(sequences)))]
            keep = int(rng.integers(1, min(len(base), length) + 1))
            sequences.append(base[:keep] + rng.integers(0, vocab, length - keep).tolist())
        else:
            sequences.append(rng.integers(0, vocab, length).tolist())
    lengths = np.array([len(s) for s in sequences])
    offsets = np.zeros(num + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    size = int(offsets[-1])
    loss_mask = (rng.random(size) < 0.7).astype(np.uint8)
    loss_mask[offsets[:-1]] = 0
    step = Step(
        ids=tuple(f"t{k}" for k in range(num)),
        trees=tuple("task" for _ in range(num)),
        offsets=offsets,
        tokens=np.concatenate([np.asarray(s, dtype=TOKEN_DTYPE) for s in sequences]),
        loss_mask=loss_mask,
        rewards=rng.random(num).astype(np.float32),
        advantage_per_token=rng.standard_normal(size).astype(np.float32),
        old_logprobs=(-rng.random(size) * 3 - 2).astype(np.float32),
        ref_logprobs=(-rng.random(size) * 3 - 2).astype(np.float32),
    )
    tree = PrefixIndex.from_step(step).segment_tree()
    return RandomTree(step=step, compact_map=tree.compact_map(), num_compact=tree.num_compact_tokens)
