"""Rollout trees sampled through the decoder: every recorded log-prob is the full forward's at its
position (which pins each token fed, each fork and each dropped row), the trees' shape (samples fork
after the prompt, retries at a tool output of their sample), rewards and malformed endings as the
environment replays them, determinism per seed, and the sampling distribution (temperature, top-p)."""

import math

import numpy as np
import pytest
import torch

from harts.model.config import load_model_config
from harts.model.model import HybridModel
from harts.rollout.env import OUT, Episode, LookupEnv, LookupEnvConfig
from harts.rl.config import RLConfig, WarmStartConfig, resolve
from harts.rl.loop import warm_start
from harts.rollout.generate import RolloutConfig, generate_trees, sampling_distribution
from tests.model.test_decode import full_logits

ENV = LookupEnv(LookupEnvConfig(num_values=4, min_hops=1, max_hops=2, max_calls=3, system_prompt_length=6))
CONFIG = RolloutConfig(tasks_per_step=3, samples_per_task=3, retry_prob=1.0)


@pytest.fixture(scope="module")
def model():
    """The tiny model after a short warm start on this environment: it mostly writes legal tokens
    (episodes with tool calls and retries), its next-token distributions far from uniform, so that
    a token fed to the wrong row or at the wrong step changes the log-probs."""
    model = HybridModel(load_model_config("tiny"))
    model.init_weights(seed=3)
    config = resolve(RLConfig(name="test", model="tiny", env=ENV.config,
                              warm_start=WarmStartConfig(steps=30, episodes=16, accuracy=0.7)))
    warm_start(model, ENV, config, seed=0)
    return model.eval()


def _tasks(seed: int = 0):
    rng = np.random.default_rng(seed)
    return [ENV.sample_task(rng) for _ in range(CONFIG.tasks_per_step)]


def _generate(model, seed: int, tasks=None, config=CONFIG):
    return generate_trees(model, ENV, tasks or _tasks(), config, torch.Generator().manual_seed(seed))


def replay(trajectory, task) -> tuple[list[int], Episode]:
    """The positions of the trajectory's agent tokens and the ended episode, by replaying the
    environment (its own tokens must follow where it appends them)."""
    tokens = trajectory.tokens
    position = len(ENV.prefix) + len(ENV.prompt(task))
    assert tokens[:position] == [*ENV.prefix, *ENV.prompt(task)]
    episode, agent = Episode(task=task), []
    while episode.phase != "done":
        agent.append(position)
        output = ENV.act(episode, tokens[position])
        assert tokens[position + 1: position + 1 + len(output)] == output
        position += 1 + len(output)
    assert position == len(tokens)
    return agent, episode


@pytest.mark.parametrize("weights, temperature, top_p", [
    ("warm", 1.0, 1.0), ("initial", 1.0, 1.0), ("warm", 0.7, 1.0), ("warm", 1.3, 0.8),
], ids=["warm", "initial", "warm-temperature", "warm-temperature-top-p"])
def test_logprobs_are_the_full_forwards(model, weights, temperature, top_p):
    """Each agent token's recorded log-prob is the log of the sampling distribution (temperature,
    nucleus) built from the full forward's logits at the previous position; every sampled token is
    inside the nucleus."""
    if weights == "initial":
        # Near-uniform over 256 tokens: most episodes end on a malformed token.
        model = HybridModel(load_model_config("tiny"))
        model.init_weights(seed=3)
    tasks = _tasks()
    config = RolloutConfig(tasks_per_step=3, samples_per_task=3, retry_prob=1.0, temperature=temperature, top_p=top_p)
    trajectories = _generate(model, seed=0, tasks=tasks, config=config)
    agent_tokens = 0
    for trajectory in trajectories:
        agent, episode = replay(trajectory, tasks[trajectory.tree])
        assert (trajectory.reward, trajectory.malformed) == (ENV.reward(episode), episode.malformed)
        probs = sampling_distribution(full_logits(model, trajectory.tokens), temperature, top_p)
        assert trajectory.loss_mask == [int(i in agent) for i in range(len(trajectory.tokens))]
        for i, token in enumerate(trajectory.tokens):
            if i in agent:
                assert probs[i - 1, token] > 0, "sampled outside the nucleus"
            expected = math.log(probs[i - 1, token].item()) if i in agent else 0.0
            assert abs(trajectory.logprobs[i] - expected) <= 1e-5
        agent_tokens += len(agent)
    malformed = [t.malformed for t in trajectories]
    if weights == "warm":
        assert agent_tokens > 40 and sum(malformed) < len(malformed) / 2
    else:
        assert any(malformed)


