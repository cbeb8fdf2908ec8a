"""Microbatch planning: the entry point of every planner, the one validator and the metrics (DESIGN §2).

Provides `plan(step, capacity, dp, planner=...)` (the entry point for every planner),
`validate(plan, step)` and `plan_metrics`. The plan's data model (`Plan`, `Microbatch`), the greedy
slot/replica assignment and the lexicographic objective shared by every planner are in
harts.planning.plans, which the planners import (and not this module, which imports them).

Input: a `Step`, the capacity T (compact tokens per microbatch) and the DP degree D. Output: K
microbatches, each a list of trajectory ids with its work, slot and replica, listed in
(slot, replica) order, so the runtime reads `plan.microbatches` slot by slot, D at a time.

Guarantees (checked by `validate`, which recomputes every work from the trie so no planner can
misreport): every trajectory in exactly one microbatch; every microbatch's work <= T; K mod D = 0;
each slot holds exactly one microbatch per replica; empty microbatches only when the step has
fewer than D trajectories. A trajectory longer than T is a ValueError before any planner runs.

Metrics (`plan_metrics`, for any plan, with the plan's own slots and replicas): compact tokens
Σ work; the trie lower bound C (no cuts); planning wall time; slot imbalance of a slot =
max/mean - 1 over its D microbatches (0 for an all-empty slot) and its P95 over slots by the
nearest-rank method (the ⌈0.95·n⌉-th smallest of the n slot values); step imbalance =
max_r cumulative_r / mean_r cumulative_r - 1. Imbalances are fractions (0.0214 = 2.14%).

Tested against: a brute-force enumeration of all set partitions (the exact tier), the
validator on random steps for every planner, and a JSON round trip.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from harts.config.execution import PLANNERS
from harts.planning.plans import WORK_MODELS, Plan
from harts.trees.step import Step
from harts.trees.trie import PrefixIndex

PLANNER_NAMES = PLANNERS


MAX_REPLICAS = 1 << 20
"""The most data-parallel replicas a plan takes: a plan holds at least D microbatches, so a D near 2^62 would
be refused only by the memory it cannot allocate."""


def check_capacity(step: Step, capacity: int, dp: int) -> None:
    """ValueError for bad T or D, or a trajectory longer than T (microbatches never split one)."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    if not 1 <= dp <= MAX_REPLICAS:
        raise ValueError(f"dp must be between 1 and {MAX_REPLICAS:,}, got {dp:,}")
    if step.num_trajectories == 0:
        raise ValueError(f"{step.source}: the step has no trajectories")
    longest = int(np.argmax(step.lengths))
    if step.lengths[longest] > capacity:
        raise ValueError(
            f"{step.source}: trajectory '{step.ids[longest]}' has {int(step.lengths[longest]):,} tokens, "
            f"more than the capacity T = {capacity:,} (a trajectory is never split across microbatches)"
        )


def validate(plan: Plan, step: Step, index: PrefixIndex | None = None) -> None:
    """Raise ValueError naming the first violated guarantee; return None for a valid plan."""
    where = f"plan '{plan.planner}'"
    if plan.dp < 1 or plan.capacity < 1:
        raise ValueError(f"{where}: dp and capacity must be >= 1 (got dp={plan.dp}, capacity={plan.capacity})")
    if plan.work_model not in WORK_MODELS:
        raise ValueError(f"{where}: unknown work model {plan.work_model!r}")
    num = plan.num_microbatches
    if num == 0 or num % plan.dp:
        raise ValueError(f"{where}: {num} microbatches is not a positive multiple of D = {plan.dp}")
    position = {trajectory: k for k, trajectory in enumerate(step.ids)}
    seen = np.zeros(step.num_trajectories, dtype=bool)
    members: list[np.ndarray] = []
    for k, mb in enumerate(plan.microbatches):
        indices = []
        for trajectory in mb.trajectory_ids:
            if trajectory not in position:
                raise ValueError(f"{where}: microbatch {k}: unknown trajectory '{trajectory}'")
            i = position[trajectory]
            if seen[i]:
                raise ValueError(f"{where}: microbatch {k}: trajectory '{trajectory}' appears twice")
            seen[i] = True
            indices.append(i)
        members.append(np.asarray(indices, dtype=np.int64))
    if not seen.all():
        missing = step.ids[int(np.argmin(seen))]
        raise ValueError(f"{where}: trajectory '{missing}' is in no microbatch ({int((~seen).sum())} missing)")
    if any(len(m) == 0 for m in members) and step.num_trajectories >= plan.dp:
        raise ValueError(
            f"{where}: empty microbatch with {step.num_trajectories} >= D = {plan.dp} trajectories"
        )
    if plan.work_model == "compact":
        index = index or PrefixIndex.from_step(step)
    for k, (mb, m) in enumerate(zip(plan.microbatches, members)):
        if plan.work_model == "compact":
            actual = index.segment_tree(m).num_compact_tokens if len(m) else 0
        else:
            actual = int(step.lengths[m].sum())
        if mb.work != actual:
            raise ValueError(f"{where}: microbatch {k}: reported work {mb.work:,} but its trie has {actual:,}")
        if actual > plan.capacity:
            raise ValueError(f"{where}: microbatch {k}: work {actual:,} exceeds the capacity {plan.capacity:,}")
    for k, mb in enumerate(plan.microbatches):
        if mb.slot != k // plan.dp or mb.replica != k % plan.dp:
            raise ValueError(
                f"{where}: microbatch {k} has (slot {mb.slot}, replica {mb.replica}); expected "
                f"(slot {k // plan.dp}, replica {k % plan.dp}): every slot holds one microbatch per replica, "
                "listed in (slot, replica) order"
            )


