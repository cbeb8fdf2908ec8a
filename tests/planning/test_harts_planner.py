"""The HARTS planner's tiers against brute force, and its refinement stages."""

from __future__ import annotations

import hashlib
import itertools

import numpy as np
import pytest

from harts.planning import harts_refine as hr
from harts.planning.harts_search import HartsConfig, cut_point_dp
from harts.planning.microbatch import plan, validate
from harts.planning.plans import objective
from harts.planning.rank_work import RankWork
from harts.trees.synth_grpo import GRPO_SHAPES, generate_grpo_step
from harts.trees.trie import PrefixIndex

from ..trees.helpers import make_step
from .microbatch_helpers import all_partitions, brute_force_key, grpo_step, plan_key, rollout_step

TINY = dict(num_tasks=2, branches=(1, 4), shared=6, prompt=(1, 4), continuation=(1, 12))
MEDIUM = dict(num_tasks=5, branches=(3, 10), shared=30, prompt=(2, 10), continuation=(5, 60))


def _tight_capacity(rng: np.random.Generator, step) -> int:
    """Between the longest trajectory and a bit more: most partitions are infeasible."""
    return int(step.lengths.max()) + int(rng.integers(0, int(step.lengths.max()) + 1))


@pytest.mark.parametrize("dp", [1, 2, 3, 4], ids=lambda d: f"D{d}")
def test_exact_tier_equals_brute_force_over_all_partitions(dp):
    rng = np.random.default_rng(42)
    checked = 0
    for case in range(40):
        step = rollout_step(rng, **TINY, duplicate=case % 5 == 0)
        if step.num_trajectories > 7:
            continue
        capacity = _tight_capacity(rng, step)
        index = PrefixIndex.from_step(step)
        keys = [k for blocks in all_partitions(step.num_trajectories)
                if (k := brute_force_key(index, blocks, capacity, dp)) is not None]
        if not keys:
            with pytest.raises(ValueError, match="no plan"):
                plan(step, capacity, dp, "harts")
            continue
        result = plan(step, capacity, dp, "harts")
        validate(result, step, index)
        assert result.details["tier"] == "exact"
        assert plan_key(result) == min(keys), f"case {case}"
        checked += 1
    assert checked >= 20


def _contiguous_optimum(index: PrefixIndex, capacity: int, dp: int) -> int | None:
    """Min total work over every set of cuts of the sorted order (K mod D, capacity)."""
    num = len(index.order)
    best = None
    for count in range(num):
        for cuts in itertools.combinations(range(1, num), count):
            bounds = (0, *cuts, num)
            if num >= dp and (count + 1) % dp:
                continue
            works = [index.segment_tree(index.order[a:b]).num_compact_tokens for a, b in zip(bounds, bounds[1:])]
            if max(works) <= capacity and (best is None or sum(works) < best):
                best = sum(works)
    return best


@pytest.mark.parametrize("dp", [1, 2, 4], ids=lambda d: f"D{d}")
def test_dp_tier_equals_brute_force_over_cut_points(dp):
    rng = np.random.default_rng(42)
    checked = 0
    for case in range(25):
        step = rollout_step(rng, num_tasks=3, branches=(1, 5), shared=8, prompt=(1, 4), continuation=(1, 15))
        if step.num_trajectories > 11:
            continue
        capacity = _tight_capacity(rng, step)
        index = PrefixIndex.from_step(step)
        best = _contiguous_optimum(index, capacity, dp)
        if best is None:
            with pytest.raises(ValueError, match="no plan"):
                plan(step, capacity, dp, "harts", exact_max_trajectories=0, refine=False)
            continue
        result = plan(step, capacity, dp, "harts", exact_max_trajectories=0, refine=False)
        validate(result, step, index)
        assert result.details["tier"] == "dp"
        assert result.compact_tokens == best, f"case {case}"
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize("seed", range(4), ids=lambda s: f"seed{s}")
def test_restricted_dp(seed):
    """A band that covers every count is the full DP; the narrowest band still plans validly."""
    rng = np.random.default_rng([42, seed])
    step = rollout_step(rng, **MEDIUM)
    capacity = _tight_capacity(rng, step)
    full = plan(step, capacity, 4, "harts", refine=False)
    wide = plan(step, capacity, 4, "harts", refine=False, dp_max_cells=0, count_band=step.num_trajectories)
    narrow = plan(step, capacity, 4, "harts", refine=False, dp_max_cells=0, count_band=1)
    assert wide.details["tier"] == narrow.details["tier"] == "restricted-dp"
    assert wide.compact_tokens == full.compact_tokens
    assert narrow.compact_tokens >= full.compact_tokens
    validate(narrow, step)


