"""Whole-cluster packing: the critical-path pricing against sort-and-sum, the packings, balancing."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from harts.planning import cluster_packing as cp
from harts.planning.plans import objective


def _random_works(rng: np.random.Generator) -> tuple[np.ndarray, int]:
    dp = int(rng.integers(1, 6))
    count = dp * int(rng.integers(1, 7))
    # Few distinct values: ties between works are the delicate case of the pricing.
    return rng.integers(0, int(rng.choice([8, 60])), count).astype(np.int64), dp


@pytest.mark.parametrize("table", [False, True], ids=["search", "table"])
@pytest.mark.parametrize("seed", range(6), ids=lambda s: f"seed{s}")
def test_price_matches_sorting(seed, table):
    rng = np.random.default_rng([42, seed])
    for _ in range(300):
        works, dp = _random_works(rng)
        if len(works) < 2:
            continue
        ranks = cp.rank_table(works, 2 * int(works.max())) if table else None
        pricing = cp.CriticalPathChange(works, dp, ranks)
        lowered, raised = rng.choice(len(works), 2, replace=False)
        delta = int(rng.integers(0, works[lowered] + 1))
        expected = cp.naive_critical_path_change(works, dp, lowered, delta, raised, delta)
        got = pricing.price(works[[lowered]], np.array([delta]), works[[raised]])
        assert got.tolist() == [expected], (works.tolist(), dp, lowered, raised, delta)
        assert pricing.price_bins(np.array([lowered]), np.array([delta]), np.array([raised])).tolist() == [expected]
        if not pricing.can_lower(np.array([lowered]), np.array([delta]), np.array([raised]))[0]:
            assert expected >= 0, (works.tolist(), dp, lowered, raised, delta)


def test_rank_table_matches_binary_search():
    rng = np.random.default_rng(42)
    for _ in range(100):
        works, _ = _random_works(rng)
        limit = int(works.max()) + int(rng.integers(0, 5))
        values = np.arange(limit + 1)
        assert cp.rank_table(works, limit).tolist() == np.searchsorted(np.sort(works), values).tolist()


def test_critical_path_is_the_objectives_second_term():
    rng = np.random.default_rng(42)
    for _ in range(100):
        works, dp = _random_works(rng)
        assert cp.critical_path(works, dp) == objective(works, dp)[1]


@pytest.mark.parametrize("seed", range(4), ids=lambda s: f"seed{s}")
def test_fall_thresholds(seed):
    """Lowering a work by delta saves something exactly when delta exceeds its threshold."""
    rng = np.random.default_rng([42, seed])
    for _ in range(100):
        works, dp = _random_works(rng)
        thresholds = cp.fall_thresholds(works, dp)
        for k, work in enumerate(works.tolist()):
            for delta in range(work + 1):
                saved = -cp.naive_critical_path_change(works, dp, k, delta, k, 0)
                assert (saved > 0) == (delta > thresholds[k]), (works.tolist(), dp, k, delta)


def _bins_valid(sizes, bin_of, count, room) -> bool:
    loads = np.bincount(bin_of, weights=sizes, minlength=count)
    return len(loads) == count and loads.max() <= room and (np.bincount(bin_of, minlength=count) > 0).all()


def _optimal_bin_count(sizes: list[int], room: int) -> int:
    for count in range(1, len(sizes) + 1):
        for assignment in itertools.product(range(count), repeat=len(sizes)):
            if np.bincount(assignment, weights=sizes, minlength=count).max() <= room:
                return count
    raise AssertionError("every item fits alone")


@pytest.mark.parametrize("seed", range(4), ids=lambda s: f"seed{s}")
def test_packings(seed):
    rng = np.random.default_rng([42, seed])
    for _ in range(40):
        room = int(rng.integers(10, 40))
        sizes = rng.integers(1, room + 1, int(rng.integers(1, 8))).astype(np.int64)
        used = cp.first_fit_count(sizes, room)
        optimum = _optimal_bin_count(sizes.tolist(), room)
        # First-fit-decreasing: at most 11/9 OPT + 6/9 (Dósa 2007).
        assert optimum <= used <= 11 / 9 * optimum + 6 / 9
        for count in range(used, len(sizes) + 1):
            bin_of = _least_loaded(sizes, room, count)
            assert bin_of is None or _bins_valid(sizes, bin_of, count, room)
            assert _bins_valid(sizes, cp.pack_best_fit(sizes, room, count), count, room)
        assert cp.pack_best_fit(sizes, room, len(sizes) + 1) is None


def _naive_least_loaded(sizes: list[int], room: int, count: int, groups: list[int] | None) -> list[int] | None:
    """Largest first (ties: lowest index) to the least-loaded bin (ties: lowest) it fits holding no item of its group."""
    loads, held, bin_of = [0] * count, [set() for _ in range(count)], [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        options = [k for k in range(count) if loads[k] + sizes[i] <= room
                   and (groups is None or groups[i] not in held[k])]
        if not options:
            return None
        k = min(options, key=lambda k: (loads[k], k))
        loads[k] += sizes[i]
        bin_of[i] = k
        if groups is not None:
            held[k].add(groups[i])
    return bin_of if count <= len(sizes) and min(loads) > 0 else None


@pytest.mark.parametrize("grouped", [False, True], ids=["items", "groups"])
def test_least_loaded_matches_its_reference(grouped):
    rng = np.random.default_rng(42)
    placed = 0
    for _ in range(300):
        room = int(rng.integers(10, 40))
        sizes = rng.integers(1, room + 1, int(rng.integers(1, 12))).astype(np.int64)
        groups = rng.integers(0, 4, len(sizes)).astype(np.int64) if grouped else None
        count = int(rng.integers(1, len(sizes) + 2))
        got = cp.pack_least_loaded(sizes, room, count, groups)
        expected = _naive_least_loaded(sizes.tolist(), room, count, None if groups is None else groups.tolist())
        assert (got is None and expected is None) or got.tolist() == expected
        if got is not None:
            placed += 1
            assert _bins_valid(sizes, got, count, room)
            if grouped:
                assert len({(g, k) for g, k in zip(groups.tolist(), got.tolist())}) == len(sizes)
    assert placed >= 100


def test_best_fit_matches_argmax():
    """The fullest unblocked bin within the limit (ties: lowest), as a masked argmax finds it."""
    rng = np.random.default_rng(42)
    for _ in range(50):
        count = int(rng.integers(1, 12))
        fit, loads = cp.BestFit(count), np.zeros(count, dtype=np.int64)
        for _ in range(30):
            limit = int(rng.integers(-2, 40))
            blocked = rng.random(count) < 0.3 if rng.random() < 0.5 else None
            allowed = (loads <= limit) & (~blocked if blocked is not None else True)
            expected = int(np.argmax(np.where(allowed, loads, -1))) if allowed.any() else -1
            assert fit.find(limit, blocked) == expected
            k, size = int(rng.integers(count)), int(rng.integers(0, 6))
            fit.add(k, size)
            loads[k] += size
        assert fit.loads == loads.tolist()


def _least_loaded(sizes: np.ndarray, room: int, count: int) -> np.ndarray | None:
    """Largest first to the least-loaded bin: a loosely balanced start for `balance`."""
    loads = np.zeros(count, dtype=np.int64)
    bin_of = np.empty(len(sizes), dtype=np.int64)
    for i in np.argsort(-sizes, kind="stable").tolist():
        k = int(np.argmin(loads))
        if loads[k] + sizes[i] > room:
            return None
        loads[k] += sizes[i]
        bin_of[i] = k
    return bin_of if count <= len(sizes) and (loads > 0).all() else None


def _instance(rng: np.random.Generator):
    """Tree-sized items: a few large ones that fill most of a bin, and small ones."""
    dp = int(rng.choice([2, 4, 8]))
    base, room = 40, 400
    large = rng.integers(room // 2, room, int(rng.integers(4, 20)))
    small = rng.integers(room // 20, room // 3, int(rng.integers(0, 30)))
    sizes = np.concatenate([large, small]).astype(np.int64)
    count = -(-cp.first_fit_count(sizes, room) // dp) * dp
    return sizes, count, dp, base, base + room


def _moves_and_swaps(bin_of: np.ndarray, count: int):
    for x in range(len(bin_of)):
        for target in range(count):
            if target != bin_of[x]:
                changed = bin_of.copy()
                changed[x] = target
                yield changed
        for y in range(x + 1, len(bin_of)):
            if bin_of[y] != bin_of[x]:
                changed = bin_of.copy()
                changed[x], changed[y] = bin_of[y], bin_of[x]
                yield changed


def test_balance_never_raises_the_critical_path_and_ends_at_a_local_optimum():
    rng = np.random.default_rng(42)
    improved = 0
    for _ in range(25):
        sizes, count, dp, base, capacity = _instance(rng)
        room = capacity - base
        start = _least_loaded(sizes, room, count)
        if start is None:
            start = cp.pack_best_fit(sizes, room, count)
        if start is None:
            continue
        before = start.copy()
        balanced = cp.balance(sizes, start, count, dp, base=base, capacity=capacity, max_rounds=10_000)
        assert (start == before).all(), "the input is not modified"
        assert _bins_valid(sizes, balanced, count, room)

        def path(bin_of):
            return cp.critical_path(base + np.bincount(bin_of, weights=sizes, minlength=count).astype(np.int64), dp)

        assert path(balanced) <= path(start)
        improved += path(balanced) < path(start)
        # No single move or swap that keeps every bin non-empty and within the capacity does better.
        best = path(balanced)
        for changed in _moves_and_swaps(balanced, count):
            if _bins_valid(sizes, changed, count, room):
                assert path(changed) >= best
    assert improved >= 10


def test_balance_with_and_without_the_rank_table(monkeypatch):
    """Above `_RANK_TABLE_MAX` the pricing searches instead of looking up: the same moves."""
    rng = np.random.default_rng(42)
    for _ in range(25):
        sizes, count, dp, base, capacity = _instance(rng)
        start = cp.pack_best_fit(sizes, capacity - base, count)
        if start is None:
            continue
        with_table = cp.balance(sizes, start, count, dp, base=base, capacity=capacity, max_rounds=100)
        monkeypatch.setattr(cp, "_RANK_TABLE_MAX", 0)
        searched = cp.balance(sizes, start, count, dp, base=base, capacity=capacity, max_rounds=100)
        monkeypatch.undo()
        assert (with_table == searched).all()


def test_balance_is_deterministic():
    sizes, count, dp, base, capacity = _instance(np.random.default_rng(7))
    start = cp.pack_best_fit(sizes, capacity - base, count)
    first = cp.balance(sizes, start, count, dp, base=base, capacity=capacity, max_rounds=100)
    second = cp.balance(sizes, start, count, dp, base=base, capacity=capacity, max_rounds=100)
    assert (first == second).all()


def test_groups_never_share_a_bin_in_packing_and_balance():
    """Pieces of one cluster (a group) stay in different bins: best fit places them so, and balance
    keeps them so, ending where no group-respecting move or swap lowers the critical path."""
    rng = np.random.default_rng(5)
    checked = 0
    for _ in range(40):
        sizes, count, dp, base, capacity = _instance(rng)
        room = capacity - base
        groups = rng.integers(0, max(1, len(sizes) // 2), len(sizes))

        def apart(bin_of):
            return len({(g, b) for g, b in zip(groups.tolist(), bin_of.tolist())}) == len(sizes)

        start = cp.pack_best_fit(sizes, room, count, groups)
        if start is None:
            continue
        assert _bins_valid(sizes, start, count, room) and apart(start)
        balanced = cp.balance(sizes, start, count, dp, base=base, capacity=capacity, max_rounds=10_000, groups=groups)
        assert _bins_valid(sizes, balanced, count, room) and apart(balanced)

        def path(bin_of):
            return cp.critical_path(base + np.bincount(bin_of, weights=sizes, minlength=count).astype(np.int64), dp)

        assert path(balanced) <= path(start)
        for changed in _moves_and_swaps(balanced, count):
            if _bins_valid(sizes, changed, count, room) and apart(changed):
                assert path(changed) >= path(balanced)
        checked += 1
    assert checked >= 10
