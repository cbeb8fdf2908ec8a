"""Synthetic GRPO steps: groups of samples sharing a prompt, with sub-trees where samples resume at a tool turn.

`generate_grpo_step(config, seed, step_index) -> Step` builds one step of `num_groups` groups. Every group shares
the step's system prompt, then its own prompt; it holds between `min_group_size` and `max_group_size` samples.
A sample alternates assistant turns and tool outputs until its response length, ending on an assistant turn and
never passing the capacity T (`max_tokens`). The group's first sample starts after the prompt; each later one,
with `fork_probability`, resumes after a tool output of an earlier sample of its group (a re-sampled continuation
of an agentic rollout: a sub-tree under that sample), else starts after the prompt. Siblings differ at their first
token (a group's prompts differ from other groups' at their first token), so the trie of the tokens is exactly the
generated tree: the group's compact tokens are its prompt plus the samples' own tokens, and a group of 12 samples
of ~1,000 tokens is larger than T = 8,192, so a planner must split it. Loss mask = assistant tokens; rewards are
Bernoulli per group (a group-specific success rate) and advantages the GRPO normalisation within the group.

`GRPO_SHAPES` names the shapes the planning tail benchmark uses (`harts bench planning-grpo`): "math" (short
prompts, short responses with a few code-tool calls; most groups within T), "agent" (a long system prompt,
multi-turn tool use, most groups beyond T) and "longtail" (heavy-tailed response lengths, some near T).

Deterministic: a step depends only on (config, seed, step_index); each group draws from its own generator seeded
by (seed, step_index, group). Tested in tests/trees/test_synth_grpo.py (determinism, group sizes, the compact size
of each group against the trie, capacity, sub-trees present, several groups larger than T).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harts.trees.step import TOKEN_DTYPE, Step, grpo_advantages
from harts.trees.synth import Lengths


@dataclass(kw_only=True)
class GrpoConfig:
    """Shape of a synthetic GRPO step."""

    num_groups: int
    """Groups (prompts) per step."""
    min_group_size: int = 8
    max_group_size: int = 16
    """Samples per group, drawn uniformly from [min_group_size, max_group_size]."""
    max_tokens: int = 8192
    """Capacity T: no sample is longer."""
    vocab_size: int = 32768
    system_prompt_tokens: int
    """Shared by every group of the step (0: the step is a forest of groups)."""
    prompt_tokens: Lengths
    """A group's own prompt."""
    response_tokens: Lengths
    """Tokens a sample generates after its group's prompt (assistant turns and tool outputs)."""
    assistant_tokens: Lengths
    tool_tokens: Lengths
    fork_probability: float = 0.0
    """Chance that a sample after the group's first resumes after a tool output of an earlier sample."""

    def __post_init__(self) -> None:
        if self.num_groups < 1 or not 1 <= self.min_group_size <= self.max_group_size:
            raise ValueError("num_groups >= 1 and 1 <= min_group_size <= max_group_size")
        if not 0 <= self.fork_probability <= 1:
            raise ValueError("fork_probability must be in [0, 1]")
        if self.vocab_size < 16 or self.system_prompt_tokens < 0:
            raise ValueError("vocab_size >= 16 and system_prompt_tokens >= 0")
        if self.system_prompt_tokens + self.prompt_tokens.max + self.assistant_tokens.min > self.max_tokens:
            raise ValueError("max_tokens is too small: system prompt + longest prompt + an assistant turn must fit")


GRPO_SHAPES: dict[str, GrpoConfig] = {
    "math": GrpoConfig(
        num_groups=48, system_prompt_tokens=64,
        prompt_tokens=Lengths(median=160, sigma=0.5, min=32, max=1024),
        response_tokens=Lengths(median=380, sigma=0.7, min=48, max=8192),
        assistant_tokens=Lengths(median=180, sigma=0.6, min=8, max=2048),
        tool_tokens=Lengths(median=60, sigma=0.8, min=4, max=512),
        fork_probability=0.2,
    ),
    "agent": GrpoConfig(
        num_groups=20, system_prompt_tokens=1024,
        prompt_tokens=Lengths(median=400, sigma=0.6, min=64, max=2048),
        response_tokens=Lengths(median=1400, sigma=0.5, min=128, max=8192),
        assistant_tokens=Lengths(median=120, sigma=0.5, min=8, max=1024),
        tool_tokens=Lengths(median=220, sigma=1.0, min=8, max=2048),
        fork_probability=0.35,
    ),
    "longtail": GrpoConfig(
        num_groups=32, system_prompt_tokens=256,
        prompt_tokens=Lengths(median=250, sigma=0.7, min=32, max=2048),
        response_tokens=Lengths(median=500, sigma=1.1, min=32, max=8192),
        assistant_tokens=Lengths(median=200, sigma=0.8, min=8, max=4096),
        tool_tokens=Lengths(median=100, sigma=1.0, min=4, max=1024),
        fork_probability=0.25,
    ),
}


@dataclass
class _Sample:
    parent: int
    """Sample of the group this one resumes from, -1 when it starts after the prompt."""
    fork: int
    """Path position of the sample's first own token."""
    turns: list[tuple[bool, int]]
    """(is assistant, length) of the sample's own turns."""

    @property
    def end(self) -> int:
        return self.fork + sum(length for _, length in self.turns)

    def fork_points(self) -> list[int]:
        """Path positions right after the sample's own tool outputs."""
        points, position = [], self.fork
        for assistant, length in self.turns:
            position += length
            if not assistant:
                points.append(position)
        return points


