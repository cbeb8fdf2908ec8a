"""Plan data model, JSON round trip, validator, greedy assignment, objective and metrics."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from harts.planning.microbatch import PLANNER_NAMES, nearest_rank, plan, plan_metrics, validate
from harts.planning.plans import Microbatch, Plan, greedy_assignment, objective
from harts.trees.trie import PrefixIndex

from ..trees.helpers import make_step
from .microbatch_helpers import rollout_step

SHAPE = dict(num_tasks=3, branches=(2, 6), shared=20, prompt=(2, 8), continuation=(5, 40))
OPTIONS = {"treetrain-ortools": {"time_limit_s": 2.0}}


@pytest.fixture
def step():
    return rollout_step(np.random.default_rng(42), **SHAPE)


@pytest.mark.parametrize("planner", PLANNER_NAMES)
def test_json_round_trip(step, planner, tmp_path):
    result = plan(step, 128, 2, planner, **OPTIONS.get(planner, {}))
    again = Plan.from_json(result.to_json())
    assert again == result
    result.write(tmp_path / "plan.json")
    assert Plan.read(tmp_path / "plan.json") == result
    validate(again, step)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("dp"), "missing field 'dp'"),
    (lambda d: d.update(extra=1), "unknown field 'extra'"),
    (lambda d: d.update(capacity="big"), "'capacity' must be an integer"),
    (lambda d: d.update(work_model="tokens"), "'work_model' must be one of"),
    (lambda d: d["microbatches"][0].update(work=1.5), "microbatches[0]: field 'work' must be an integer"),
    (lambda d: d["microbatches"][1].update(trajectory_ids=[3]), "microbatches[1]: 'trajectory_ids'"),
    (lambda d: d["microbatches"][0].pop("slot"), "microbatches[0]: expected an object"),
], ids=["missing", "unknown", "int-type", "work-model", "work-type", "ids-type", "microbatch-keys"])
def test_from_dict_rejects_bad_fields(step, change, message):
    data = plan(step, 128, 2).to_dict()
    change(data)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Plan.from_dict(data, "plan.json")


def test_from_json_rejects_invalid_json():
    with pytest.raises(ValueError, match="plan.json: invalid JSON"):
        Plan.from_json("{", "plan.json")


def _tampered(result: Plan, k: int, **changes) -> Plan:
    microbatches = list(result.microbatches)
    microbatches[k] = dataclasses.replace(microbatches[k], **changes)
    return dataclasses.replace(result, microbatches=microbatches)


def _move_last(result: Plan, source: int, target: int) -> Plan:
    """Move the last trajectory of microbatch `source` to `target`, with correct works."""
    ids = [list(mb.trajectory_ids) for mb in result.microbatches]
    ids[target].append(ids[source].pop())
    return dataclasses.replace(result, microbatches=[
        dataclasses.replace(mb, trajectory_ids=tuple(i)) for mb, i in zip(result.microbatches, ids)
    ])


def test_validate_catches_every_broken_guarantee(step):
    result = plan(step, 128, 2)
    index = PrefixIndex.from_step(step)
    validate(result, step, index)
    first = result.microbatches[0]
    cases = {
        "reported work": _tampered(result, 0, work=first.work + 1),
        "unknown trajectory": _tampered(result, 0, trajectory_ids=first.trajectory_ids + ("nope",)),
        "appears twice": _tampered(result, 1, trajectory_ids=result.microbatches[1].trajectory_ids
                                   + first.trajectory_ids[:1]),
        "is in no microbatch": _tampered(result, 0, trajectory_ids=first.trajectory_ids[1:],
                                         work=index.segment_tree(
                                             np.asarray([step.ids.index(i) for i in first.trajectory_ids[1:]])
                                         ).num_compact_tokens),
        "not a positive multiple": dataclasses.replace(result, microbatches=result.microbatches[:-1]),
        "expected \\(slot": _tampered(result, 0, replica=1),
        "exceeds the capacity": dataclasses.replace(result, capacity=first.work - 1),
    }
    for message, broken in cases.items():
        with pytest.raises(ValueError, match=message):
            validate(broken, step, index)


def test_validate_recomputes_non_contiguous_work(step):
    """Works of moved trajectories are the members' trie, whatever the sorted order."""
    result = _move_last(plan(step, 10_000, 2), 0, 1)
    with pytest.raises(ValueError, match="reported work"):
        validate(result, step)
    index = PrefixIndex.from_step(step)
    fixed = dataclasses.replace(result, microbatches=[
        dataclasses.replace(mb, work=index.segment_tree(
            np.asarray([step.ids.index(i) for i in mb.trajectory_ids])).num_compact_tokens)
        for mb in result.microbatches
    ])
    validate(fixed, step, index)


def test_validate_empty_microbatches_only_below_dp():
    small = make_step([[1, 2, 3], [1, 2, 4]])
    result = plan(small, 100, 4)
    assert sum(1 for mb in result.microbatches if not mb.trajectory_ids) == 3
    validate(result, small)
    big = make_step([[1, 2, 3], [1, 2, 4], [5, 6], [7]])
    merged = Plan(planner="x", capacity=100, dp=2, plan_seconds=0.0, microbatches=[
        Microbatch(trajectory_ids=("t0", "t1", "t2", "t3"), work=7, slot=0, replica=0),
        Microbatch(trajectory_ids=(), work=0, slot=0, replica=1),
    ])
    with pytest.raises(ValueError, match="empty microbatch"):
        validate(merged, big)


def test_validate_semantic_work_model(step):
    result = plan(step, 256, 2, "per-trajectory")
    assert result.work_model == "semantic"
    validate(result, step)
    with pytest.raises(ValueError, match="reported work"):
        validate(dataclasses.replace(result, work_model="compact"), step)