def _random_medium(seed: int):
    rng = np.random.default_rng([42, seed])
    step = rollout_step(rng, **MEDIUM)
    return step, _tight_capacity(rng, step), int(rng.choice([1, 2, 4, 8]))


def test_refinement_never_worsens_and_sometimes_helps():
    improved = 0
    for seed in range(30):
        step, capacity, dp = _random_medium(seed)
        if step.num_trajectories < dp:
            continue
        index = PrefixIndex.from_step(step)
        plain = plan(step, capacity, dp, "harts", index=index, refine=False)
        refined = plan(step, capacity, dp, "harts", index=index)
        validate(refined, step, index)
        assert plan_key(refined) <= plan_key(plain), f"seed {seed}"
        assert refined.details["work_gap_to_bound"] >= 0
        improved += plan_key(refined) < plan_key(plain)
    assert improved >= 5


def _tree_sized(seed: int, num_tasks: int = 6):
    """The paper's shape: trees under a shared prefix, T just above the largest tree's trie."""
    rng = np.random.default_rng([42, seed])
    step = rollout_step(rng, num_tasks=num_tasks, branches=(3, 8), shared=40, prompt=(5, 20), continuation=(20, 60))
    index = PrefixIndex.from_step(step)
    trees: dict[str, list[int]] = {}
    for trajectory, tree in enumerate(step.trees):
        trees.setdefault(tree, []).append(trajectory)
    largest = max(index.segment_tree(np.asarray(m)).num_compact_tokens for m in trees.values())
    return step, index, largest + int(rng.integers(0, 10)), int(rng.choice([2, 4]))


def test_stopping_at_the_bound_gives_the_full_refinement():
    """When the DP's W equals the lower bound, skipping the W-lowering stages changes no plan."""
    stopped = 0
    for seed in range(12):
        step, index, capacity, dp = _tree_sized(seed)
        fast = plan(step, capacity, dp, "harts", index=index, pack_clusters=False)
        full = plan(step, capacity, dp, "harts", index=index, pack_clusters=False, stop_at_bound=False)
        validate(fast, step, index)
        assert fast.details["work_gap_to_bound"] >= 0
        stopped += fast.details["dp_compact_tokens"] == fast.compact_tokens - fast.details["work_gap_to_bound"]
        first, second = fast.to_dict(), full.to_dict()
        first.pop("plan_seconds"), second.pop("plan_seconds")
        assert first == second, f"seed {seed}"
    assert stopped >= 6


def _stage_inputs(seed: int):
    step, capacity, dp = _random_medium(seed)
    index = PrefixIndex.from_step(step)
    rw = RankWork(index)
    return rw, cut_point_dp(rw, capacity, dp), capacity, dp


def _works(rw: RankWork, bins) -> np.ndarray:
    return np.asarray([rw.trie(b) for b in bins if b])


def _check_partition(rw: RankWork, bins, capacity: int) -> None:
    assert sorted(r for b in bins for r in b) == list(range(rw.num))
    assert all(b == sorted(b) and rw.trie(b) <= capacity for b in bins)


@pytest.mark.parametrize("seed", range(6), ids=lambda s: f"seed{s}")
def test_descent_lowers_work_and_keeps_the_count_when_asked(seed):
    rw, bins, capacity, dp = _stage_inputs(seed)
    config = HartsConfig()
    state = hr._State(rw, bins, capacity)
    hr._descend(state, config, dp=dp, snapshots=None)
    _check_partition(rw, state.nonempty(), capacity)
    assert len(state.nonempty()) == len(bins)
    assert state.total() <= _works(rw, bins).sum()
    drifting = hr._State(rw, bins, capacity)
    snapshots = []
    hr._descend(drifting, config, dp=dp, snapshots=snapshots)
    _check_partition(rw, drifting.nonempty(), capacity)
    assert drifting.total() <= state.total() or len(drifting.nonempty()) != len(bins)
    for total, snapshot in snapshots:
        _check_partition(rw, snapshot, capacity)
        assert len(snapshot) % dp == 0 and total == _works(rw, snapshot).sum()


