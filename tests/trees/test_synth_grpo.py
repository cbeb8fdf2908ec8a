import dataclasses

import numpy as np
import pytest

from harts.trees.synth import Lengths
from harts.trees.synth_grpo import GRPO_SHAPES, GrpoConfig, _group_structure, generate_grpo_step
from harts.trees.trie import PrefixIndex

SMALL = dataclasses.replace(GRPO_SHAPES["agent"], num_groups=6)


def _groups(step) -> dict[str, np.ndarray]:
    trees = np.asarray(step.trees)
    return {tree: np.flatnonzero(trees == tree) for tree in np.unique(trees)}


def test_deterministic():
    a, b, c = generate_grpo_step(SMALL, 3, 1), generate_grpo_step(SMALL, 3, 1), generate_grpo_step(SMALL, 4, 1)
    assert a.ids == b.ids
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
    np.testing.assert_array_equal(a.advantage_per_trajectory, b.advantage_per_trajectory)
    assert a.num_semantic_tokens != c.num_semantic_tokens or not np.array_equal(a.tokens, c.tokens)


@pytest.mark.parametrize("shape", sorted(GRPO_SHAPES))
def test_trie_of_each_group_is_the_generated_tree(shape):
    config = dataclasses.replace(GRPO_SHAPES[shape], num_groups=8)
    seed, step_index = 5, 2
    step = generate_grpo_step(config, seed, step_index)
    index = PrefixIndex.from_step(step)
    groups = _groups(step)
    assert len(groups) == config.num_groups
    for group in range(config.num_groups):
        prompt, samples = _group_structure(config, np.random.default_rng([seed, step_index, group]))
        members = groups[f"s{step_index:03d}-g{group:03d}"]
        assert config.min_group_size <= len(members) == len(samples) <= config.max_group_size
        compact = index.segment_tree(members).num_compact_tokens
        assert compact == prompt + sum(sample.end - sample.fork for sample in samples)
        assert sorted(step.lengths[members].tolist()) == sorted(sample.end for sample in samples)
    # Groups share exactly the system prompt: the step's trie is their tries joined under it.
    sizes = [index.segment_tree(m).num_compact_tokens for m in groups.values()]
    total = index.segment_tree().num_compact_tokens
    assert total == sum(sizes) - (len(sizes) - 1) * config.system_prompt_tokens


@pytest.mark.parametrize("shape", sorted(GRPO_SHAPES))
def test_shape_invariants(shape):
    config = GRPO_SHAPES[shape]
    step = generate_grpo_step(config, 0, 0)
    index = PrefixIndex.from_step(step)
    assert step.lengths.max() <= config.max_tokens
    assert step.tokens.max() < config.vocab_size
    assert (step.loss_mask[step.offsets[:-1]] == 0).all()
    assert 0 < step.loss_mask.mean() < 1
    sizes = np.asarray([index.segment_tree(m).num_compact_tokens for m in _groups(step).values()])
    # Several groups larger than T (a planner must split them), and groups within T too.
    assert (sizes > config.max_tokens).sum() >= 3
    assert (sizes <= config.max_tokens).any() or shape == "agent"
    for members in _groups(step).values():
        advantages = step.advantage_per_trajectory[members]
        assert abs(advantages.mean()) < 1e-5


def test_samples_resume_inside_other_samples():
    # A group whose samples all fork right after its prompt has C = S - (n - 1)·prompt; a sample resuming at a tool
    # output of another shares more (a sub-tree), so C is smaller.
    for probability, expect_subtrees in ((0.5, True), (0.0, False)):
        config = dataclasses.replace(SMALL, fork_probability=probability)
        step = generate_grpo_step(config, 1, 0)
        index = PrefixIndex.from_step(step)
        beyond_prompt = []
        for group in range(config.num_groups):
            prompt, _ = _group_structure(config, np.random.default_rng([1, 0, group]))
            members = _groups(step)[f"s000-g{group:03d}"]
            compact = index.segment_tree(members).num_compact_tokens
            beyond_prompt.append(int(step.lengths[members].sum()) - (len(members) - 1) * prompt - compact)
        assert min(beyond_prompt) >= 0
        assert (max(beyond_prompt) > 0) == expect_subtrees


@pytest.mark.parametrize("change, message", [
    (dict(min_group_size=9, max_group_size=8), "min_group_size"),
    (dict(fork_probability=1.5), "fork_probability"),
    (dict(max_tokens=1000), "max_tokens is too small"),
], ids=["group-sizes", "probability", "capacity"])
def test_bad_config(change, message):
    fields = {f.name: getattr(SMALL, f.name) for f in dataclasses.fields(GrpoConfig)} | change
    with pytest.raises(ValueError, match=message):
        GrpoConfig(**fields)


def test_groups_without_a_system_prompt_form_a_forest():
    config = dataclasses.replace(SMALL, system_prompt_tokens=0, prompt_tokens=Lengths(median=50, min=10, max=90))
    step = generate_grpo_step(config, 2, 0)
    index = PrefixIndex.from_step(step)
    sizes = [index.segment_tree(m).num_compact_tokens for m in _groups(step).values()]
    assert index.segment_tree().num_compact_tokens == sum(sizes)
