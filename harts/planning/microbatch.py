"""Microbatch plans: the data model, the one validator, the one objective and the metrics (DESIGN §2).

Provides `Plan` / `Microbatch` (with a strict JSON round trip), `plan(step, capacity, dp,
planner=...)` (the entry point for every planner), `validate(plan, step)`, `plan_metrics`,
the greedy slot/replica assignment and the lexicographic objective shared by every planner.

Input: a `Step`, the capacity T (compact tokens per microbatch) and the DP degree D. Output: K
microbatches, each a list of trajectory ids with its work, slot and replica, listed in
(slot, replica) order, so the runtime reads `plan.microbatches` slot by slot, D at a time.

Guarantees (checked by `validate`, which recomputes every work from the trie so no planner can
misreport): every trajectory in exactly one microbatch; every microbatch's work <= T; K mod D = 0;
each slot holds exactly one microbatch per replica; empty microbatches only when the step has
fewer than D trajectories. A trajectory longer than T is a ValueError before any planner runs.

Work models: "compact" (the default) counts the microbatch's trie size, recomputed with
`PrefixIndex.segment_tree(members).num_compact_tokens`, whether or not the members are
contiguous in sorted order; "semantic" (the per-trajectory baseline, no sharing) counts
Σ len.

Objective (lexicographic, smaller is better): (1) total work W = Σ_k work_k; (2) slot
critical path Σ_slots max_{k in slot} work_k; (3) the largest replica cumulative work.
`objective(works, dp)` evaluates it for the greedy assignment `greedy_assignment`: sort the
microbatches by work (descending, ties by index), take them D at a time as slots, and inside a
slot give each microbatch, heaviest first, to the replica with the least cumulative work not
yet used in that slot (ties: lowest replica). Sorted grouping minimises Σ_slots max for a
given multiset of works, so (2) and (3) depend only on the works.

Metrics (`plan_metrics`, for any plan, with the plan's own slots and replicas): compact tokens
Σ work; the trie lower bound C (no cuts); planning wall time; slot imbalance of a slot =
max/mean - 1 over its D microbatches (0 for an all-empty slot) and its P95 over slots by the
nearest-rank method (the ⌈0.95·n⌉-th smallest of the n slot values); step imbalance =
max_r cumulative_r / mean_r cumulative_r - 1. Imbalances are fractions (0.0214 = 2.14%).

Tested against: a brute-force enumeration of all set partitions (the exact tier), the
validator on random steps for every planner, and a JSON round trip.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from harts.files import write_text
from harts.trees.step import Step
from harts.trees.trie import PrefixIndex

WORK_MODELS = ("compact", "semantic")
PLANNER_NAMES = ("harts", "treetrain-ortools", "greedy-trie", "per-trajectory")


@dataclass(kw_only=True, frozen=True)
class Microbatch:
    trajectory_ids: tuple[str, ...]
    """Member trajectories, in the step's batch order."""
    work: int
    """Compact tokens of the microbatch (semantic tokens under the "semantic" work model)."""
    slot: int
    """Synchronisation step: slot s runs microbatches s·D .. s·D + D - 1 of the plan."""
    replica: int
    """DP rank that executes the microbatch, 0 <= replica < D."""


