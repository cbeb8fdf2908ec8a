"""The lookup environment: its grammar (a token outside it ends the episode unrewarded), tool outputs,
rewards, demonstrations and determinism."""

import numpy as np
import pytest

from harts.rollout.env import (
    ANS, BOS, CALL, KEY, OUT, SEP, VALUE0, Episode, LookupEnv, LookupEnvConfig, Task,
)

TASK = Task(table=(3, 0, 1, 2), key=1, hops=2)


def _env(**sizes) -> LookupEnv:
    return LookupEnv(LookupEnvConfig(num_values=4, min_hops=1, max_hops=2, max_calls=3, system_prompt_length=5,
                                     **sizes))


def _play(env: LookupEnv, task: Task, actions: list[int]) -> tuple[list[int], Episode]:
    """Agent tokens `actions`, each followed by what the environment appends."""
    episode, tokens = Episode(task=task), []
    for token in actions:
        tokens.append(token)
        tokens += env.act(episode, token)
    return tokens, episode


def test_the_optimal_episode_chains_the_tool_outputs():
    env = _env()
    assert TASK.answer == 3  # f(1) = 0, f(0) = 3
    tokens, episode = _play(env, TASK, [CALL, VALUE0 + 1, CALL, VALUE0 + 0, ANS, VALUE0 + 3])
    assert tokens == [CALL, VALUE0 + 1, OUT, VALUE0 + 0, CALL, VALUE0 + 0, OUT, VALUE0 + 3, ANS, VALUE0 + 3]
    assert episode.phase == "done" and episode.calls == 2 and env.reward(episode) == 1.0
    assert env.render([*env.prefix, *env.prompt(TASK), *tokens]) == (
        "BOS <system:5> TASK HOPS c2 KEY v1 SEP CALL v1 OUT v0 CALL v0 OUT v3 ANS v3")


@pytest.mark.parametrize("actions", [
    [ANS, VALUE0 + 0],                                  # no tool call, wrong guess
    [CALL, VALUE0 + 1, ANS, VALUE0 + 0],                # one hop short: answers f(k)
    [CALL, VALUE0 + 2, CALL, VALUE0 + 1, ANS, VALUE0 + 0],  # a wrong first argument
], ids=["no-call", "one-hop-short", "wrong-argument"])
def test_a_wrong_answer_gets_no_reward(actions):
    env = _env()
    _, episode = _play(env, TASK, actions)
    assert env.reward(episode) == 0.0


def test_grammar_at_each_point():
    env = _env()
    episode = Episode(task=TASK)
    values = tuple(VALUE0 + v for v in range(4))
    assert env.legal(episode) == (CALL, ANS)
    env.act(episode, CALL)
    assert env.legal(episode) == values
    for token in (VALUE0, CALL, VALUE0, CALL, VALUE0):
        env.act(episode, token)
    assert episode.calls == 3 and env.legal(episode) == (ANS,)  # max_calls reached: only the answer
    env.act(episode, ANS)
    env.act(episode, VALUE0 + 2)
    assert env.legal(episode) == () and not episode.malformed
    with pytest.raises(ValueError, match="the episode has ended"):
        env.act(episode, ANS)


@pytest.mark.parametrize("actions", [
    [VALUE0],                               # a value where CALL or ANS is due
    [CALL, CALL],                           # CALL where the argument is due
    [CALL, VALUE0, ANS, 200],               # a token the environment does not know
    [CALL, VALUE0, CALL, VALUE0, CALL, VALUE0, CALL],  # a fourth call with max_calls 3
], ids=["value-first", "call-as-argument", "unknown-token", "call-over-the-limit"])
def test_a_token_outside_the_grammar_ends_the_episode_unrewarded(actions):
    env = _env()
    task = Task(table=(0, 0, 0, 0), key=0, hops=1)  # every answer v0 would be right
    tokens, episode = _play(env, task, actions)
    assert episode.phase == "done" and episode.malformed and env.reward(episode) == 0.0
    assert tokens[-1] == actions[-1] and env.legal(episode) == ()


def test_prompt_and_prefix():
    env = _env()
    assert env.prefix[0] == BOS and len(env.prefix) == 6 and all(t >= 64 for t in env.prefix[1:])
    assert env.prompt(TASK) == [2, 3, 18, KEY, VALUE0 + 1, SEP]
    assert _env().prefix == env.prefix, "the system prompt is the same in every environment"
    assert env.vocab_size == 128 and env.max_length == 6 + 6 + 12 + 2


def test_tasks_are_deterministic_per_generator():
    env = LookupEnv(LookupEnvConfig(num_values=8, min_hops=1, max_hops=3))
    assert env.sample_task(np.random.default_rng(5)) == env.sample_task(np.random.default_rng(5))
    tasks = [env.sample_task(np.random.default_rng(seed)) for seed in range(40)]
    assert {t.hops for t in tasks} == {1, 2, 3} and len({t.table for t in tasks}) == len(tasks)


@pytest.mark.parametrize("accuracy", [1.0, 0.0])
def test_demonstrations(accuracy):
    env = LookupEnv(LookupEnvConfig(num_values=8, min_hops=1, max_hops=3))
    rng = np.random.default_rng(0)
    rewards = []
    for _ in range(200):
        task = env.sample_task(rng)
        tokens, loss_mask, reward = env.demonstration(task, rng, accuracy)
        assert tokens[:len(env.prefix) + 6] == [*env.prefix, *env.prompt(task)] and len(loss_mask) == len(tokens)
        decisions = [t for t, m in zip(tokens, loss_mask) if m]
        assert all(t in (CALL, ANS) or VALUE0 <= t < VALUE0 + 8 for t in decisions)
        assert len(decisions) == 2 * tokens.count(CALL) + 2 and loss_mask.count(1) == len(decisions)
        rewards.append(reward)
        if accuracy == 1.0:
            assert tokens.count(CALL) == task.hops
    # The optimal agent always succeeds; a random one answers one of 8 values at random.
    assert np.mean(rewards) == 1.0 if accuracy == 1.0 else 0.05 < np.mean(rewards) < 0.2


@pytest.mark.parametrize("sizes, message", [
    (dict(num_values=1), "num_values must be in"),
    (dict(num_values=33), "num_values must be in"),
    (dict(min_hops=2, max_hops=1), "min_hops <= max_hops"),
    (dict(max_hops=16, max_calls=16), "max_hops <= 15"),
    (dict(max_hops=3, max_calls=2), "must allow max_hops"),
    (dict(text_vocab=0), "text_vocab >= 1"),
], ids=["one-value", "too-many-values", "hops-reversed", "too-many-hops", "too-few-calls", "no-text"])
def test_bad_sizes_are_refused(sizes, message):
    with pytest.raises(ValueError, match=message):
        LookupEnvConfig(**sizes)
