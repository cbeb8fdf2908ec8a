"""compact_kda against per-trajectory execution gathered through the compact map m.

Replay schedules chunk every path exactly like per-trajectory execution from position 0, so the
outputs and all input gradients agree to rounding (fp64 1e-12, fp32 1e-5). No-replay schedules
start side branches at the fork from the exact state there: the same function (the recurrence),
chunked differently, compared with the token recurrence itself.
"""

import numpy as np
import pytest
import torch

from harts.ops.kda.compact import compact_kda, l2norm, prepare_schedule, run_calls
from harts.ops.kda.naive import naive_recurrent_kda
from harts.planning.kda_calls import plan_kda_calls

from .helpers import per_trajectory, random_inputs, random_shape, relative_error, segment_schedule, tree_from_shape

KINDS = ["chain", "bushy", "forest", "chunk_forks", "one_token", "random"]
NAMES = ["dq", "dk", "dv", "dg", "dbeta"]


def _tree(kind: str, chunk: int):
    return random_shape(np.random.default_rng([42, KINDS.index(kind), chunk]), kind, chunk)


def _compare(tree, schedule, dtype, reference, tolerance, use_qk_l2norm=False):
    """compact_kda vs `reference(inputs) -> o [S, H, V]`, forward and the gradients of a random
    weighting of the semantic outputs."""
    leaves = random_inputs(tree.num_compact_tokens, 2, 8, 6, dtype, seed=42)
    expected = reference(leaves)
    weight = torch.randn(expected.shape, generator=torch.Generator().manual_seed(0), dtype=dtype)
    grads_expected = torch.autograd.grad((expected * weight).sum(), leaves)
    o = compact_kda(*leaves, schedule, use_qk_l2norm=use_qk_l2norm)
    semantic = o.index_select(0, torch.from_numpy(tree.compact_map()))
    grads = torch.autograd.grad((semantic * weight).sum(), leaves)
    assert relative_error(semantic, expected) < tolerance, "o"
    for name, actual, want in zip(NAMES, grads, grads_expected):
        assert relative_error(actual, want) < tolerance, name


@pytest.mark.parametrize("chunk", [4, 16, 64], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("kind", KINDS)
def test_replay_matches_per_trajectory_fp64(kind, chunk):
    tree = _tree(kind, chunk)
    _compare(tree, plan_kda_calls(tree, chunk), torch.float64, lambda x: per_trajectory(x, tree, chunk), 1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_segment_schedule_matches_per_trajectory_fp32(kind):
    """One sequence per segment: hand-offs across as many calls as the tree is deep."""
    chunk = 16
    tree = _tree(kind, chunk)
    schedule = segment_schedule(tree, chunk, replay=True)
    _compare(tree, schedule, torch.float32, lambda x: per_trajectory(x, tree, chunk), 1e-5)


def _recurrence(inputs, tree):
    index = torch.from_numpy(tree.compact_map())
    semantic = [x.index_select(0, index).unsqueeze(0) for x in inputs]
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(tree.member_lengths)]))
    return naive_recurrent_kda(*semantic, cu_seqlens=cu)[0][0]


@pytest.mark.parametrize("planner", ["plan", "segment"])
@pytest.mark.parametrize("chunk", [4, 16], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("kind", ["bushy", "random", "fixed"])
def test_no_replay_is_the_recurrence_from_the_fork_state(kind, chunk, planner):
    if kind == "fixed":
        tree = tree_from_shape([-1, 0, 0, 2, 2], [chunk + 3, 5, 2 * chunk - 1, 7, 1])
    else:
        tree = _tree(kind, chunk)
    build = plan_kda_calls if planner == "plan" else segment_schedule
    schedule = build(tree, chunk, replay=False)
    assert schedule.replay_tokens == 0
    if kind == "fixed":
        # Different chunking: the fork at B + 3 starts side-branch chunks mid-chunk.
        assert any((call.path_start % chunk).any() for call in schedule.calls)
    _compare(tree, schedule, torch.float64, lambda x: _recurrence(x, tree), 1e-12)


def test_l2norm_normalises_once_per_row():
    chunk = 8
    tree = tree_from_shape([-1, 0, 0, 1], [11, 5, 9, 3])

    def reference(leaves):
        q, k, v, g, beta = leaves
        return per_trajectory([l2norm(q), l2norm(k), v, g, beta], tree, chunk)

    _compare(tree, plan_kda_calls(tree, chunk), torch.float64, reference, 1e-12, use_qk_l2norm=True)


def test_bad_input():
    tree = tree_from_shape([-1, 0, 0], [4, 2, 3])
    schedule = plan_kda_calls(tree, 4)
    leaves = [x.detach() for x in random_inputs(tree.num_compact_tokens, 1, 4, 4, torch.float32, seed=42)]
    with pytest.raises(ValueError, match=r"\[C=9, H, K\]"):
        compact_kda(*[x[:-1] for x in leaves], schedule)
    with pytest.raises(ValueError, match="unknown backend"):
        compact_kda(*leaves, schedule, backend="cuda")
    prepared = prepare_schedule(schedule, "cpu")
    with pytest.raises(ValueError, match=f"inputs have 8 rows, the calls {prepared.num_call_rows}"):
        run_calls(*[x[:-1] for x in leaves], prepared)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("planner", ["plan", "segment"])
@pytest.mark.parametrize("chunk", [4, 16, 64], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("kind", KINDS)
def test_sweep(kind, chunk, planner, dtype):
    tree = _tree(kind, chunk)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    build = plan_kda_calls if planner == "plan" else segment_schedule
    _compare(tree, build(tree, chunk, replay=True), dtype, lambda x: per_trajectory(x, tree, chunk), tolerance)
    _compare(tree, build(tree, chunk, replay=False), dtype, lambda x: _recurrence(x, tree), tolerance)
