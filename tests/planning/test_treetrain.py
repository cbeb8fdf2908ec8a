"""The treetrain-ortools baseline: parts, replica assignment (FFD, LPT), the exact sharing model,
slot orders (solver, sorted), solve statuses, equal counts per replica."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from harts.planning import treetrain as tt
from harts.planning.microbatch import plan, validate
from harts.planning.rank_work import RankWork
from harts.trees.trie import PrefixIndex

from .microbatch_helpers import rollout_step

SHAPE = dict(num_tasks=4, branches=(3, 9), shared=25, prompt=(2, 8), continuation=(5, 50))


@pytest.fixture
def setting():
    rng = np.random.default_rng(42)
    step = rollout_step(rng, **SHAPE)
    index = PrefixIndex.from_step(step)
    return rng, step, index, RankWork(index)


def test_parts_are_whole_trees_or_root_level_subtrees(setting):
    _, step, index, rw = setting
    capacity = int(step.lengths.max()) + 10
    parts = tt._tree_parts(step, rw, capacity)
    assert sorted(r for p in parts for r in p) == list(range(rw.num))
    for tree in set(step.trees):
        ranks = sorted(int(rw.rank[k]) for k in range(step.num_trajectories) if step.trees[k] == tree)
        mine = [p for p in parts if set(p) <= set(ranks)]
        assert sorted(r for p in mine for r in p) == ranks
        if rw.trie(ranks) <= capacity:
            assert mine == [ranks]
        else:
            assert len(mine) >= 2 and all(rw.trie(p) <= capacity for p in mine)
            # A part is a subtree: what its members share exceeds what they share with the rest.
            for part in mine:
                others = [r for r in ranks if r not in part]
                inside = min((rw.lcp(a, b) for a, b in zip(part, part[1:])), default=rw.lengths_list[part[0]])
                assert all(rw.lcp(a, b) < inside or len(part) == 1 for a in part for b in others)


def test_sharing_model_prices_any_set_of_parts_exactly(setting):
    rng, step, index, rw = setting
    parts = tt._tree_parts(step, rw, int(step.lengths.max()) + 5)
    sharing = tt._Sharing(index, rw)
    own, nodes = sharing.nodes(parts)
    for _ in range(100):
        chosen = sorted(rng.choice(len(parts), int(rng.integers(1, len(parts) + 1)), replace=False).tolist())
        model = sum(own[p] for p in chosen) + sum(length for length, members in nodes if set(members) & set(chosen))
        assert model == rw.trie(sorted(r for p in chosen for r in parts[p]))


@pytest.mark.parametrize(("rule", "sizes", "dp", "members", "capacity", "overflow"), [
    # Σ = 37, capacity ⌈37/3⌉ = 13: 9 -> r0, 7 -> r1, 6 -> r1 (13, exactly full), 5 -> r2, 4 -> r0 (13),
    # then 3, 2, 1 -> r2, the only replica with room.
    ("ffd", [9, 7, 6, 5, 4, 3, 2, 1], 3, [[0, 4], [1, 2], [3, 5, 6, 7]], 13, 0),
    # Σ = 19, capacity 10: 7 -> r0, 4, 4 -> r1 (8); 2 -> r0 (9), the first replica with room, not
    # r1 that it would fill (best fit); 1 -> r0 (10); 1 -> r1.
    ("ffd", [7, 4, 4, 2, 1, 1], 2, [[0, 3, 4], [1, 2, 5]], 10, 0),
    # Σ = 30, capacity 10: 7 -> r0, 7 -> r1, 6 -> r2; the first 5 fits nowhere and goes to the
    # least-loaded r2 (6), the second 5 to the least-loaded r0 (7, tied with r1: lowest replica).
    ("ffd", [7, 7, 6, 5, 5], 3, [[0, 4], [1], [2, 3]], 10, 2),
    # loads 9, 7, 6: 5 -> r2 (11), 4 -> r1 (11), 3 -> r0 (12), 2 -> r1 (11 ties 11: lowest), 1 -> r2.
    ("lpt", [9, 7, 6, 5, 4, 3, 2, 1], 3, [[0, 5], [1, 4, 6], [2, 3, 7]], None, None),
    ("lpt", [7, 7, 6, 5, 5], 3, [[0, 4], [1], [2, 3]], None, None),
], ids=["ffd-first-fit", "ffd-not-best-fit", "ffd-overflow-to-least-loaded", "lpt", "lpt-ties"])
def test_replica_assignment_exact_contents(rule, sizes, dp, members, capacity, overflow):
    assert tt._assign_replicas(sizes, dp, rule) == (members, capacity, overflow)


def _five_trees():
    """Five one-trajectory trees, no shared token: E 11, A 10, F 10, B 6, C 5 compact tokens."""
    from ..trees.helpers import make_step

    return make_step([[1] * 11, [2] * 10, [3] * 10, [4] * 6, [5] * 5], ids=list("EAFBC"))


# T = 11, D = 2. FFD (capacity 21): E, A -> r0; F, B, C -> r1. CP-SAT, parts in decreasing size,
# part i in bins 0..i: r0 = [E | A], r1 = [F | B+C] (F alone, B + C = 11), both unique optima.
# LPT: E -> r0, A -> r1, F -> r1, B -> r0, C -> r0: r0 = [E | B+C], r1 = [A | F].
# Slots as {slot: (replica 0's microbatch, replica 1's)}.
@pytest.mark.parametrize(("options", "slots"), [
    ({}, {0: ("E", "F"), 1: ("A", "BC")}),
    ({"replica_assignment": "ffd", "slot_order": "solver"}, {0: ("E", "F"), 1: ("A", "BC")}),
    ({"replica_assignment": "ffd", "slot_order": "sorted"}, {0: ("E", "BC"), 1: ("A", "F")}),
    ({"replica_assignment": "lpt", "slot_order": "solver"}, {0: ("E", "A"), 1: ("BC", "F")}),
    ({"replica_assignment": "lpt", "slot_order": "sorted"}, {0: ("E", "A"), 1: ("BC", "F")}),
], ids=["default", "ffd-solver", "ffd-sorted", "lpt-solver", "lpt-sorted"])
def test_slot_contents_per_reading(options, slots):
    step = _five_trees()
    result = plan(step, 11, 2, "treetrain-ortools", time_limit_s=5.0, **options)
    validate(result, step)
    got: dict[int, list[str]] = {}
    for mb in result.microbatches:
        got.setdefault(mb.slot, []).append("".join(sorted(mb.trajectory_ids, key="EAFBC".index)))
    assert {s: tuple(members) for s, members in got.items()} == slots
    assert result.details["replica_assignment"] == options.get("replica_assignment", "ffd")
    assert result.details["slot_order"] == options.get("slot_order", "solver")
    assert result.details["solve_summary"] == {"solves": 2, "optimal": 2, "stopped_by_limit": 0}


def test_default_reading_is_the_papers():
    config = tt.TreeTrainConfig()
    assert (config.replica_assignment, config.slot_order, config.time_limit_s) == ("ffd", "solver", 10.0)


@pytest.mark.parametrize(("field", "value"), [("replica_assignment", "bfd"), ("slot_order", "random")],
                         ids=["replica-assignment", "slot-order"])
def test_unknown_reading_is_an_error(field, value):
    with pytest.raises(ValueError, match=f"treetrain-ortools: {field} must be one of .*, got '{value}'"):
        tt.TreeTrainConfig(**{field: value})


@pytest.mark.parametrize("dp", [1, 2, 3], ids=lambda d: f"D{d}")
def test_plans_validate_with_equal_counts_per_replica(setting, dp):
    _, step, index, rw = setting
    result = plan(step, int(step.lengths.max()) + 40, dp, "treetrain-ortools", time_limit_s=2.0, slot_order="sorted")
    validate(result, step, index)
    replicas = result.details["replicas"]
    assert len(replicas) == dp and all(r["status"] in ("OPTIMAL", "FEASIBLE") for r in replicas)
    for r in range(dp):
        works = [mb.work for mb in result.microbatches if mb.replica == r]
        assert works == sorted(works, reverse=True)


@pytest.mark.parametrize(("time_limit", "status", "optimal", "stopped"), [
    (10.0, {"OPTIMAL"}, True, False),
    # 1 ms is less than CP-SAT's presolve of 23 parts in 14 bins takes (it proves optimality in ~0.1 s).
    (1e-3, {"FEASIBLE", "UNKNOWN"}, False, True),
], ids=["optimal", "stopped-by-limit"])
def test_solve_status_is_recorded(time_limit, status, optimal, stopped):
    rng = np.random.default_rng(42)
    step = rollout_step(rng, **{**SHAPE, "num_tasks": 12})
    index = PrefixIndex.from_step(step)
    rw = RankWork(index)
    capacity = int(step.lengths.max()) + 40
    parts = tt._tree_parts(step, rw, capacity)
    config = tt.TreeTrainConfig(time_limit_s=time_limit)
    bins, info = tt._solve_replica(rw, tt._Sharing(index, rw), parts, capacity, config, count=None)
    assert info["status"] in status and (info["optimal"], info["stopped_by_limit"]) == (optimal, stopped)
    assert 0 < info["solver_seconds"] <= info["seconds"] and len(parts) == 23
    assert sorted(r for b in bins for r in b) == list(range(rw.num))


def test_solve_summary_counts_every_solve_but_empty_replicas():
    from ..trees.helpers import make_step

    # One tree, one part of 6 tokens: it fits no replica of FFD's capacity ⌈6/2⌉ = 3 and goes to the
    # least-loaded r0. Replica 1 stays empty (status EMPTY, not a solve); it borrows a root-level
    # subtree from replica 0, and both are solved again: three CP-SAT solves.
    step = make_step([[7, 7, 1], [7, 7, 2], [7, 7, 3], [7, 7, 4]], trees=["t"] * 4)
    result = plan(step, 20, 2, "treetrain-ortools", time_limit_s=5.0)
    validate(result, step)
    replicas = result.details["replicas"]
    assert [r["status"] for r in replicas] == ["OPTIMAL", "EMPTY"]
    assert all(r["equalised"]["status"] == "OPTIMAL" for r in replicas)
    assert result.details["solve_summary"] == {"solves": 3, "optimal": 3, "stopped_by_limit": 0}
    assert result.details["time_limit_s"] == 5.0
    assert (result.details["replica_capacity"], result.details["overflow_parts"]) == (3, 1)


def test_replica_solve_is_optimal_on_a_small_replica(setting):
    """CP-SAT's bins equal the best of every partition of a few parts (same lexicographic goal)."""
    _, step, index, rw = setting
    capacity = int(step.lengths.max()) + 30
    parts = tt._tree_parts(step, rw, capacity)[:6]
    bins, info = tt._solve_replica(rw, tt._Sharing(index, rw), parts, capacity, tt.TreeTrainConfig(), count=None)
    assert info["status"] == "OPTIMAL"
    best = None
    for assignment in itertools.product(range(len(parts)), repeat=len(parts)):
        groups: dict[int, list[int]] = {}
        for p, b in enumerate(assignment):
            groups.setdefault(b, []).extend(parts[p])
        works = [rw.trie(sorted(g)) for g in groups.values()]
        if max(works) <= capacity:
            key = (sum(works), len(works))
            best = key if best is None or key < best else best
    assert (sum(rw.trie(b) for b in bins), len(bins)) == best