@pytest.mark.parametrize("seed", range(6), ids=lambda s: f"seed{s}")
def test_repack_and_balance(seed):
    rw, bins, capacity, dp = _stage_inputs(seed)
    repacked = hr._repack(rw, bins, capacity, dp)
    if repacked is not None:
        _check_partition(rw, repacked, capacity)
        assert len(repacked) % dp == 0 and all(repacked)
        clusters = [c for b in bins for c in rw.clusters(b)]
        g0 = rw.common_prefix
        assert _works(rw, repacked).sum() <= len(repacked) * g0 + sum(rw.trie(c) - g0 for c in clusters)
    state = hr._State(rw, bins, capacity)
    before = objective(_works(rw, bins), dp)
    hr._balance(state, dp, HartsConfig())
    _check_partition(rw, state.nonempty(), capacity)
    assert objective(_works(rw, state.nonempty()), dp) <= before


def test_balance_lowers_the_critical_path_by_moving_a_cluster():
    """Two trees under a shared prefix: one microbatch holds two clusters, its slot mate none."""
    shared = [9] * 10
    step = make_step([shared + [1] * 20, shared + [2] * 5, shared + [3] * 2])
    index = PrefixIndex.from_step(step)
    rw = RankWork(index)
    # Ranks: [1]*20 -> 0, [2]*5 -> 1, [3]*2 -> 2. Start from {0}, {1, 2}: works 30 and 17.
    state = hr._State(rw, [[0, 1], [2]], capacity=100)
    assert state.works == [35, 12]
    hr._balance(state, 2, HartsConfig())
    assert sorted(state.works) == [17, 30]


@pytest.mark.parametrize("planner_options", [{}, {"refine": False}], ids=["refined", "dp-only"])
def test_deterministic(planner_options):
    step, capacity, dp = _random_medium(3)
    first = plan(step, capacity, dp, "harts", **planner_options).to_dict()
    second = plan(step, capacity, dp, "harts", **planner_options).to_dict()
    first.pop("plan_seconds"), second.pop("plan_seconds")
    assert first == second


@pytest.mark.parametrize("num", [5, 9], ids=["exact-tier", "dp-tier"])
def test_no_plan_when_count_cannot_be_a_multiple_of_dp(num):
    # Distinct first tokens (no sharing), each longer than half the capacity: K = N only.
    step = make_step([[k] * 6 for k in range(num)])
    with pytest.raises(ValueError, match=f"no plan: {num} trajectories cannot form a multiple of D = 4"):
        plan(step, 10, 4, "harts")


def test_fewer_trajectories_than_dp_pads_with_empty_microbatches():
    rng = np.random.default_rng(42)
    step = rollout_step(rng, num_tasks=3, branches=(3, 4), shared=4, prompt=(1, 3), continuation=(1, 9))
    result = plan(step, 1000, 16, "harts")
    validate(result, step)
    assert result.num_microbatches == 16
    assert sum(1 for mb in result.microbatches if mb.trajectory_ids) == 1


def test_elimination_empties_microbatches_and_lowers_work():
    eliminated = 0
    for seed in range(12):
        rw, bins, capacity, dp = _stage_inputs(seed)
        state = hr._State(rw, bins, capacity)
        snapshots = []
        before = state.total()
        if hr._eliminate(state, HartsConfig(), dp=dp, snapshots=snapshots):
            eliminated += 1
            assert len(state.nonempty()) < len(bins) and state.total() < before
        else:
            assert state.nonempty() == bins
        _check_partition(rw, state.nonempty(), capacity)
        assert state.works == [rw.trie(b) for b in state.bins]
        for total, snapshot in snapshots:
            assert len(snapshot) % dp == 0 and total == _works(rw, snapshot).sum()
    assert eliminated >= 3


def test_elimination_uses_an_ejection_chain():
    """The lightest microbatch empties only if a member of its new microbatch moves on to a third."""
    shared = [9] * 10
    a, a2 = shared + [1] * 20, shared + [1] * 18 + [5] * 4
    b, c = shared + [2] * 12, shared + [3] * 20
    rw = RankWork(PrefixIndex.from_step(make_step([a, a2, b, c])))
    # Ranks a, a2, b, c = 0, 1, 2, 3; LCP(a, a2) = 28, every other pair 10.
    state = hr._State(rw, [[0, 2], [1], [3]], capacity=45)
    assert state.works == [42, 32, 30]
    # c (30) does not fit beside a and b (62 > 45) nor beside b without a (50): it replaces a,
    # which joins a2 (+2): 2 < 30. Then nothing else can be emptied.
    assert hr._eliminate(state, HartsConfig(), dp=1, snapshots=[])
    assert sorted(state.nonempty()) == [[0, 1], [2, 3]]
    assert sorted(state.works) == [0, 34, 42]


