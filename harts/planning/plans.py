"""Microbatch plans: the data model, the greedy slot/replica assignment and the objective every planner shares.

`Plan` / `Microbatch` (with a strict JSON round trip) hold K microbatches, each a list of
trajectory ids with its work, slot and replica, listed in (slot, replica) order. `build_plan`
makes a Plan from member index arrays; the planners (harts.planning.harts_planner, .baselines,
.treetrain) build theirs with it, and harts.planning.microbatch (the entry point `plan`, the
validator and the metrics) imports them: this module imports none of them.

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

Tested in tests/planning/test_microbatch.py (JSON round trip, greedy assignment and objective against
enumeration).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from harts.files import write_text
from harts.trees.step import Step

WORK_MODELS = ("compact", "semantic")


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

    def members(self, step: Step) -> list[np.ndarray]:
        """Each microbatch's trajectories as int64 indices into the step's batch order (the runtime's members), in
        the plan's (slot, replica) order; an empty microbatch is an empty array (a replica idle in its slot)."""
        position = {trajectory_id: k for k, trajectory_id in enumerate(step.ids)}
        return [np.asarray([position[t] for t in mb.trajectory_ids], dtype=np.int64) for mb in self.microbatches]

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
