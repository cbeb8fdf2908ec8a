"""Random rollout-tree steps for the microbatch planner tests, and brute-force oracles.

`rollout_step(rng, ...)`: `num_tasks` trees under a shared prefix of `shared` tokens (0 gives a
forest); each tree has a task prompt and branches that fork from a random position of an
earlier branch of the same tree (or right after the prompt), so trajectories share prefixes of
every depth, as agent rollouts do. Tokens come from a small vocabulary so that accidental
sharing happens too; `duplicate` repeats one trajectory verbatim.

`all_partitions(n)` enumerates every set partition of range(n); `brute_force_key` scores a
partition (works from `PrefixIndex.segment_tree`, not from the planner's rank arithmetic).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from harts.planning.plans import objective
from harts.trees.step import Step
from harts.trees.trie import PrefixIndex

from ..trees.helpers import make_step


def rollout_step(rng: np.random.Generator, *, num_tasks: int, branches: tuple[int, int], shared: int,
                 prompt: tuple[int, int], continuation: tuple[int, int], vocab: int = 5,
                 duplicate: bool = False) -> Step:
    system = rng.integers(0, vocab, shared).tolist()
    sequences, trees = [], []
    for task in range(num_tasks):
        base = system + [vocab + task] + rng.integers(0, vocab, int(rng.integers(*prompt))).tolist()
        paths: list[list[int]] = []
        for _ in range(int(rng.integers(*branches))):
            if paths and rng.random() < 0.8:
                parent = paths[int(rng.integers(len(paths)))]
                fork = int(rng.integers(len(base), len(parent) + 1))
                head = parent[:fork]
            else:
                head = base
            tail = rng.integers(0, vocab, int(rng.integers(*continuation))).tolist()
            paths.append(head + tail)
        sequences += paths
        trees += [f"tree{task}"] * len(paths)
    if duplicate and sequences:
        k = int(rng.integers(len(sequences)))
        sequences.append(list(sequences[k]))
        trees.append(trees[k])
    order = rng.permutation(len(sequences))
    return make_step([sequences[k] for k in order], ids=[f"x{k}" for k in range(len(order))],
                     trees=[trees[k] for k in order])


def all_partitions(n: int) -> Iterator[list[list[int]]]:
    """Every set partition of range(n) (restricted growth strings)."""
    def extend(i: int, blocks: list[list[int]]) -> Iterator[list[list[int]]]:
        if i == n:
            yield [list(b) for b in blocks]
            return
        for b in blocks:
            b.append(i)
            yield from extend(i + 1, blocks)
            b.pop()
        blocks.append([i])
        yield from extend(i + 1, blocks)
        blocks.pop()
    yield from extend(0, [])


def brute_force_key(index: PrefixIndex, blocks: list[list[int]], capacity: int, dp: int) -> tuple | None:
    """The objective of a partition of trajectory indices, or None if it breaks a guarantee."""
    num = len(index.lengths)
    if num >= dp and len(blocks) % dp:
        return None
    works = [index.segment_tree(np.asarray(b)).num_compact_tokens for b in blocks]
    if max(works) > capacity:
        return None
    works += [0] * (dp - len(works) if num < dp else 0)
    return objective(np.asarray(works), dp)


def plan_key(plan) -> tuple[int, int, int]:
    return objective(np.asarray([mb.work for mb in plan.microbatches]), plan.dp)


def grpo_step(rng: np.random.Generator, *, num_tasks: int, group: tuple[int, int], retries: tuple[int, int],
              shared: int, prompt: tuple[int, int], sample: tuple[int, int], retry: tuple[int, int],
              vocab: int = 50) -> Step:
    """GRPO-shaped rollout trees: per task, a group of samples forking right after the task prompt,
    each with retries forking late in it (the last half) and running briefly, under one shared prefix."""
    system = rng.integers(0, vocab, shared).tolist()
    sequences, trees = [], []
    for task in range(num_tasks):
        base = system + [vocab + task] + rng.integers(0, vocab, int(rng.integers(*prompt))).tolist()
        for s in range(int(rng.integers(*group))):
            path = base + [vocab + num_tasks + s] + rng.integers(0, vocab, int(rng.integers(*sample))).tolist()
            sequences.append(path)
            trees.append(f"tree{task}")
            for r in range(int(rng.integers(*retries))):
                fork = int(rng.integers(len(base) + (len(path) - len(base)) // 2, len(path)))
                tail = [vocab + num_tasks + 64 + r] + rng.integers(0, vocab, int(rng.integers(*retry))).tolist()
                sequences.append(path[:fork] + tail)
                trees.append(f"tree{task}")
    order = rng.permutation(len(sequences))
    return make_step([sequences[k] for k in order], ids=[f"x{k}" for k in range(len(order))],
                     trees=[trees[k] for k in order])