def test_counts_are_equalised_by_splitting_parts():
    from ..trees.helpers import make_step

    # Parts by size: tree b (10 tokens, two trajectories), a (9), tree c (5). FFD (replica capacity
    # 12): b -> r0, a -> r1, c fits neither and goes to the least-loaded r1 (LPT does the same).
    # Replica 1 needs two microbatches (9 + 5 > 12); replica 0 holds one part that fits in one, so
    # it is split into b's two root-level subtrees and solved again.
    step = make_step([[6] * 8 + [1], [6] * 8 + [2], [1] * 9, [5, 5, 5, 1], [5, 5, 5, 2]],
                     trees=["b", "b", "a", "c", "c"])
    result = plan(step, 12, 2, "treetrain-ortools", time_limit_s=2.0)
    validate(result, step)
    assert result.num_microbatches == 4
    assert result.details["replicas"][0]["equalised"]["parts"] == 2
    assert sorted(mb.work for mb in result.microbatches) == [5, 9, 9, 9]


def test_counts_are_equalised_by_lending_trajectories():
    from ..trees.helpers import make_step

    # FFD (capacity 12) and LPT alike: b (10) -> r0, a (9) -> r1, tree c (5) -> r1: replica 1 needs two microbatches
    # (9 + 5 > 12), replica 0 holds one trajectory, so it borrows one of c's from replica 1.
    step = make_step([[6] * 10, [1] * 9, [5, 5, 5, 1], [5, 5, 5, 2]], trees=["b", "a", "c", "c"])
    result = plan(step, 12, 2, "treetrain-ortools", time_limit_s=2.0)
    validate(result, step)
    assert result.details["lent_to"] == {"0": [1]}
    assert result.num_microbatches == 4


def test_counts_that_cannot_be_equalised_are_an_error():
    from ..trees.helpers import make_step

    step = make_step([[1] * 9, [2] * 9, [3] * 9])
    with pytest.raises(ValueError, match="3 trajectories cannot fill 2 microbatches on each of 2 replicas"):
        plan(step, 10, 2, "treetrain-ortools", time_limit_s=2.0)


@pytest.mark.parametrize("time_limit", [0.0, -1.0, float("nan"), float("inf")], ids=["zero", "negative", "nan", "inf"])
def test_time_limit_must_be_finite_and_positive(time_limit):
    with pytest.raises(ValueError, match="time_limit_s must be a finite number > 0"):
        tt.TreeTrainConfig(time_limit_s=time_limit)