def test_cluster_packing_tier():
    """Trees under a shared prefix that each fit T: whole trees, W = C + (K - 1)·g0; on these steps
    never worse than without the tier (the DP tier with its refinement), better on some."""
    packed = better = 0
    for seed in range(12):
        step, index, capacity, dp = _tree_sized(seed, num_tasks=24)
        rw = RankWork(index)
        result = plan(step, capacity, dp, "harts", index=index)
        validate(result, step, index)
        without = plan(step, capacity, dp, "harts", index=index, pack_clusters=False)
        assert plan_key(result) <= plan_key(without), f"seed {seed}"
        # With both tiers forced, the packing can only help (on any step).
        both = plan(step, capacity, dp, "harts", index=index, dp_with_packing_max_trajectories=step.num_trajectories)
        assert plan_key(both) <= min(plan_key(result), plan_key(without)), f"seed {seed}"
        if not result.details["tier"].startswith("cluster-packing"):
            continue
        packed += 1
        better += plan_key(result) < plan_key(without)
        if result.details["tier"] != "cluster-packing" or result.details["clusters_split"]:
            continue
        compact = index.segment_tree().num_compact_tokens
        assert result.compact_tokens == compact + (result.num_microbatches - 1) * rw.common_prefix
        trees = {step.trees[step.ids.index(t)] for mb in result.microbatches for t in mb.trajectory_ids}
        assert len(trees) == len(set(step.trees))
        for mb in result.microbatches:
            for tree in {step.trees[step.ids.index(t)] for t in mb.trajectory_ids}:
                assert all(step.trees[step.ids.index(t)] != tree for other in result.microbatches
                           if other is not mb for t in other.trajectory_ids), "a tree is split"
    assert packed >= 8 and better >= 5


def test_cluster_packing_splits_a_tree_larger_than_t_at_its_root_fork():
    """A tree larger than T is spread over microbatches as its root-level subtrees, each microbatch
    repeating only the tree's root prefix (not a deeper one): the least W of any plan."""
    shared = [9] * 10
    sequences = [shared + [1] * 30, shared + [1] * 20 + [2] * 10, shared + [3] * 5, shared + [4] * 5]
    step = make_step(sequences)
    result = plan(step, 45, 2, "harts", exact_max_trajectories=0)
    validate(result, step)
    assert result.details["tier"] == "cluster-packing" and result.details["clusters_split"] == 1
    # g0 = 10; the cluster {x0, x1} (sharing 30) has trie 10 + 30 + 10 = 50 > 45, so its two
    # trajectories go to different microbatches, each with one of the 15-token trees:
    # {x0, x2} and {x1, x3}, 40 + 5 = 45 each, W = 90 (C = 60, plus g0 and the 20 shared 1s repeated).
    assert sorted(mb.work for mb in result.microbatches) == [45, 45]
    dp_only = plan(step, 45, 2, "harts", exact_max_trajectories=0, pack_clusters=False)
    assert result.compact_tokens <= dp_only.compact_tokens


