"""The compact layout's KDA rows against its compact rows.

A KDA layer gathers its input to the calls' rows (replay rows repeat their compact rows), runs
the causal conv there with the layout's KDA-row predecessors and returns the computed rows. The
reference is the same conv over compact rows with the compact predecessors (the path's previous
rows, from the segment tree): gathering first and convolving must give the same values and
gradients.
"""

import numpy as np
import pytest
import torch

from harts.planning.kda_calls import compact_parent_row
from harts.runtime.layout import baseline_layout, compact_layout
from harts.trees.trie import PrefixIndex
from tests.trees.helpers import make_step, random_sequences


def _layout(seed, chunk_size, replay=True):
    rng = np.random.default_rng(seed)
    step = make_step(random_sequences(rng, 10, 60, 3))
    index = PrefixIndex.from_step(step)
    members = np.arange(step.num_trajectories)
    layout = compact_layout(step, index, members, conv_size=4, chunk_size=chunk_size, replay=replay)
    return step, index, members, layout


def _compact_conv(x_CC, weight_CW, parent_row):
    """The causal conv over compact rows, walking the parent rows."""
    out = x_CC * weight_CW[:, -1]
    previous = torch.as_tensor(parent_row)
    for j in range(1, weight_CW.shape[1]):
        valid = previous >= 0
        shifted = torch.zeros_like(x_CC)
        shifted[valid] = x_CC[previous[valid]]
        out = out + shifted * weight_CW[:, -1 - j]
        previous = torch.where(valid, torch.as_tensor(parent_row)[previous.clamp(min=0)], previous)
    return out


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no-replay"])
@pytest.mark.parametrize("chunk_size", [4, 8])
@pytest.mark.parametrize("seed", range(3))
def test_kda_rows_conv_equals_compact_conv(seed, chunk_size, replay):
    torch.manual_seed(seed)
    step, index, members, layout = _layout(seed, chunk_size, replay)
    assert layout.num_kda_rows == layout.num_rows + layout.info["replay_rows"]
    if replay and chunk_size == 8:
        assert layout.info["replay_rows"] > 0
    x = torch.randn(layout.num_rows, 5, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 4, dtype=torch.float64)
    parent_row = compact_parent_row(index.segment_tree(members))
    expected = _compact_conv(x, weight, parent_row)
    got = layout.from_kda_rows(layout.causal_conv(layout.kda_rows(x), weight))
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    # Replay rows hold their compact row's conv value too.
    gathered = layout.causal_conv(layout.kda_rows(x), weight)
    torch.testing.assert_close(gathered, expected[layout.prepared_schedule().gather], rtol=1e-12, atol=1e-12)
    upstream = torch.randn_like(gathered)
    (grad,) = torch.autograd.grad((gathered * upstream).sum(), x)
    (expected_grad,) = torch.autograd.grad((expected[layout.prepared_schedule().gather] * upstream).sum(), x)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)


def test_baseline_kda_rows_are_its_rows():
    step, _, members, _ = _layout(0, 8)
    layout = baseline_layout(step, members, conv_size=4, chunk_size=8)
    x = torch.randn(layout.num_rows, 3)
    assert layout.num_kda_rows == layout.num_rows
    assert layout.kda_rows(x) is x and layout.from_kda_rows(x) is x
