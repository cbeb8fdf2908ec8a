"""Packing baselines: "greedy-trie" (AReaL-style tree packing) and "per-trajectory" (no sharing).

- `plan_greedy_trie`: trajectories in the step's input order, each into the first microbatch
  whose trie stays within T after adding it (first fit, no sorting), as AReaL's tree packing
  does; work = compact tokens.
- `plan_per_trajectory`: every trajectory is its own sequence (no prefix sharing); sequences are
  packed by first-fit-decreasing on length into microbatches of at most T tokens; work =
  semantic tokens (work model "semantic").

Both then reach K ≡ 0 mod D by splitting microbatches (greedy-trie: the split that loses the
least sharing; per-trajectory: the heaviest microbatch, halved by first-fit-decreasing), pad
with empty microbatches only when the step has fewer than D trajectories, and take slots and
replicas from the shared greedy assignment. Tested through `validate` on random steps.
"""

from __future__ import annotations

import bisect
import time

import numpy as np

from harts.planning.plans import Plan, build_plan
from harts.planning.rank_work import RankWork, no_plan_error, pad_to_dp, split_to_multiple
from harts.trees.step import Step
from harts.trees.trie import PrefixIndex


def plan_greedy_trie(step: Step, capacity: int, dp: int, *, index: PrefixIndex | None = None) -> Plan:
    started = time.perf_counter()
    index = index or PrefixIndex.from_step(step)
    rw = RankWork(index)
    bins: list[list[int]] = []
    works: list[int] = []
    lengths = rw.lengths_list
    for trajectory in range(step.num_trajectories):
        x = int(index.rank[trajectory])
        for k, members in enumerate(bins):
            added = lengths[x] - rw.share(members, x)
            if works[k] + added <= capacity:
                bisect.insort(members, x)
                works[k] += added
                break
        else:
            bins.append([x])
            works.append(lengths[x])
    if rw.num >= dp:
        split = split_to_multiple(rw, bins, dp)
        if split is None:
            raise no_plan_error(rw.num, dp, capacity)
        bins = split
    bins = pad_to_dp(bins, rw.num, dp)
    groups = [rw.order[np.asarray(b, dtype=np.int64)] for b in bins]
    return build_plan(step, groups, np.asarray([rw.trie(b) for b in bins]), planner="greedy-trie",
                      capacity=capacity, dp=dp, started=started)


def plan_per_trajectory(step: Step, capacity: int, dp: int, *, index: PrefixIndex | None = None) -> Plan:
    """First-fit-decreasing sequence packing; `index` is accepted for a uniform call and unused."""
    started = time.perf_counter()
    lengths = step.lengths
    bins: list[list[int]] = []
    loads: list[int] = []
    for trajectory in np.argsort(-lengths, kind="stable").tolist():
        length = int(lengths[trajectory])
        for k in range(len(bins)):
            if loads[k] + length <= capacity:
                bins[k].append(trajectory)
                loads[k] += length
                break
        else:
            bins.append([trajectory])
            loads.append(length)
    num = step.num_trajectories
    if num >= dp:
        while len(bins) % dp:
            splittable = [k for k in range(len(bins)) if len(bins[k]) >= 2]
            if not splittable:
                raise no_plan_error(num, dp, capacity)
            k = max(splittable, key=lambda i: (loads[i], -i))
            halves: list[list[int]] = [[], []]
            half_loads = [0, 0]
            for trajectory in bins[k]:
                side = int(half_loads[1] < half_loads[0])
                halves[side].append(trajectory)
                half_loads[side] += int(lengths[trajectory])
            bins[k:k + 1] = halves
            loads[k:k + 1] = half_loads
    bins = pad_to_dp(bins, num, dp)
    groups = [np.asarray(b, dtype=np.int64) for b in bins]
    works = np.asarray([int(lengths[g].sum()) for g in groups], dtype=np.int64)
    return build_plan(step, groups, works, planner="per-trajectory", capacity=capacity, dp=dp,
                      started=started, work_model="semantic")
