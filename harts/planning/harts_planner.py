"""The HARTS microbatch planner: cut-point DP over the sorted order, refinement, greedy replicas.

`plan_harts(step, capacity, dp, ...) -> Plan` minimises the lexicographic objective of
`harts.planning.plans.objective`: total compact work W, then the slot critical path, then
the largest replica cumulative work. Deterministic: no clocks, no randomness in the search.

Formulation. Sort the N trajectories lexicographically (ranks r); L[r] is a length and
lcp[r] = LCP(r - 1, r). A microbatch's work is the trie size of its members, Σ L - Σ LCP of
consecutive members in rank order, so W = C + Σ (sharing lost): for a partition into
contiguous runs W = C + Σ_{cuts c} lcp[c] — a cut at a shallow fork (an LCP valley) loses the
least. A run i..j-1 costs (Σ L - Σ lcp)[i..j) in O(1) from prefix sums, and the LCP of any two
ranks is a range minimum (sparse table), which prices non-contiguous microbatches too.

Search tiers, by size (the details in each module's docstring):
1. "exact" (N <= `exact_max_trajectories`): branch and bound over all set partitions
   (`harts_search.exact_partition`). Optimal.
2. "cluster-packing" (refinement on): whole clusters (the step's task trees under its common prefix g0) packed
   into few microbatches, split only where they fit none whole, then balanced (`harts_packing.whole_cluster_plan`).
   A trajectory-level move out of a cluster raises W by at least its cut cost, so the trajectory-level refinement
   runs on this plan only when some cluster cuts for less than `refine_packed_split_ratio`·g0
   ("cluster-packing+refine").
3. "dp": DP over cut points (`harts_search.cut_point_dp`), exact among contiguous partitions. With a
   cluster-packing plan it runs only on steps of at most `dp_with_packing_max_trajectories` (see the field).
4. "restricted-dp" (when N² · window, the full table's cells, exceeds `dp_max_cells`): the same recursion keeping
   a band of counts per prefix.
The DP plan (tiers 3 and 4) is refined by `harts_refine.refine` (moves, swaps, eliminations, K mod D repair,
repacking, balancing); the plan with the smallest objective among the tiers that ran is returned
(`details["tier"]`). When the DP's W already equals the lower bound of `harts.planning.bounds.plan_bounds` (no plan
of any shape has less W), the W-lowering stages cannot change anything and are skipped: only balancing runs (the
result is the same as the full refinement's; tested). `details["work_gap_to_bound"]` reports the final W minus
that bound (0: W proven optimal).

Then, with `refine` and `tail` on, the slot-tail pass (`harts_tail.refine_tail`) evens out the most imbalanced
slots (max/mean - 1 above `tail_target`) by moves and swaps that raise neither W nor the objective
(`details["tail_changes"]`): the critical path sums absolute gaps, so light slots keep large relative ones.

Replicas: the greedy assignment of `greedy_assignment` (sort by work, D per slot, heaviest to the
least-loaded replica).

Modules, imports pointing up this list: `harts_search` (`HartsConfig`, the exact and DP tiers), `harts_packing`
(the cluster-packing tier), `harts_refine` (the refinement) and `harts_tail` (the slot-tail pass), then this one (the
tiers by size, the best kept, its tail evened out).
Tested against brute force and enumeration in tests/planning/test_harts_planner.py.
"""

from __future__ import annotations

import time
from dataclasses import fields, replace

import numpy as np

from harts.planning.bounds import plan_bounds
from harts.planning.harts_packing import whole_cluster_plan
from harts.planning.harts_refine import refine
from harts.planning.harts_search import HartsConfig, cut_point_dp, dp_window, exact_partition
from harts.planning.harts_tail import refine_tail
from harts.planning.plans import Plan, build_plan, objective
from harts.planning.rank_work import RankWork
from harts.trees.step import Step
from harts.trees.trie import PrefixIndex

def plan_harts(step: Step, capacity: int, dp: int, *, index: PrefixIndex | None = None,
               config: HartsConfig | None = None, **options) -> Plan:
    """The HARTS plan of `step` (`options` override `HartsConfig` fields)."""
    started = time.perf_counter()
    config = _configure(config, options)
    index = index or PrefixIndex.from_step(step)
    rw = RankWork(index)
    details: dict[str, object] = {}
    bound = plan_bounds(rw, capacity, dp).compact_tokens
    if rw.num <= config.exact_max_trajectories:
        bins = exact_partition(rw, capacity, dp)
        works = np.asarray([rw.trie(b) for b in bins], dtype=np.int64)
        details["tier"] = "exact"
    else:
        refining = config.refine and rw.num >= dp
        # (objective, tier, bins, works) of each candidate plan; the smallest objective wins.
        candidates: list[tuple[tuple[int, int, int], str, list[list[int]], np.ndarray]] = []
        packed = whole_cluster_plan(rw, capacity, dp, config) if refining and config.pack_clusters else None
        if packed is not None:
            details["clusters_split"] = packed[2]
            candidates.append((objective(packed[1], dp), "cluster-packing", packed[0], packed[1]))
            if rw.num <= config.refine_packed_max_trajectories and _cheap_split(rw, config.refine_packed_split_ratio):
                refined = refine(rw, packed[0], capacity, dp, config)
                refined_works = np.asarray([rw.trie(b) for b in refined], dtype=np.int64)
                candidates.append((objective(refined_works, dp), "cluster-packing+refine", refined, refined_works))
        if packed is None or rw.num <= config.dp_with_packing_max_trajectories:
            band = None
            if rw.num * dp_window(rw, capacity) * rw.num > config.dp_max_cells:
                band = max(config.count_band, dp)
            cut = cut_point_dp(rw, capacity, dp, band=band)
            details["dp_compact_tokens"] = sum(rw.trie(b) for b in cut)
            if refining:
                optimal = config.stop_at_bound and details["dp_compact_tokens"] == bound
                cut = refine(rw, cut, capacity, dp, config, work_optimal=optimal)
            cut_works = np.asarray([rw.trie(b) for b in cut], dtype=np.int64)
            candidates.append((objective(cut_works, dp), "dp" if band is None else "restricted-dp", cut, cut_works))
        _, details["tier"], bins, works = min(candidates, key=lambda candidate: candidate[0])
        if refining and config.tail:
            bins, details["tail_changes"] = refine_tail(rw, bins, capacity, dp, config)
            works = np.asarray([rw.trie(b) for b in bins], dtype=np.int64)
    details["work_gap_to_bound"] = int(works.sum()) - bound
    groups = [rw.order[np.asarray(b, dtype=np.int64)] for b in bins]
    return build_plan(step, groups, works, planner="harts", capacity=capacity, dp=dp,
                      started=started, details=details)


def _configure(config: HartsConfig | None, options: dict) -> HartsConfig:
    config = config or HartsConfig()
    names = {f.name for f in fields(HartsConfig)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise ValueError(f"harts planner: unknown option '{unknown[0]}' (allowed: {', '.join(sorted(names))})")
    return replace(config, **options) if options else config


def _cheap_split(rw: RankWork, ratio: float) -> bool:
    """Whether some cluster can be cut for less than `ratio`·g0 (a cut at rank c costs lcp[c] - g0)."""
    inner = rw.lcp_adjacent[1:][rw.lcp_adjacent[1:] > rw.common_prefix]
    return len(inner) > 0 and int(inner.min()) - rw.common_prefix < ratio * rw.common_prefix