@dataclass(kw_only=True)
class Plan:
    planner: str
    capacity: int
    """T: the most work a microbatch may hold."""
    dp: int
    """D: data-parallel replicas; K mod D = 0."""
    microbatches: list[Microbatch]
    """K microbatches in (slot, replica) order."""
    plan_seconds: float
    """Wall time of the planner, from the step in memory to the plan (prefix index included)."""
    work_model: str = "compact"
    details: dict[str, Any] = field(default_factory=dict)
    """Planner-specific facts (search tier, solver status, ...); plain JSON data."""

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatches)

    @property
    def compact_tokens(self) -> int:
        return sum(mb.work for mb in self.microbatches)

    def to_dict(self) -> dict[str, Any]:
        return {
            "planner": self.planner,
            "capacity": self.capacity,
            "dp": self.dp,
            "work_model": self.work_model,
            "plan_seconds": self.plan_seconds,
            "details": self.details,
            "microbatches": [
                {"trajectory_ids": list(mb.trajectory_ids), "work": mb.work, "slot": mb.slot, "replica": mb.replica}
                for mb in self.microbatches
            ],
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "plan") -> Plan:
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a JSON object")
        allowed = {"planner", "capacity", "dp", "work_model", "plan_seconds", "details", "microbatches"}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ValueError(f"{where}: unknown field '{unknown[0]}'")
        for name in ("planner", "capacity", "dp", "plan_seconds", "microbatches"):
            if name not in data:
                raise ValueError(f"{where}: missing field '{name}'")
        work_model = data.get("work_model", "compact")
        if work_model not in WORK_MODELS:
            raise ValueError(f"{where}: field 'work_model' must be one of {WORK_MODELS}, got {work_model!r}")
        if not isinstance(data["planner"], str):
            raise ValueError(f"{where}: field 'planner' must be a string")
        details = data.get("details", {})
        if not isinstance(details, dict):
            raise ValueError(f"{where}: field 'details' must be an object")
        if not isinstance(data["microbatches"], list):
            raise ValueError(f"{where}: field 'microbatches' must be a list")
        microbatches = []
        for k, item in enumerate(data["microbatches"]):
            at = f"{where}: microbatches[{k}]"
            if not isinstance(item, dict) or set(item) != {"trajectory_ids", "work", "slot", "replica"}:
                raise ValueError(f"{at}: expected an object with trajectory_ids, work, slot, replica")
            ids = item["trajectory_ids"]
            if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
                raise ValueError(f"{at}: 'trajectory_ids' must be a list of strings")
            microbatches.append(Microbatch(
                trajectory_ids=tuple(ids),
                work=_json_int(item["work"], at, "work"),
                slot=_json_int(item["slot"], at, "slot"),
                replica=_json_int(item["replica"], at, "replica"),
            ))
        seconds = data["plan_seconds"]
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise ValueError(f"{where}: field 'plan_seconds' must be a number")
        return cls(
            planner=data["planner"],
            capacity=_json_int(data["capacity"], where, "capacity"),
            dp=_json_int(data["dp"], where, "dp"),
            microbatches=microbatches,
            plan_seconds=float(seconds),
            work_model=work_model,
            details=details,
        )

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str, where: str = "plan") -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: invalid JSON ({error.msg} at line {error.lineno})") from None
        return cls.from_dict(data, where)

    def write(self, path: str | Path) -> None:
        write_text(path, self.to_json(indent=1) + "\n")

    @classmethod
    def read(cls, path: str | Path) -> Plan:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ValueError(f"{path}: no such plan file") from None
        return cls.from_json(text, str(path))


def _json_int(value: Any, where: str, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: field '{name}' must be an integer, got {value!r}")
    return value


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


def greedy_assignment(works: np.ndarray, dp: int) -> tuple[np.ndarray, np.ndarray]:
    """(slot, replica) of each microbatch under the greedy rule; len(works) must be a multiple of dp."""
    works = np.asarray(works, dtype=np.int64)
    assert len(works) % dp == 0
    by_work = np.argsort(-works, kind="stable")
    slot = np.empty(len(works), dtype=np.int64)
    replica = np.empty(len(works), dtype=np.int64)
    cumulative = np.zeros(dp, dtype=np.int64)
    for s in range(len(works) // dp):
        members = by_work[s * dp : (s + 1) * dp]
        # Heaviest first to the least-loaded replica; a stable sort keeps the lowest replica on ties.
        free = np.argsort(cumulative, kind="stable")
        slot[members] = s
        replica[members] = free
        cumulative[free] += works[members]
    return slot, replica


def objective(works: np.ndarray, dp: int) -> tuple[int, int, int]:
    """(total work, slot critical path, largest replica cumulative) under the greedy assignment."""
    works = np.asarray(works, dtype=np.int64)
    slot, replica = greedy_assignment(works, dp)
    critical = np.zeros(len(works) // dp, dtype=np.int64)
    np.maximum.at(critical, slot, works)
    cumulative = np.bincount(replica, weights=works, minlength=dp)
    return int(works.sum()), int(critical.sum()), int(round(cumulative.max())) if len(works) else 0


def build_plan(
    step: Step, groups: list[np.ndarray], works: np.ndarray, *, planner: str, capacity: int, dp: int,
    started: float, work_model: str = "compact", slot: np.ndarray | None = None,
    replica: np.ndarray | None = None, details: dict[str, Any] | None = None,
) -> Plan:
    """A Plan from member index arrays; slots and replicas greedy unless given."""
    works = np.asarray(works, dtype=np.int64)
    if slot is None:
        slot, replica = greedy_assignment(works, dp)
    assert replica is not None
    order = np.lexsort((replica, slot))
    # Every group's members in batch order with one sort: by (group, trajectory index).
    sizes = np.asarray([len(g) for g in groups], dtype=np.int64)
    members = np.concatenate([np.asarray(g, dtype=np.int64) for g in groups])
    members = members[np.lexsort((members, np.repeat(np.arange(len(groups)), sizes)))]
    ids = list(map(step.ids.__getitem__, members.tolist()))
    ends = np.cumsum(sizes).tolist()
    starts = [0] + ends[:-1]
    microbatches = [
        Microbatch(
            trajectory_ids=tuple(ids[starts[k] : ends[k]]),
            work=int(works[k]), slot=int(slot[k]), replica=int(replica[k]),
        )
        for k in order.tolist()
    ]
    return Plan(
        planner=planner, capacity=capacity, dp=dp, microbatches=microbatches,
        plan_seconds=time.perf_counter() - started, work_model=work_model, details=details or {},
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