def _grpo_with_trees_over_t(seed: int):
    rng = np.random.default_rng([11, seed])
    step = grpo_step(rng, num_tasks=int(rng.integers(4, 10)), group=(2, 6), retries=(0, 4), shared=30,
                     prompt=(5, 25), sample=(20, 120), retry=(3, 20))
    index = PrefixIndex.from_step(step)
    rw = RankWork(index)
    g0 = rw.common_prefix
    starts = [0] + [r for r in range(1, rw.num) if rw.lcp_adjacent[r] == g0] + [rw.num]
    trees = sorted(rw.run_cost(a, b) for a, b in zip(starts, starts[1:]))
    # Between the median tree and the largest: a share of the trees exceeds T.
    capacity = max(int(step.lengths.max()) + 10, trees[len(trees) // 2])
    return step, index, capacity, int(rng.choice([2, 4]))


@pytest.mark.parametrize("seed", range(24), ids=lambda s: f"seed{s}")
def test_never_more_work_than_the_ortools_baseline_with_trees_over_t(seed):
    """GRPO-shaped steps where some trees exceed T: HARTS plans no more compact tokens than the
    OR-Tools baseline, under the paper's reading (FFD replicas) and the most favourable one (LPT).
    Seed 15 needs the fragment packing's extra cluster orders (8 microbatches, not 10)."""
    step, index, capacity, dp = _grpo_with_trees_over_t(seed)
    rw = RankWork(index)
    assert any(rw.trie(sorted(int(rw.rank[k]) for k in range(step.num_trajectories) if step.trees[k] == tree))
               > capacity for tree in set(step.trees)), "some tree exceeds T"
    ours = plan(step, capacity, dp, "harts", index=index)
    validate(ours, step, index)
    for reading in ("ffd", "lpt"):
        baseline = plan(step, capacity, dp, "treetrain-ortools", index=index, time_limit_s=2.0,
                        replica_assignment=reading)
        assert ours.compact_tokens <= baseline.compact_tokens, (reading, ours.compact_tokens, baseline.compact_tokens)


@pytest.mark.parametrize("index_of_step", [0, 7], ids=["step0", "step7"])
def test_paper_step_executes_at_the_papers_compression(index_of_step):
    """The shipped `paper` config (trees over T, trie calibrated to 6.12): the rows a HARTS plan executes
    compress S by 5.63 ± 0.15, as the paper's planned compact tokens do; P95 slot imbalance <= 2% and
    step imbalance <= 1.1% (the issue's goals). Step 7's last slot holds whole trees: with 128 balancing
    candidates per round its P95 was 2.17%."""
    from harts.config import load_config
    from harts.planning.microbatch import plan_metrics
    from harts.trees.synth import SynthConfig, generate_step

    config = load_config("configs/trees/paper.yaml", SynthConfig)
    step = generate_step(config, 0, index_of_step)
    index = PrefixIndex.from_step(step)
    result = plan(step, config.max_tokens, 8, "harts", index=index)
    validate(result, step, index)
    trees_over = sum(index.segment_tree(np.flatnonzero(np.asarray(step.trees) == tree)).num_compact_tokens
                     > config.max_tokens for tree in set(step.trees))
    assert 0.25 <= trees_over / len(set(step.trees)) <= 0.6
    assert abs(step.num_semantic_tokens / result.compact_tokens - 5.63) <= 0.15
    metrics = plan_metrics(result, index.segment_tree().num_compact_tokens, step.num_semantic_tokens)
    assert metrics.p95_slot_imbalance <= 0.02 and metrics.step_imbalance <= 0.011


def _recorded_corpus_digest(**options) -> str:
    """sha1 over the plans (members of each microbatch, in plan order) of 40 random steps (2 option sets) and a
    `longtail` GRPO step (T = 8,192, D = 4), where an elimination empties several microbatches in one round."""
    digest = hashlib.sha1()
    for seed in range(40):
        rng = np.random.default_rng([99, seed])
        if seed % 2:
            step = grpo_step(rng, num_tasks=int(rng.integers(3, 9)), group=(4, 17), retries=(0, 3),
                             shared=int(rng.integers(0, 20)), prompt=(4, 30), sample=(10, 80), retry=(3, 20))
        else:
            step = rollout_step(rng, num_tasks=int(rng.integers(2, 8)), branches=(3, 12),
                                shared=int(rng.integers(0, 40)), prompt=(2, 10), continuation=(5, 60))
        capacity = int(rng.integers(step.lengths.max(), 4 * step.lengths.max()))
        dp = int(rng.choice([1, 2, 3, 4, 8]))
        index = PrefixIndex.from_step(step)
        for extra in ({}, {"pack_clusters": False}):
            result = plan(step, capacity, dp, "harts", index=index, **options, **extra)
            digest.update(repr([mb.trajectory_ids for mb in result.microbatches]).encode())
    result = plan(generate_grpo_step(GRPO_SHAPES["longtail"], 0, 0), 8192, 4, "harts", **options)
    digest.update(repr([mb.trajectory_ids for mb in result.microbatches]).encode())
    return digest.hexdigest()


def test_plans_without_the_tail_pass_are_the_recorded_ones():
    """The planner without its slot-tail pass gives, plan for plan, what it gave at 1060ef4 (before the tail pass and
    the refinement's speedups: an elimination's scratch homes in a dict, descent moves and neighbour swaps skipped
    where the deepest LCPs show they cannot lower W). Change the digest only with a change of the plans."""
    assert _recorded_corpus_digest(tail=False) == "669a8c6d7ae4f0c1a92d62cc4f308f569ecdf647"