@dataclass(kw_only=True)
class PlanMetrics:
    planner: str
    num_microbatches: int
    compact_tokens: int
    """Σ work over the plan's microbatches."""
    lower_bound_compact_tokens: int
    """C: the trie size of the whole step (a plan with no cuts)."""
    semantic_tokens: int
    plan_seconds: float
    slot_imbalance: list[float]
    """max/mean - 1 per slot, in slot order."""
    p95_slot_imbalance: float
    max_slot_imbalance: float
    step_imbalance: float
    critical_path: int
    """Σ over slots of the slot's largest work."""
    max_replica_work: int

    def summary(self) -> dict[str, Any]:
        """The `harts plan microbatches --json` object."""
        return {
            "planner": self.planner,
            "microbatches": self.num_microbatches,
            "compact_tokens": self.compact_tokens,
            "lower_bound_compact_tokens": self.lower_bound_compact_tokens,
            "plan_seconds": self.plan_seconds,
            "p95_slot_imbalance": self.p95_slot_imbalance,
            "step_imbalance": self.step_imbalance,
        }


def nearest_rank(values: np.ndarray, percent: float) -> float:
    """The ⌈p/100·n⌉-th smallest value (nearest-rank percentile); 0.0 for no values."""
    values = np.sort(np.asarray(values, dtype=np.float64))
    if not len(values):
        return 0.0
    return float(values[min(len(values), max(1, math.ceil(percent / 100 * len(values)))) - 1])


def plan_metrics(plan: Plan, lower_bound: int, semantic_tokens: int) -> PlanMetrics:
    """DESIGN §2's metrics of a (validated) plan; `lower_bound` is the step's trie size C."""
    works = np.asarray([mb.work for mb in plan.microbatches], dtype=np.int64)
    slots = np.asarray([mb.slot for mb in plan.microbatches], dtype=np.int64)
    replicas = np.asarray([mb.replica for mb in plan.microbatches], dtype=np.int64)
    num_slots = int(slots.max()) + 1 if len(slots) else 0
    largest = np.zeros(num_slots, dtype=np.int64)
    np.maximum.at(largest, slots, works)
    mean = np.bincount(slots, weights=works, minlength=num_slots) / plan.dp
    imbalance = np.where(mean > 0, largest / np.where(mean > 0, mean, 1) - 1, 0.0)
    cumulative = np.bincount(replicas, weights=works, minlength=plan.dp)
    step_imbalance = float(cumulative.max() / cumulative.mean() - 1) if cumulative.mean() > 0 else 0.0
    return PlanMetrics(
        planner=plan.planner,
        num_microbatches=plan.num_microbatches,
        compact_tokens=int(works.sum()),
        lower_bound_compact_tokens=int(lower_bound),
        semantic_tokens=int(semantic_tokens),
        plan_seconds=plan.plan_seconds,
        slot_imbalance=[float(x) for x in imbalance],
        p95_slot_imbalance=nearest_rank(imbalance, 95),
        max_slot_imbalance=float(imbalance.max()) if len(imbalance) else 0.0,
        step_imbalance=step_imbalance,
        critical_path=int(largest.sum()),
        max_replica_work=int(round(cumulative.max())) if len(cumulative) else 0,
    )


def _planners() -> dict[str, Callable[..., Plan]]:
    from harts.planning.baselines import plan_greedy_trie, plan_per_trajectory
    from harts.planning.harts_planner import plan_harts
    from harts.planning.treetrain import plan_treetrain_ortools

    return {
        "harts": plan_harts,
        "treetrain-ortools": plan_treetrain_ortools,
        "greedy-trie": plan_greedy_trie,
        "per-trajectory": plan_per_trajectory,
    }


def plan(step: Step, capacity: int, dp: int, planner: str = "harts", *,
         index: PrefixIndex | None = None, **options: Any) -> Plan:
    """Plan the step's microbatches with the named planner (options go to its config).

    The wall time in `Plan.plan_seconds` includes building the prefix index unless `index` is
    given (then the caller has paid for it).
    """
    planners = _planners()
    if planner not in planners:
        raise ValueError(f"unknown planner {planner!r} (choose from {', '.join(PLANNER_NAMES)})")
    check_capacity(step, capacity, dp)
    return planners[planner](step, capacity, dp, index=index, **options)
