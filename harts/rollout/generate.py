"""Rollout trees sampled by the model itself: batched incremental decoding through an environment.

`generate_trees(model, env, tasks, config, generator)` grows one tree per task:
1. the shared prefix (BOS and the system prompt) is decoded once, and the cache forked to one row
   per task, which then consumes its task prompt;
2. after the prompt each task's row forks into `samples_per_task` rows (the GRPO group's samples);
3. every row then alternates agent tokens and environment tokens: an agent token is sampled from
   the model's next-token distribution over its whole vocabulary, with `temperature` and `top_p`
   (loss mask 1); the environment's tokens (the task prompt, tool outputs) are appended as they are
   (loss mask 0); a token outside the environment's grammar ends the episode unrewarded;
4. each time a sample's tool call returns, with probability `retry_prob` the sample forks a retry:
   a copy of the row (its KDA states, conv windows and MLA latents, `DecodeCache.select`) that
   continues from the tool output on its own; retries do not fork again.
All rows advance together, one token per row per `decode_step`, so a row's cache is always at its
own length; a row whose episode ended leaves the batch. Every random draw (sampling, retries) comes
from `generator`, in a fixed row order, so a tree set is a function of the weights, the tasks and
the generator's seed.

A trajectory records its tokens, loss mask, reward and, per token as a target, the log-probability
of the distribution it was drawn from (0 for environment tokens): with temperature 1 and top_p 1
that is the log_softmax of the full forward's logits, the training step's log-prob
(tests/rollout/test_generate.py checks exactly that, which also pins every token fed to the decoder
and every fork to its row).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import torch

from harts.model.decode import decode_step, empty_cache
from harts.model.model import HybridModel
from harts.rollout.env import Episode, LookupEnv, Task


@dataclass(kw_only=True)
class RolloutConfig:
    """How a step's trees are sampled."""

    tasks_per_step: int = 16
    """Trees per step (one task each)."""
    samples_per_task: int = 4
    """Samples forking after each task's prompt (the GRPO group's samples)."""
    retry_prob: float = 0.5
    """Probability that a sample forks one retry at each of its tool outputs."""
    temperature: float = 1.0
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p (1 = all)."""

    def __post_init__(self) -> None:
        if self.tasks_per_step < 1 or self.samples_per_task < 1:
            raise ValueError("rollout.tasks_per_step and rollout.samples_per_task must be >= 1")
        if not 0 <= self.retry_prob <= 1:
            raise ValueError(f"rollout.retry_prob must be in [0, 1], got {self.retry_prob}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"rollout.temperature must be a finite number > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Trajectory:
    tree: int
    """Index of the task (tree) in the step."""
    sample: int
    """Index of the sample in its tree."""
    retry: int | None
    """None for a sample; for a retry, its index among its sample's retries."""
    tokens: list[int]
    loss_mask: list[int]
    """1 for the agent's (sampled) tokens, 0 for the prefix, the prompt and tool outputs."""
    logprobs: list[float]
    """Per token as a target: log-probability under the sampling distribution (0 where not sampled)."""
    forked_at: int
    """Tokens it shares with its parent by construction: a sample with the other samples of its tree
    (the prefix and the task prompt), a retry with its sample (up to the tool output it forked at)."""
    reward: float = 0.0
    malformed: bool = False
    """It ended on a token outside the environment's grammar."""

    @property
    def name(self) -> str:
        return f"t{self.tree}/s{self.sample}" + ("" if self.retry is None else f"/r{self.retry}")


@dataclass
class _Row:
    trajectory: Trajectory
    episode: Episode | None
    """None while the row still consumes its task prompt."""
    pending: deque = field(default_factory=deque)
    """Environment tokens to append, one per decode step."""
    retries: int = 0

    def fork(self, retry: int | None) -> _Row:
        t = self.trajectory
        trajectory = Trajectory(tree=t.tree, sample=t.sample, retry=retry, tokens=list(t.tokens),
                                loss_mask=list(t.loss_mask), logprobs=list(t.logprobs),
                                forked_at=len(t.tokens) + len(self.pending))
        return _Row(trajectory=trajectory, episode=None if self.episode is None else self.episode.fork(),
                    pending=deque(self.pending))

    def append(self, token: int, loss_mask: int, logprob: float) -> None:
        self.trajectory.tokens.append(token)
        self.trajectory.loss_mask.append(loss_mask)
        self.trajectory.logprobs.append(logprob)


