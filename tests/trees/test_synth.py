import numpy as np
import pytest

from harts.config import load_config
from harts.trees.synth import SynthConfig, _compression, calibrate, generate_step
from harts.trees.trie import PrefixIndex


@pytest.fixture(scope="module")
def tiny():
    return load_config("configs/trees/tiny.yaml", SynthConfig)


@pytest.mark.parametrize("step_index", [0, 1])
def test_trie_of_tokens_is_the_generated_tree(tiny, step_index):
    _, tasks = calibrate(tiny, 7, step_index)
    step = generate_step(tiny, 7, step_index)
    tree = PrefixIndex.from_step(step).segment_tree()
    predicted_compact = step.num_semantic_tokens / _compression(tiny, tasks)
    assert tree.num_compact_tokens == round(predicted_compact)
    assert step.num_trajectories == sum(len(t.branches) for t in tasks)


def test_deterministic(tiny):
    a = generate_step(tiny, 3, 1)
    b = generate_step(tiny, 3, 1)
    c = generate_step(tiny, 4, 1)
    assert a.ids == b.ids
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.old_logprobs, b.old_logprobs)
    assert not np.array_equal(a.tokens[:100], c.tokens[:100])


def test_shape_invariants(tiny):
    step = generate_step(tiny, 0, 0)
    assert step.lengths.max() <= tiny.max_tokens
    assert (step.loss_mask[step.offsets[:-1]] == 0).all()
    assert step.tokens.max() < tiny.vocab_size
    assert 0 < step.loss_mask.mean() < 1
    # Shared prefixes carry identical log-probs: old log-probs are a function of the compact row.
    tree = PrefixIndex.from_step(step).segment_tree()
    compact_map = tree.compact_map()
    first = np.full(tree.num_compact_tokens, np.nan, dtype=np.float32)
    first[compact_map] = step.old_logprobs
    np.testing.assert_array_equal(first[compact_map], step.old_logprobs)
    # GRPO advantages: zero mean within each task that has mixed rewards.
    advantages = step.advantage_per_trajectory
    for tree_id in set(step.trees):
        sel = np.array([t == tree_id for t in step.trees])
        assert abs(advantages[sel].mean()) < 1e-5


def test_calibration_hits_target():
    config = load_config("configs/trees/cpu-small.yaml", SynthConfig)
    for step_index in range(config.num_steps):
        _, tasks = calibrate(config, 0, step_index)
        assert abs(_compression(config, tasks) - config.target_compression) <= config.compression_tolerance
        depth = max(b.depth for t in tasks for b in t.branches)
        assert depth >= 3


def test_unreachable_target_is_an_error(tiny):
    config = load_config("configs/trees/tiny.yaml", SynthConfig, target_compression=50.0)
    with pytest.raises(ValueError, match="cannot reach compression 50.0"):
        calibrate(config, 0, 0)


def test_config_validation():
    with pytest.raises(ValueError, match="max_tokens is too small"):
        load_config("configs/trees/tiny.yaml", SynthConfig, max_tokens=50)


def test_rounds_nest_every_branch_once_per_round():
    """`fork_order: rounds`: side branch n forks off branch n - 2^⌊log2 n⌋, each parent's forks at
    increasing tool outputs; the step's trie is still the generated tree."""
    config = load_config("configs/trees/cpu-deep.yaml", SynthConfig)
    _, tasks = calibrate(config, 0, 0)
    for task in tasks:
        last: dict[int, int] = {}
        for n, branch in enumerate(task.branches[1:], start=1):
            assert branch.parent == n - (1 << (n.bit_length() - 1)), (n, branch.parent)
            assert branch.fork > last.get(branch.parent, -1)
            last[branch.parent] = branch.fork
    step = generate_step(config, 0, 0)
    tree = PrefixIndex.from_step(step).segment_tree()
    assert tree.num_compact_tokens == _compression_free_size(config, tasks)


def _compression_free_size(config, tasks) -> int:
    """C of the generated structure: the system prompt once, then each task's issue and own tokens."""
    return config.system_prompt_tokens + sum(t.issue + sum(b.end - b.fork for b in t.branches) for t in tasks)
