"""Layouts against the step's token lists: rows, positions and the KDA rows' causal conv.

Every reference here is computed from the trajectories' tokens alone, never through the trie,
the call planner or the layout code under test:
- the semantic rows are a compact map (two semantic positions share a row iff their
  trajectories agree up to them; every row holds one) with the token as the row's input id, or,
  in the baseline layout, one row per semantic position;
- the position of each row (the id RoPE uses) is its token index within its trajectory, in both
  layouts, on random trees and microbatches given in any order;
- the causal conv of the compact layout's KDA rows (replay rows repeat their compact rows) equals,
  at every row and value and gradient, a plain causal depthwise conv over each trajectory's own
  sequence of row inputs.
"""

import numpy as np
import pytest
import torch

from harts.runtime.layout import baseline_layout, compact_layout, naive_causal_conv
from harts.trees.trie import PrefixIndex
from tests.trees.helpers import make_step, random_sequences

CONV_SIZE = 4


def _random_step(seed):
    rng = np.random.default_rng(seed)
    step = make_step(random_sequences(rng, 10, 60, 3))
    members = rng.permutation(step.num_trajectories)[:8]
    return step, members


def _layout(step, members, execution, chunk_size=8, replay=True):
    if execution == "baseline":
        return baseline_layout(step, members, conv_size=CONV_SIZE, chunk_size=chunk_size)
    return compact_layout(step, PrefixIndex.from_step(step), members, conv_size=CONV_SIZE, chunk_size=chunk_size,
                          replay=replay)


def _check_semantic_rows(layout, step, members):
    trajectories = [step.trajectory_tokens(k).tolist() for k in members]
    rows = layout.semantic_rows.numpy()
    assert len(rows) == sum(len(t) for t in trajectories)
    assert np.array_equal(layout.input_ids.numpy()[rows], np.concatenate(trajectories))
    if layout.execution == "baseline":
        assert np.array_equal(np.sort(rows), np.arange(layout.num_rows)), "one row per semantic position"
        return
    row_of_prefix = {}
    prefixes = [tuple(t[: i + 1]) for t in trajectories for i in range(len(t))]
    for prefix, row in zip(prefixes, rows):
        assert row_of_prefix.setdefault(prefix, row) == row, "one prefix, one row"
    assert sorted(row_of_prefix.values()) == list(range(layout.num_rows)), "one row per prefix"


@pytest.mark.parametrize("execution", ["baseline", "compact"])
@pytest.mark.parametrize("seed", range(4))
def test_positions_are_token_indices_within_the_trajectory(seed, execution):
    step, members = _random_step(seed)
    layout = _layout(step, members, execution)
    _check_semantic_rows(layout, step, members)
    token_index = np.concatenate([np.arange(step.lengths[k]) for k in members])
    assert layout.positions.dtype == torch.int64
    assert np.array_equal(layout.positions.numpy()[layout.semantic_rows.numpy()], token_index)


def _trajectory_conv(x_RC, weight_CW, step, members, semantic_rows):
    """[S_mb, C]: per trajectory, a causal depthwise conv over its own sequence of row inputs
    (zeros before its first token); weight[:, -1] multiplies the token itself."""
    width = weight_CW.shape[1]
    outputs, start = [], 0
    for k in members:
        length = int(step.lengths[k])
        sequence = x_RC[semantic_rows[start : start + length]]
        padded = torch.cat([sequence.new_zeros(width - 1, sequence.shape[1]), sequence])
        outputs.append(sum(padded[width - 1 - j : width - 1 - j + length] * weight_CW[:, -1 - j] for j in range(width)))
        start += length
    return torch.cat(outputs)


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no-replay"])
@pytest.mark.parametrize("chunk_size", [4, 8])
@pytest.mark.parametrize("seed", range(3))
def test_kda_rows_conv_equals_trajectory_conv(seed, chunk_size, replay):
    torch.manual_seed(seed)
    step, members = _random_step(seed)
    layout = _layout(step, members, "compact", chunk_size, replay)
    _check_semantic_rows(layout, step, members)
    assert layout.num_rows < len(layout.semantic_rows), "trajectories share rows"
    assert layout.num_kda_rows == layout.num_rows + layout.info["replay_rows"]
    if replay and chunk_size == 8:
        assert layout.info["replay_rows"] > 0
    x = torch.randn(layout.num_rows, 5, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, CONV_SIZE, dtype=torch.float64)
    semantic_rows = layout.semantic_rows.numpy()
    per_position = _trajectory_conv(x, weight, step, members, semantic_rows)
    # A row's value from any one of its semantic positions (they share the prefix, so the value).
    first_position = np.unique(semantic_rows, return_index=True)[1]
    expected = per_position[first_position]

    got = layout.from_kda_rows(layout.causal_conv(layout.kda_rows(x), weight))
    torch.testing.assert_close(got[semantic_rows], per_position, rtol=1e-12, atol=1e-12)
    # Replay rows hold their compact row's inputs and conv value too.
    held = layout.prepared_schedule().gather
    torch.testing.assert_close(layout.kda_rows(x), x[held], rtol=0, atol=0)
    gathered = layout.causal_conv(layout.kda_rows(x), weight)
    torch.testing.assert_close(gathered, expected[held], rtol=1e-12, atol=1e-12)
    upstream = torch.randn_like(gathered)
    (grad,) = torch.autograd.grad((gathered * upstream).sum(), x)
    (expected_grad,) = torch.autograd.grad((expected[held] * upstream).sum(), x)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)


