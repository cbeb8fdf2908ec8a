"""`LookupEnv`: a small tool-use environment whose episodes grow rollout trees.

A task is a hidden table f: {0..V−1} → {0..V−1} (drawn per task), a key k and a hop count h; the
answer is f^h(k). The table is never shown: the agent must call the lookup tool, whose output is
f of the call's argument, feed each output into the next call (multi-step tool use) and answer with
the last output. Reward = success: 1 if the answer is f^h(k), else 0. A policy that answers at
random succeeds with probability 1/V whatever it does before (the answer is one of V values); the
optimum (call with k, then h − 1 times with the last output, answer the last output) succeeds
always. Each value the agent writes copies the latest value token (the key, then the last output)
and when to stop depends on h in the prompt. From a random initialisation the reward is too sparse
for GRPO to find the copies (the `tiny` model did not improve in 60 steps), so `harts rl` starts
from a supervised warm start on imperfect demonstrations (`demonstration`).

Tokens (all below `vocab_size` = 64 + `text_vocab`, 128 by default: the `tiny` model has 256):
  BOS 1, TASK 2, HOPS 3, KEY 4, SEP 5, CALL 6, OUT 7, ANS 8; counts 1..15 at 16 + c; values
  0..V−1 at 32 + v (V ≤ 32); system-prompt text at 64.. (`text_vocab` tokens).
Episode (h = 2, optimal):
  BOS <system prompt> TASK HOPS c2 KEY v5 SEP | CALL v5 OUT v1 CALL v1 OUT v6 ANS v6
The system prompt (the tool's description) is the same fixed pseudo-random text in every task
(drawn from a constant seed, not the run's), so all trees of a step share it, as a scaffold's
system prompt is shared in agentic RL. After SEP and after each tool output the agent writes CALL
or ANS (only ANS once `max_calls` calls were made); after CALL or ANS it writes a value. The
environment appends the tool output (OUT, value) itself. `legal(episode)` is that grammar; the agent
samples from its whole vocabulary, and a token outside the grammar ends the episode unrewarded (a
malformed action, as an agent framework fails on an unparsable tool call), so the policy that is
sampled is exactly the policy that is trained.

Deterministic: a task is a function of the numpy generator it is drawn from; an episode of the
tokens the agent chooses. Tested in tests/rollout/test_env.py.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

BOS, TASK, HOPS, KEY, SEP, CALL, OUT, ANS = 1, 2, 3, 4, 5, 6, 7, 8
COUNT0 = 16
VALUE0 = 32
TEXT0 = 64
MAX_VALUES = TEXT0 - VALUE0
MAX_HOPS = VALUE0 - COUNT0 - 1
SYSTEM_PROMPT_SEED = 20260
"""Constant seed of the system prompt's text: the same prompt in every run."""


@dataclass(kw_only=True)
class LookupEnvConfig:
    """Sizes of the lookup tasks."""

    num_values: int = 8
    """V: keys and values are 0..V−1 (at most 32)."""
    min_hops: int = 1
    max_hops: int = 2
    """h of a task is uniform in [min_hops, max_hops] (at most 15)."""
    max_calls: int = 4
    """Tool calls allowed per episode; then the agent must answer."""
    system_prompt_length: int = 48
    """Tokens of the shared system prompt after BOS."""
    text_vocab: int = 64
    """Distinct tokens of the system prompt's text."""

    def __post_init__(self) -> None:
        if not 2 <= self.num_values <= MAX_VALUES:
            raise ValueError(f"env.num_values must be in [2, {MAX_VALUES}], got {self.num_values}")
        if not 1 <= self.min_hops <= self.max_hops <= MAX_HOPS:
            raise ValueError(f"env: need 1 <= min_hops <= max_hops <= {MAX_HOPS}, got {self.min_hops}, {self.max_hops}")
        if self.max_calls < self.max_hops:
            raise ValueError(f"env.max_calls ({self.max_calls}) must allow max_hops ({self.max_hops}) calls")
        if self.system_prompt_length < 0 or self.text_vocab < 1:
            raise ValueError("env.system_prompt_length must be >= 0 and env.text_vocab >= 1")


@dataclass(frozen=True)
class Task:
    table: tuple[int, ...]
    """f(v) for v = 0..V−1."""
    key: int
    hops: int

    @property
    def answer(self) -> int:
        value = self.key
        for _ in range(self.hops):
            value = self.table[value]
        return value


@dataclass
class Episode:
    """One rollout's progress through a task (copied when the rollout forks)."""

    task: Task
    phase: str = "decide"
    """"decide" (CALL or ANS next), "argument" (a call's value next), "answer" (the answer's value next), "done"."""
    calls: int = 0
    answer: int | None = None
    malformed: bool = False
    """The agent wrote a token outside the grammar (which ended the episode)."""

    def fork(self) -> Episode:
        return copy.copy(self)