def test_trees_fork_after_the_prompt_and_at_tool_outputs(model):
    trajectories = _generate(model, seed=1)
    prompt_end = len(ENV.prefix) + 6
    samples = {(t.tree, t.sample): t for t in trajectories if t.retry is None}
    assert sorted(samples) == [(k, j) for k in range(3) for j in range(3)]
    assert all(t.forked_at == prompt_end for t in samples.values())
    retries = [t for t in trajectories if t.retry is not None]
    # retry_prob 1: every tool output of a sample forks one retry there.
    for (tree, sample), trajectory in samples.items():
        own = sorted(t.retry for t in retries if (t.tree, t.sample) == (tree, sample))
        assert own == list(range(trajectory.tokens.count(OUT)))
    for retry in retries:
        parent = samples[(retry.tree, retry.sample)]
        assert retry.tokens[:retry.forked_at] == parent.tokens[:retry.forked_at]
        assert retry.tokens[retry.forked_at - 2] == OUT and retry.tokens.count(OUT) >= 1
    assert len({t.name for t in trajectories}) == len(trajectories)


def test_deterministic_per_seed(model):
    first, again, other = _generate(model, 4), _generate(model, 4), _generate(model, 5)
    assert [(t.name, t.tokens, t.logprobs) for t in first] == [(t.name, t.tokens, t.logprobs) for t in again]
    assert [t.tokens for t in first] != [t.tokens for t in other]


def test_no_retries():
    model = HybridModel(load_model_config("tiny"))
    model.init_weights(seed=0)
    config = RolloutConfig(tasks_per_step=3, samples_per_task=2, retry_prob=0.0)
    trajectories = _generate(model, 0, _tasks(1)[:1] * 3, config)
    assert len(trajectories) == 6 and all(t.retry is None for t in trajectories)


def test_sampling_distribution():
    logits = torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.0, 0.0]])
    assert torch.allclose(sampling_distribution(logits, 1.0, 1.0), torch.softmax(logits, dim=-1))
    assert torch.allclose(sampling_distribution(logits, 2.0, 1.0), torch.softmax(logits / 2, dim=-1))
    # top-p 0.8: 2.0 holds 0.665 of the mass, 1.0 brings it to 0.91: those two, renormalised.
    nucleus = sampling_distribution(logits, 1.0, 0.8)
    kept = torch.softmax(torch.tensor([1.0, 2.0]), 0)
    assert torch.allclose(nucleus[0], torch.tensor([kept[0], kept[1], 0.0]))
    # Ties: the first token alone holds 1/3 < 0.5, two hold 2/3; the most probable token always stays.
    assert int((sampling_distribution(logits, 1.0, 0.5)[1] > 0).sum()) == 2
    assert math.isclose(float(sampling_distribution(logits, 1.0, 0.01)[0, 1]), 1.0)


def test_vocabulary_must_fit_the_model():
    config = load_model_config("tiny")
    small = HybridModel(type(config)(**{**config.__dict__, "vocab_size": 100}))
    with pytest.raises(ValueError, match="environment's 128 tokens exceed the model's vocabulary"):
        _generate(small, 0)


@pytest.mark.parametrize("settings, message", [
    (dict(tasks_per_step=0), "tasks_per_step"),
    (dict(retry_prob=1.5), "retry_prob"),
    (dict(temperature=0.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
], ids=["no-tasks", "retry-prob", "temperature", "top-p"])
def test_bad_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        RolloutConfig(**settings)