def sampling_distribution(logits_BV: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Probabilities [B, V]: softmax of logits / temperature, then the nucleus (the most probable
    tokens until their mass reaches top_p; the first one always) renormalised."""
    probs = torch.softmax(logits_BV.float() / temperature, dim=-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter(1, order, before < top_p)
        probs = probs * keep
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


@torch.no_grad()
def generate_trees(model: HybridModel, env: LookupEnv, tasks: list[Task], config: RolloutConfig,
                   generator: torch.Generator) -> list[Trajectory]:
    """One tree per task (see the module docstring); trajectories in the order their episodes ended."""
    if env.vocab_size > model.config.vocab_size:
        raise ValueError(f"the environment's {env.vocab_size} tokens exceed the model's vocabulary "
                         f"({model.config.vocab_size})")
    device = model.embed.weight.device
    prefix = env.prefix
    cache = empty_cache(model, 1, env.max_length)
    for token in prefix[:-1]:
        decode_step(model, cache, torch.tensor([token], device=device))
    cache = cache.select(torch.zeros(len(tasks), dtype=torch.int64, device=device))
    rows = []
    for k, task in enumerate(tasks):
        prompt = env.prompt(task)
        row = _Row(trajectory=Trajectory(tree=k, sample=0, retry=None, tokens=list(prefix), loss_mask=[0] * len(prefix),
                                         logprobs=[0.0] * len(prefix), forked_at=len(prefix) + len(prompt)),
                   episode=None)
        row.pending.extend(prompt)
        rows.append(row)

    finished: list[Trajectory] = []
    while rows:
        last = torch.tensor([row.trajectory.tokens[-1] for row in rows], device=device)
        logits = decode_step(model, cache, last)
        keep: list[int] = []
        forks: list[tuple[int, _Row]] = []
        acting = [i for i, row in enumerate(rows) if not row.pending and row.episode is not None]
        choices = _sample(logits, acting, config, generator)
        for i, row in enumerate(rows):
            if row.pending:
                row.append(row.pending.popleft(), 0, 0.0)
                if not row.pending and row.episode is None:
                    # The task prompt is in: fork the group's samples here.
                    row.episode = Episode(task=tasks[row.trajectory.tree])
                    for j in range(1, config.samples_per_task):
                        sample = row.fork(None)
                        sample.trajectory.sample = j
                        forks.append((i, sample))
                keep.append(i)
                continue
            token, logprob = choices[i]
            row.append(token, 1, logprob)
            row.pending.extend(env.act(row.episode, token))
            if row.episode.phase == "done":
                row.trajectory.reward = env.reward(row.episode)
                row.trajectory.malformed = row.episode.malformed
                finished.append(row.trajectory)
                continue
            keep.append(i)
            is_sample = row.trajectory.retry is None
            if row.pending and is_sample and torch.rand((), generator=generator).item() < config.retry_prob:
                forks.append((i, row.fork(row.retries)))
                row.retries += 1
        sources = keep + [i for i, _ in forks]
        rows = [rows[i] for i in keep] + [fork for _, fork in forks]
        if rows:
            cache = cache.select(torch.tensor(sources, dtype=torch.int64, device=device))
    return finished


def _sample(logits_BV: torch.Tensor, acting: list[int], config: RolloutConfig,
            generator: torch.Generator) -> dict[int, tuple[int, float]]:
    """Row index -> (token, log-prob) for the rows whose agent writes now."""
    if not acting:
        return {}
    index = torch.tensor(acting, device=logits_BV.device)
    probs = sampling_distribution(logits_BV[index], config.temperature, config.top_p).cpu()
    tokens = torch.multinomial(probs, 1, generator=generator)
    logprobs = probs.gather(1, tokens).squeeze(1).log()
    return dict(zip(acting, zip(tokens.squeeze(1).tolist(), logprobs.tolist())))