def _grow(config: GrpoConfig, rng: np.random.Generator, fork: int, target: int) -> list[tuple[bool, int]]:
    """Turns from `fork` until `target` (at least one assistant turn), ending on an assistant turn within T."""
    cap = config.max_tokens
    turns: list[tuple[bool, int]] = []
    position = fork
    while True:
        assistant = min(config.assistant_tokens.sample(rng), cap - position)
        turns.append((True, assistant))
        position += assistant
        if position >= target:
            return turns
        tool = config.tool_tokens.sample(rng)
        if position + tool + config.assistant_tokens.min > min(cap, target):
            return turns
        turns.append((False, tool))
        position += tool


def _group_structure(config: GrpoConfig, rng: np.random.Generator) -> tuple[int, list[_Sample]]:
    """(prompt length, samples) of one group: lengths only."""
    prompt = config.system_prompt_tokens + config.prompt_tokens.sample(rng)
    size = int(rng.integers(config.min_group_size, config.max_group_size + 1))
    samples: list[_Sample] = []
    for _ in range(size):
        response = config.response_tokens.sample(rng)
        fork, parent = prompt, -1
        resumes = samples and rng.random() < config.fork_probability
        if resumes:
            options = [(s, p) for s, sample in enumerate(samples) for p in sample.fork_points()]
            if options:
                parent, fork = options[int(rng.integers(len(options)))]
        target = max(prompt + response, fork + config.assistant_tokens.min)
        samples.append(_Sample(parent=parent, fork=fork, turns=_grow(config, rng, fork, target)))
    return prompt, samples


def generate_grpo_step(config: GrpoConfig, seed: int, step_index: int) -> Step:
    """Step `step_index` of the seeded GRPO dataset `config` (tokens, masks, rewards, advantages)."""
    low, high = 0, config.vocab_size
    system = np.random.default_rng([seed, step_index, 1 << 20]).integers(low, high, config.system_prompt_tokens)
    group_starts: set[int] = set()
    ids, trees, paths, masks, rewards, advantages = [], [], [], [], [], []
    for group in range(config.num_groups):
        rng = np.random.default_rng([seed, step_index, group])
        prompt_length, samples = _group_structure(config, rng)
        prompt = np.concatenate([system, rng.integers(low, high, prompt_length - config.system_prompt_tokens)])
        prompt[config.system_prompt_tokens] = _distinct(int(prompt[config.system_prompt_tokens]), group_starts, high)
        # First tokens taken at each fork (parent sample, position); -1: the prompt's end.
        taken: dict[tuple[int, int], set[int]] = {}
        group_paths: list[np.ndarray] = []
        group_masks: list[np.ndarray] = []
        for sample in samples:
            own = rng.integers(low, high, sample.end - sample.fork)
            own_mask = np.concatenate([np.full(length, assistant, dtype=np.uint8)
                                       for assistant, length in sample.turns])
            if sample.parent < 0:
                base, base_mask = prompt, np.zeros(prompt_length, dtype=np.uint8)
            else:
                parent_path = group_paths[sample.parent]
                base, base_mask = parent_path[: sample.fork], group_masks[sample.parent][: sample.fork]
                taken.setdefault((sample.parent, sample.fork), {int(parent_path[sample.fork])})
            own[0] = _distinct(int(own[0]), taken.setdefault((sample.parent, sample.fork), set()), high)
            group_paths.append(np.concatenate([base, own]))
            group_masks.append(np.concatenate([base_mask, own_mask]))
        success_rate = rng.uniform(0.1, 0.9)
        group_rewards = (rng.random(len(samples)) < success_rate).astype(np.float32)
        group_advantages = grpo_advantages(group_rewards, [""] * len(samples))
        for s, (path, mask) in enumerate(zip(group_paths, group_masks)):
            ids.append(f"s{step_index:03d}-g{group:03d}-{s:02d}")
            trees.append(f"s{step_index:03d}-g{group:03d}")
            paths.append(path)
            masks.append(mask)
        rewards.append(group_rewards)
        advantages.append(group_advantages)
    order = np.random.default_rng([seed, step_index, 1 << 21]).permutation(len(ids))
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum([len(paths[k]) for k in order], out=offsets[1:])
    rewards_all, advantages_all = np.concatenate(rewards), np.concatenate(advantages)
    return Step(
        ids=tuple(ids[k] for k in order),
        trees=tuple(trees[k] for k in order),
        offsets=offsets,
        tokens=np.concatenate([paths[k] for k in order]).astype(TOKEN_DTYPE),
        loss_mask=np.concatenate([masks[k] for k in order]),
        rewards=rewards_all[order].astype(np.float32),
        advantage_per_trajectory=advantages_all[order].astype(np.float32),
        source=f"synth-grpo(seed={seed}, step={step_index})",
    )


def _distinct(token: int, used: set[int], high: int) -> int:
    """`token`, or the next id (cyclically) not in `used`; records the result in `used`."""
    while token in used:
        token = (token + 1) % high
    used.add(token)
    return token
