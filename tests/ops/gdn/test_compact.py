"""compact_gdn against per-trajectory execution gathered through the compact map m (replay schedules) and
against the paper's token recurrence along every path (no-replay schedules), as tests/ops/kda/test_compact.py
does for KDA: trees with forks inside chunks and on chunk multiples, one-token segments, bushy roots (siblings in
one packed call), forests, chains; the planner's schedule and the one-segment-per-sequence one (hand-offs across
as many calls as the tree is deep); grouped values."""

import numpy as np
import pytest
import torch

from harts.ops.gdn.compact import compact_gdn
from harts.ops.gdn.naive import naive_recurrent_gdn
from harts.ops.kda.compact import l2norm
from harts.planning.kda_calls import plan_kda_calls
from tests.ops.kda.helpers import random_shape, relative_error, segment_schedule, tree_from_shape

from .helpers import gdn_inputs, per_trajectory_gdn

KINDS = ["chain", "bushy", "forest", "chunk_forks", "one_token", "random"]
NAMES = ["dq", "dk", "dv", "dg", "dbeta"]


def _tree(kind: str, chunk: int):
    return random_shape(np.random.default_rng([42, KINDS.index(kind), chunk]), kind, chunk)


def _compare(tree, schedule, dtype, reference, tolerance, group=2, use_qk_l2norm=False):
    leaves = gdn_inputs((tree.num_compact_tokens,), 2, 2 * group, 8, 6, dtype, seed=42)
    expected = reference(leaves)
    weight = torch.randn(expected.shape, generator=torch.Generator().manual_seed(0), dtype=dtype)
    grads_expected = torch.autograd.grad((expected * weight).sum(), leaves)
    o = compact_gdn(*leaves, schedule, use_qk_l2norm=use_qk_l2norm)
    semantic = o.index_select(0, torch.from_numpy(tree.compact_map()))
    grads = torch.autograd.grad((semantic * weight).sum(), leaves)
    assert relative_error(semantic, expected) < tolerance, "o"
    for name, actual, want in zip(NAMES, grads, grads_expected):
        assert relative_error(actual, want) < tolerance, name


@pytest.mark.parametrize("chunk", [4, 16, 64], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("kind", KINDS)
def test_replay_matches_per_trajectory_fp64(kind, chunk):
    tree = _tree(kind, chunk)
    _compare(tree, plan_kda_calls(tree, chunk), torch.float64, lambda x: per_trajectory_gdn(x, tree, chunk), 1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_segment_schedule_matches_per_trajectory_fp32(kind):
    chunk = 16
    tree = _tree(kind, chunk)
    schedule = segment_schedule(tree, chunk, replay=True)
    _compare(tree, schedule, torch.float32, lambda x: per_trajectory_gdn(x, tree, chunk), 1e-5, group=1)


def _recurrence(inputs, tree):
    index = torch.from_numpy(tree.compact_map())
    semantic = [x.index_select(0, index).unsqueeze(0) for x in inputs]
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(tree.member_lengths)]))
    return naive_recurrent_gdn(*semantic, cu_seqlens=cu)[0][0]


@pytest.mark.parametrize("planner", ["plan", "segment"])
@pytest.mark.parametrize("chunk", [4, 16], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("kind", ["bushy", "fixed"])
def test_no_replay_is_the_recurrence_from_the_fork_state(kind, chunk, planner):
    if kind == "fixed":
        tree = tree_from_shape([-1, 0, 0, 2, 2], [chunk + 3, 5, 2 * chunk - 1, 7, 1])
    else:
        tree = _tree(kind, chunk)
    build = plan_kda_calls if planner == "plan" else segment_schedule
    schedule = build(tree, chunk, replay=False)
    assert schedule.replay_tokens == 0
    if kind == "fixed":
        assert any((call.path_start % chunk).any() for call in schedule.calls)
    _compare(tree, schedule, torch.float64, lambda x: _recurrence(x, tree), 1e-12)


def test_replay_is_the_recurrence_too():
    """With replay the compact GDN is also the paper's recurrence (not only the chunked KDA form of it)."""
    chunk = 8
    tree = tree_from_shape([-1, 0, 0, 1, 1, 2], [11, 5, 8, 1, 3, 9])
    _compare(tree, plan_kda_calls(tree, chunk), torch.float64, lambda x: _recurrence(x, tree), 1e-12)


def test_l2norm_normalises_once_per_row():
    chunk = 8
    tree = tree_from_shape([-1, 0, 0, 1], [11, 5, 9, 3])

    def reference(leaves):
        q, k, v, g, beta = leaves
        return per_trajectory_gdn([l2norm(q), l2norm(k), v, g, beta], tree, chunk)

    _compare(tree, plan_kda_calls(tree, chunk), torch.float64, reference, 1e-12, use_qk_l2norm=True)


def test_bad_input():
    tree = tree_from_shape([-1, 0, 0], [4, 2, 3])
    schedule = plan_kda_calls(tree, 4)
    q, k, v, g, beta = (x.detach() for x in gdn_inputs((9,), 2, 4, 4, 4, torch.float32, seed=42))
    with pytest.raises(ValueError, match=r"\[C=9, H, K\]"):
        compact_gdn(q[:-1], k[:-1], v, g, beta, schedule)
    with pytest.raises(ValueError, match="HV a multiple of H = 2"):
        compact_gdn(q, k, v[:, :3], g[:, :3], beta[:, :3], schedule)
    with pytest.raises(ValueError, match=r"g and beta must be \[C, HV\]"):
        compact_gdn(q, k, v, g[:, :1], beta, schedule)
    with pytest.raises(ValueError, match="unknown backend"):
        compact_gdn(q, k, v, g, beta, schedule, backend="cuda")