def test_baseline_kda_rows_are_its_rows():
    step, members = _random_step(0)
    layout = _layout(step, members, "baseline")
    x = torch.randn(layout.num_rows, 3)
    assert layout.num_kda_rows == layout.num_rows
    assert layout.kda_rows(x) is x and layout.from_kda_rows(x) is x


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64", "bf16"])
@pytest.mark.parametrize("execution", ["baseline", "compact"])
@pytest.mark.parametrize("seed", range(3))
def test_shifted_conv_equals_the_gather_reference(seed, execution, dtype):
    step, members = _random_step(seed)
    layout = _layout(step, members, execution, chunk_size=4)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(layout.num_kda_rows, 6, generator=generator).to(dtype).requires_grad_()
    weight = torch.randn(6, CONV_SIZE, generator=generator).to(dtype).requires_grad_()
    upstream = torch.randn(layout.num_kda_rows, 6, generator=generator).to(dtype)
    got = layout.causal_conv(x, weight)
    expected = naive_causal_conv(x, weight, layout.predecessors)
    # The same operations in the same order per row: equal bits forward.
    assert torch.equal(got, expected)
    # Gradients add the same terms in another order (per tap, then the exception rows).
    grads = torch.autograd.grad(got, (x, weight), upstream)
    expected_grads = torch.autograd.grad(expected, (x, weight), upstream)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad.double(), expected_grad.double(),
                                   rtol=1e-12 if dtype == torch.float64 else 2e-2, atol=1e-12 if dtype == torch.float64 else 2e-2)
    # The exceptions are the rows whose path does not continue from the row before: a few per path.
    rows = layout.conv_exception_rows()
    predecessors = layout.predecessors.numpy()
    breaks = [p for p in range(1, layout.num_kda_rows) if predecessors[p, 0] != p - 1]
    assert set(breaks) <= set(rows.tolist())
    assert len(rows) <= (CONV_SIZE - 1) * (len(breaks) + 1)


@pytest.mark.parametrize(
    "execution, backend, chunk_size, message",
    [("baseline", "fla", 32, "uses chunks of 64"), ("compact", "fla", 16, "take chunk_size 32 or 64"),
     ("baseline", "cuda", 64, "unknown backend"), ("compact", "cuda", 64, "unknown backend")],
    ids=["baseline-fla-32", "compact-fla-16", "baseline-unknown", "compact-unknown"],
)
def test_layouts_refuse_a_kda_backend_that_cannot_run_their_chunks(execution, backend, chunk_size, message):
    """Refused when the layout is built, before a model runs (not in the first KDA layer, inside a checkpoint)."""
    step, members = _random_step(0)
    index = PrefixIndex.from_step(step)
    with pytest.raises(ValueError, match=message):
        if execution == "baseline":
            baseline_layout(step, members, conv_size=CONV_SIZE, chunk_size=chunk_size, kda_backend=backend)
        else:
            compact_layout(step, index, members, conv_size=CONV_SIZE, chunk_size=chunk_size, kda_backend=backend)


@pytest.mark.parametrize("execution, chunk_size", [("baseline", 64), ("compact", 32), ("compact", 64)],
                         ids=["baseline-64", "compact-32", "compact-64"])
def test_layouts_take_the_chunks_fla_runs(execution, chunk_size):
    step, members = _random_step(0)
    if execution == "baseline":
        layout = baseline_layout(step, members, conv_size=CONV_SIZE, chunk_size=chunk_size, kda_backend="fla")
    else:
        layout = compact_layout(step, PrefixIndex.from_step(step), members, conv_size=CONV_SIZE,
                                chunk_size=chunk_size, kda_backend="fla")
    assert layout.kda_backend == "fla"