@pytest.mark.parametrize("planner", PLANNER_NAMES)
def test_trajectory_longer_than_capacity_is_a_clear_error(planner):
    long_step = make_step([[1] * 10, [1] * 5 + [2] * 20, [3] * 4], ids=["a", "b", "c"])
    with pytest.raises(ValueError, match="trajectory 'b' has 25 tokens, more than the capacity T = 24"):
        plan(long_step, 24, 1, planner)


@pytest.mark.parametrize("capacity, dp, message", [
    (0, 1, "capacity must be >= 1, got 0"),
    (10, 0, "dp must be between 1 and 1,048,576, got 0"),
    (10, 2**62, "dp must be between 1 and 1,048,576, got 4,611,686,018,427,387,904"),
], ids=["capacity", "dp-zero", "dp-huge"])
def test_bad_capacity_or_dp(step, capacity, dp, message):
    """A D near 2^62 is refused before the plan allocates its D microbatches (it ran out of memory)."""
    with pytest.raises(ValueError, match=f"^{message}$"):
        plan(step, capacity, dp)


def test_unknown_planner_and_option(step):
    with pytest.raises(ValueError, match="unknown planner 'best'"):
        plan(step, 128, 2, "best")
    with pytest.raises(ValueError, match="unknown option 'beam'"):
        plan(step, 128, 2, "harts", beam=3)


def test_greedy_assignment_by_hand():
    works = np.array([5, 9, 1, 7, 3, 8])
    slot, replica = greedy_assignment(works, 2)
    # Sorted: 9 8 | 7 5 | 3 1. Slot 0: 9 -> r0, 8 -> r1; slot 1: r1 (8) is lighter, so 7 -> r1,
    # 5 -> r0; slot 2: r0 = 14 < r1 = 15, so 3 -> r0 and 1 -> r1.
    assert slot.tolist() == [1, 0, 2, 1, 2, 0]
    assert replica.tolist() == [0, 0, 1, 1, 0, 1]
    assert objective(works, 2) == (33, 9 + 7 + 3, 17)


def test_greedy_assignment_one_replica_per_slot():
    rng = np.random.default_rng(42)
    works = rng.integers(0, 100, 48)
    slot, replica = greedy_assignment(works, 8)
    for s in range(6):
        assert sorted(replica[slot == s].tolist()) == list(range(8))
    # Sorted grouping: every slot's works lie between the next slot's and the previous slot's.
    maxima = [works[slot == s].max() for s in range(6)]
    minima = [works[slot == s].min() for s in range(6)]
    assert all(minima[s] >= maxima[s + 1] for s in range(5))


def test_nearest_rank():
    values = np.array([0.5, 0.1, 0.4, 0.2, 0.3])
    assert nearest_rank(values, 95) == 0.5
    assert nearest_rank(values, 60) == 0.3
    assert nearest_rank(values, 0) == 0.1
    assert nearest_rank(np.arange(1, 101), 95) == 95


def test_metrics_by_hand():
    result = Plan(planner="x", capacity=100, dp=2, plan_seconds=1.5, microbatches=[
        Microbatch(trajectory_ids=("a",), work=10, slot=0, replica=0),
        Microbatch(trajectory_ids=("b",), work=30, slot=0, replica=1),
        Microbatch(trajectory_ids=("c",), work=20, slot=1, replica=0),
        Microbatch(trajectory_ids=("d",), work=20, slot=1, replica=1),
    ])
    metrics = plan_metrics(result, lower_bound=70, semantic_tokens=90)
    assert metrics.compact_tokens == 80
    assert metrics.slot_imbalance == [0.5, 0.0]
    assert metrics.p95_slot_imbalance == 0.5
    assert metrics.step_imbalance == pytest.approx(50 / 40 - 1)
    assert metrics.critical_path == 50
    assert metrics.max_replica_work == 50
    assert set(metrics.summary()) == {
        "planner", "microbatches", "compact_tokens", "lower_bound_compact_tokens", "plan_seconds",
        "p95_slot_imbalance", "step_imbalance",
    }


RANDOM_SHAPES = {
    "trees": dict(num_tasks=4, branches=(2, 9), shared=30, prompt=(2, 10), continuation=(5, 60)),
    "forest": dict(num_tasks=5, branches=(1, 6), shared=0, prompt=(0, 4), continuation=(1, 40)),
    "duplicates": dict(num_tasks=3, branches=(3, 8), shared=10, prompt=(1, 3), continuation=(1, 6), duplicate=True),
    "tiny": dict(num_tasks=2, branches=(1, 4), shared=5, prompt=(1, 3), continuation=(1, 10)),
}


@pytest.mark.parametrize("planner", PLANNER_NAMES)
@pytest.mark.parametrize("shape", RANDOM_SHAPES)
def test_every_planner_validates_on_random_steps(planner, shape):
    rng = np.random.default_rng(42)
    planned = 0
    for case in range(6 if planner == "treetrain-ortools" else 15):
        step = rollout_step(rng, **RANDOM_SHAPES[shape])
        dp = int(rng.choice([1, 2, 3, 4, 8]))
        capacity = int(step.lengths.max()) * int(rng.choice([1, 2, 3]))
        try:
            result = plan(step, capacity, dp, planner, **OPTIONS.get(planner, {}))
        except ValueError as error:
            # Legitimate only when no count of non-empty microbatches can be a multiple of D.
            assert "no plan" in str(error) or "cannot fill" in str(error), str(error)
            continue
        validate(result, step)
        assert result.planner == planner
        planned += 1
    assert planned >= 3