class LookupEnv:
    def __init__(self, config: LookupEnvConfig) -> None:
        self.config = config
        text = np.random.default_rng(SYSTEM_PROMPT_SEED).integers(0, config.text_vocab, config.system_prompt_length)
        self.prefix = [BOS, *(TEXT0 + int(t) for t in text)]
        """BOS and the system prompt: the first tokens of every trajectory."""
        self._values = tuple(VALUE0 + v for v in range(config.num_values))

    @property
    def vocab_size(self) -> int:
        return TEXT0 + self.config.text_vocab

    @property
    def max_length(self) -> int:
        """Tokens of the longest trajectory: prefix, task prompt, calls of 4 tokens, the answer."""
        return len(self.prefix) + 6 + 4 * self.config.max_calls + 2

    def sample_task(self, rng: np.random.Generator) -> Task:
        c = self.config
        table = tuple(int(v) for v in rng.integers(0, c.num_values, c.num_values))
        return Task(table=table, key=int(rng.integers(0, c.num_values)),
                    hops=int(rng.integers(c.min_hops, c.max_hops + 1)))

    def prompt(self, task: Task) -> list[int]:
        """The task's tokens after the shared prefix, ending with SEP."""
        return [TASK, HOPS, COUNT0 + task.hops, KEY, VALUE0 + task.key, SEP]

    def legal(self, episode: Episode) -> tuple[int, ...]:
        """The tokens the agent may emit now (empty once the episode is done)."""
        if episode.phase == "decide":
            return (ANS,) if episode.calls >= self.config.max_calls else (CALL, ANS)
        if episode.phase in ("argument", "answer"):
            return self._values
        return ()

    def act(self, episode: Episode, token: int) -> list[int]:
        """Apply the agent's `token`; return the tokens the environment appends after it (the tool
        output after a call's argument, else nothing). A token outside `legal(episode)` ends the
        episode (malformed); acting on an ended episode is a ValueError."""
        if episode.phase == "done":
            raise ValueError("LookupEnv.act: the episode has ended")
        if token not in self.legal(episode):
            episode.malformed = True
            episode.phase = "done"
            return []
        if episode.phase == "decide":
            episode.phase = "argument" if token == CALL else "answer"
            return []
        value = token - VALUE0
        if episode.phase == "argument":
            episode.calls += 1
            episode.phase = "decide"
            return [OUT, VALUE0 + episode.task.table[value]]
        episode.answer = value
        episode.phase = "done"
        return []

    def demonstration(self, task: Task, rng: np.random.Generator, accuracy: float) -> tuple[list[int], list[int], float]:
        """(tokens, loss mask, reward) of a scripted agent that takes the optimal action with
        probability `accuracy` at each of its tokens, else a legal one at random (the warm start's
        data: it never writes outside the grammar); the loss mask marks the agent's tokens."""
        episode = Episode(task=task)
        tokens = [*self.prefix, *self.prompt(task)]
        loss_mask = [0] * len(tokens)
        last = task.key
        while episode.phase != "done":
            legal = self.legal(episode)
            if episode.phase == "decide":
                best = CALL if episode.calls < task.hops else ANS
            else:
                best = VALUE0 + last
            token = best if rng.random() < accuracy else int(rng.choice(legal))
            tokens.append(token)
            loss_mask.append(1)
            output = self.act(episode, token)
            if output:
                last = output[1] - VALUE0
            tokens += output
            loss_mask += [0] * len(output)
        return tokens, loss_mask, self.reward(episode)

    def reward(self, episode: Episode) -> float:
        """1.0 for the right answer, else 0.0 (also for a malformed episode; it must be done)."""
        assert episode.phase == "done", "reward of an unfinished episode"
        return float(episode.answer == episode.task.answer)

    def render(self, tokens: list[int]) -> str:
        """A readable form of a trajectory (the system prompt abbreviated)."""
        names = {BOS: "BOS", TASK: "TASK", HOPS: "HOPS", KEY: "KEY", SEP: "SEP", CALL: "CALL", OUT: "OUT", ANS: "ANS"}
        words, text = [], 0
        for token in tokens:
            if token >= TEXT0:
                text += 1
                continue
            if text:
                words.append(f"<system:{text}>")
                text = 0
            if token in names:
                words.append(names[token])
            elif token >= VALUE0:
                words.append(f"v{token - VALUE0}")
            else:
                words.append(f"c{token - COUNT0}")
        if text:
            words.append(f"<system:{text}>")
        return " ".join(words)
