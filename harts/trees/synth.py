"""Synthetic steps shaped like Claude-Code-style SWE-bench agent rollouts.

`generate_step(config, seed, step_index) -> Step` builds one step: every task shares one long
scaffold system prompt, then its own issue text; each task grows a rollout tree of branches.
A branch alternates assistant turns and tool outputs until its target length, ending on an
assistant turn; after every tool output it may fork a side branch (a retry or parallel
exploration of the next assistant turn) whose continuation is short. A branch that would run
past the capacity T (`max_tokens`) is cut there and continues as a context-compaction branch
that forks right after the task prompt with a summary turn. Every branch is one trajectory
(its leaf), so trajectories never exceed T. Loss mask = assistant (and summary) tokens;
rewards are Bernoulli per task with a task-specific success rate and advantages are the
GRPO normalisation within each task.

Calibration: the compression S/C of a step depends on how long side branches run after their
fork. With `target_compression` set, the generator searches the continuation scale (bisection
on the lengths alone, same random draws) until S/C is within `compression_tolerance`, then
materialises tokens; it raises if no scale reaches the target. Sibling branches always differ
at their first token, so the trie of the tokens is exactly the generated tree.

Deterministic: a step depends only on (config, seed, step_index).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from harts.trees.step import TOKEN_DTYPE, Step, grpo_advantages

ASSISTANT, TOOL, SUMMARY = 0, 1, 2


@dataclass(kw_only=True)
class Lengths:
    """A log-normal token count, rounded and clipped to [min, max]."""

    median: float
    """Median of the log-normal before clipping."""
    sigma: float = 0.0
    """Log-space standard deviation (0 = always the median)."""
    min: int = 1
    max: int = 1 << 30

    def __post_init__(self) -> None:
        if not (self.median > 0 and self.sigma >= 0 and 1 <= self.min <= self.max):
            raise ValueError(f"invalid lengths {self}: need median > 0, sigma >= 0, 1 <= min <= max")

    def sample(self, rng: np.random.Generator, scale: float = 1.0) -> int:
        value = self.median * scale * math.exp(self.sigma * rng.standard_normal())
        return int(min(max(round(value), self.min), self.max))


MAX_STEP_TOKENS = 1 << 34
"""The most tokens a synthetic step's config may allow (the `paper-4x` trees allow 2^31): a config asking for
more would run for days before its memory runs out."""


@dataclass(kw_only=True)
class SynthConfig:
    """Shape of a synthetic step (configs/trees/*.yaml)."""

    num_steps: int
    """Steps in the dataset (`harts trees synth` writes step_000 .. step_{num_steps-1})."""
    num_tasks: int
    """Tasks (rollout trees) per step."""
    vocab_size: int
    """Token ids are drawn from [0, vocab_size)."""
    max_tokens: int
    """Capacity T: no trajectory is longer."""
    system_prompt_tokens: int
    """The scaffold system prompt shared by every task."""
    issue_tokens: Lengths
    assistant_tokens: Lengths
    tool_tokens: Lengths
    summary_tokens: Lengths
    """The summary turn that opens a context-compaction branch."""
    samples_per_task: int
    """Independent samples per task (forks right after the issue text)."""
    trajectory_tokens: Lengths
    """Target length of a sample; beyond max_tokens the sample continues after a compaction."""
    continuation_tokens: Lengths
    """Length a side branch runs after its fork (times the calibrated scale)."""
    max_branches_per_task: int
    """Trajectories per task at most (samples, side branches and compaction branches)."""
    max_tree_tokens: int | None = None
    """Compact tokens of a task's tree at most (prompt included); None = no budget."""
    tree_budget_ratio: float | None = None
    """A tree's compact budget = prompt + ratio × its samples' own tokens (capped by
    max_tree_tokens); None = max_tree_tokens alone."""
    max_subtree_tokens: int | None = None
    """Compact tokens of one sample's subtree at most (the sample or compaction branch with every
    side branch forking off it, prompt included); None = no limit. A side branch that would pass it
    forks elsewhere. Subtrees beyond T force a planner to repeat their long prefixes."""
    fork_position_skew: float = 1.0
    """>= 1: side branches fork at boundary index ⌊n·u^(1/skew)⌋ of their parent (larger = later)."""
    nested_fork_probability: float = 0.0
    """Chance that a side branch forks off another side branch (nested retries) rather than a sample."""
    fork_order: str = "random"
    """"random": each side branch forks off a sample (or, with `nested_fork_probability`, an earlier
    side branch) at a late-biased tool output. "rounds": side branch n (the first sample being branch
    0) forks off branch n - 2^⌊log2 n⌋ at that branch's first tool output after its previous fork, so
    that every branch forks once per round: a balanced (binomial) nesting, whose microbatches reach
    deep state handoffs (the replay ablation's depth d needs 2^d leaves nested in one microbatch)."""
    target_compression: float | None = None
    """Calibrate each step's S/C to this value (None: no calibration, scale 1)."""
    compression_tolerance: float = 0.05
    logprobs: bool = False
    """Also generate old/ref log-probs (consistent on shared prefixes)."""
    first_token_reserved: int = field(default=0)
    """Token ids below this are never generated (room for special tokens)."""

    def __post_init__(self) -> None:
        if self.num_steps < 1 or self.num_tasks < 1 or self.samples_per_task < 1:
            raise ValueError("num_steps, num_tasks and samples_per_task must be >= 1")
        if self.vocab_size - self.first_token_reserved < 16:
            raise ValueError("vocab_size must leave at least 16 usable token ids")
        if not 0 <= self.nested_fork_probability <= 1:
            raise ValueError("nested_fork_probability must be in [0, 1]")
        if self.fork_order not in ("random", "rounds"):
            raise ValueError(f"fork_order must be 'random' or 'rounds', got {self.fork_order!r}")
        if self.tree_budget_ratio is not None and self.tree_budget_ratio < 1:
            raise ValueError("tree_budget_ratio must be >= 1 (a tree holds at least its sample)")
        if self.fork_position_skew < 1:
            raise ValueError("fork_position_skew must be >= 1")
        for name in ("max_tree_tokens", "max_subtree_tokens"):
            limit = getattr(self, name)
            if limit is not None and limit < self.system_prompt_tokens + self.issue_tokens.max:
                raise ValueError(f"{name} must hold the system prompt and the longest issue")
        if self.max_branches_per_task < self.samples_per_task:
            raise ValueError("max_branches_per_task must be >= samples_per_task")
        most = self.num_tasks * self.max_branches_per_task * self.max_tokens
        if most > MAX_STEP_TOKENS:
            raise ValueError(
                f"num_tasks × max_branches_per_task × max_tokens = {most:,} tokens a step may hold, "
                f"more than {MAX_STEP_TOKENS:,} (2^34)"
            )
        prompt_max = self.system_prompt_tokens + self.issue_tokens.max
        if prompt_max + self.summary_tokens.max + self.assistant_tokens.max > self.max_tokens:
            raise ValueError(
                "max_tokens is too small: system prompt + longest issue + summary + assistant turn must fit"
            )


@dataclass
class _Branch:
    parent: int
    """Parent branch in the task, -1 for a branch that forks right after the task prompt."""
    fork: int
    """Path position of the branch's first own token."""
    depth: int
    target: int
    turns: list[tuple[int, int]]
    """(kind, length) of the branch's own turns."""
    end: int = 0


@dataclass
class _Task:
    issue: int
    branches: list[_Branch]


def _task_rng(seed: int, step: int, task: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, step, task, stream])


def _grow_branch(config: SynthConfig, branch: _Branch, rng: np.random.Generator, room: float) -> bool:
    """Append turns to `branch` until its target, the capacity T or the tree budget `room` (own
    tokens); returns whether the capacity cut it short (a context compaction follows)."""
    cap = config.max_tokens
    position = branch.fork
    limit = min(cap, branch.fork + room)
    if branch.turns:  # a compaction branch opens with its summary
        position += branch.turns[0][1]
    while True:
        assistant = min(config.assistant_tokens.sample(rng), int(limit) - position)
        branch.turns.append((ASSISTANT, assistant))
        position += assistant
        if position >= branch.target or position >= limit:
            break
        tool = config.tool_tokens.sample(rng)
        if position + tool + config.assistant_tokens.min > limit:
            break
        branch.turns.append((TOOL, tool))
        position += tool
    branch.end = position
    return position + config.assistant_tokens.min > cap and position < branch.target


def _fork_points(branch: _Branch) -> list[int]:
    """Path positions right after the branch's own tool outputs (where a turn can be resampled)."""
    points, position = [], branch.fork
    for kind, length in branch.turns:
        position += length
        if kind == TOOL:
            points.append(position)
    return points


def _grow_task(config: SynthConfig, seed: int, step: int, task: int, scale: float) -> _Task:
    """The branch structure (lengths only) of one task.

    Samples grow first (right after the task prompt); then side branches, each forking after a
    tool output of an earlier branch (a sample, or with `nested_fork_probability` a side branch,
    so forks nest), at a boundary drawn late-biased (index ⌊n·u^(1/skew)⌋), and running for a
    short continuation. Growth stops at `max_branches_per_task` or when the tree's compact tokens
    reach `max_tree_tokens`.
    """
    rng = _task_rng(seed, step, task, 0)
    issue = config.issue_tokens.sample(rng)
    prompt = config.system_prompt_tokens + issue
    targets = [prompt + config.trajectory_tokens.sample(rng) for _ in range(config.samples_per_task)]
    budget = config.max_tree_tokens if config.max_tree_tokens is not None else math.inf
    if config.tree_budget_ratio is not None:
        # A task's tree grows in proportion to its longest sample, so tree sizes spread like
        # trajectory lengths and small trees can share a microbatch.
        own = sum(min(target, config.max_tokens) - prompt for target in targets)
        budget = min(budget, prompt + config.tree_budget_ratio * own)
    used = prompt
    branches: list[_Branch] = []
    subtree_limit = config.max_subtree_tokens if config.max_subtree_tokens is not None else math.inf
    # Own tokens of each sample's subtree, by the index of its root branch.
    subtree_used: dict[int, int] = {}

    def root_of(b: int) -> int:
        while branches[b].parent != -1:
            b = branches[b].parent
        return b

    def add(branch: _Branch, stream: int) -> bool:
        nonlocal used
        own = sum(length for _, length in branch.turns)
        root = len(branches) if branch.parent == -1 else root_of(branch.parent)
        room = min(budget - used, subtree_limit - prompt - subtree_used.get(root, 0)) - own
        if room < config.assistant_tokens.min:
            return False
        compacted = _grow_branch(config, branch, _task_rng(seed, step, task, stream), room)
        branches.append(branch)
        used += branch.end - branch.fork
        subtree_used[root] = subtree_used.get(root, 0) + branch.end - branch.fork
        if compacted and len(branches) < config.max_branches_per_task:
            summary = config.summary_tokens.sample(rng)
            remaining = branch.target - branch.end
            add(_Branch(parent=-1, fork=prompt, depth=0, target=prompt + summary + remaining,
                        turns=[(SUMMARY, summary)]), stream + 1000)
        return True

    for sample, target in enumerate(targets):
        add(_Branch(parent=-1, fork=prompt, depth=0, target=target, turns=[]), 1 + sample)
    attempt = 0
    last_fork: dict[int, int] = {}
    while len(branches) < config.max_branches_per_task and used < budget:
        attempt += 1
        if config.fork_order == "rounds":
            count = len(branches)
            parent = count - (1 << (count.bit_length() - 1))
            points = [p for p in _fork_points(branches[parent]) if p > last_fork.get(parent, -1)]
            if not points:
                break
            fork = points[0]
            last_fork[parent] = fork
            continuation = config.continuation_tokens.sample(rng, scale)
        else:
            side = [b for b, br in enumerate(branches) if br.depth > 0]
            nested = side and rng.random() < config.nested_fork_probability
            roots = [b for b, br in enumerate(branches) if br.depth == 0]
            parent = int(rng.choice(side if nested else roots))
            points = _fork_points(branches[parent])
            continuation = config.continuation_tokens.sample(rng, scale)
            if not points:
                if attempt > 4 * config.max_branches_per_task:
                    break
                continue
            fork = points[int(len(points) * rng.random() ** (1.0 / config.fork_position_skew))]
        branch = _Branch(parent=parent, fork=fork, depth=branches[parent].depth + 1, target=fork + continuation, turns=[])
        if fork + config.assistant_tokens.min > config.max_tokens or used + config.assistant_tokens.min > budget:
            break
        if not add(branch, 100 + attempt):
            # Its sample's subtree is full: fork off another one, while attempts last.
            if attempt > 4 * config.max_branches_per_task:
                break
            continue
    return _Task(issue=issue, branches=branches)


def _compression(config: SynthConfig, tasks: list[_Task]) -> float:
    semantic = sum(br.end for t in tasks for br in t.branches)
    compact = config.system_prompt_tokens + sum(
        t.issue + sum(br.end - br.fork for br in t.branches) for t in tasks
    )
    return semantic / compact


def _structure(config: SynthConfig, seed: int, step: int, scale: float) -> list[_Task]:
    return [_grow_task(config, seed, step, task, scale) for task in range(config.num_tasks)]


def calibrate(config: SynthConfig, seed: int, step: int) -> tuple[float, list[_Task]]:
    """The continuation scale that hits `target_compression`, and the step's structure."""
    if config.target_compression is None:
        return 1.0, _structure(config, seed, step, 1.0)
    target = config.target_compression
    lo, hi = math.log(1e-3), math.log(1e3)
    best: tuple[float, float, list[_Task]] | None = None
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        tasks = _structure(config, seed, step, math.exp(mid))
        ratio = _compression(config, tasks)
        if best is None or abs(ratio - target) < abs(best[0] - target):
            best = (ratio, math.exp(mid), tasks)
        if abs(ratio - target) <= config.compression_tolerance / 2:
            break
        # Longer continuations share less: compression falls as the scale grows.
        if ratio > target:
            lo = mid
        else:
            hi = mid
    assert best is not None
    if abs(best[0] - target) > config.compression_tolerance / 2:
        # Compression is a step function of the scale (branches fit the budget or not): scan the
        # neighbourhood of the bisection's best point on a fine grid.
        for scale in best[1] * np.exp(np.linspace(-0.5, 0.5, 101)):
            tasks = _structure(config, seed, step, float(scale))
            ratio = _compression(config, tasks)
            if abs(ratio - target) < abs(best[0] - target):
                best = (ratio, float(scale), tasks)
    ratio, scale, tasks = best
    if abs(ratio - target) > config.compression_tolerance:
        raise ValueError(
            f"step {step}: cannot reach compression {target} (closest {ratio:.3f} at scale {scale:.3g}); "
            "adjust max_tree_tokens, continuation_tokens, fork_position_skew or max_branches_per_task"
        )
    return scale, tasks


def generate_step(config: SynthConfig, seed: int, step_index: int) -> Step:
    """Materialise step `step_index` of the dataset (tokens, masks, rewards, advantages)."""
    _, tasks = calibrate(config, seed, step_index)
    low, high = config.first_token_reserved, config.vocab_size
    prompt_rng = np.random.default_rng([seed, 1 << 20])
    system = prompt_rng.integers(low, high, config.system_prompt_tokens, dtype=np.int64)
    system_lp = -prompt_rng.exponential(1.0, config.system_prompt_tokens)
    used_issue_starts: set[int] = set()

    ids, trees, tokens, masks, rewards, advantages = [], [], [], [], [], []
    old_lps, ref_lps = [], []
    for task_index, task in enumerate(tasks):
        rng = _task_rng(seed, step_index, task_index, 1 << 20)
        issue = rng.integers(low, high, task.issue, dtype=np.int64)
        issue[0] = _distinct(int(issue[0]), used_issue_starts, low, high)
        prompt = np.concatenate([system, issue])
        prompt_mask = np.zeros(len(prompt), dtype=np.uint8)
        prompt_lp = np.concatenate([system_lp, -rng.exponential(1.0, task.issue)])

        paths: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        first_tokens: dict[tuple[int, int], set[int]] = {}
        for b, branch in enumerate(task.branches):
            own_len = branch.end - branch.fork
            own = rng.integers(low, high, own_len, dtype=np.int64)
            own_mask = np.zeros(own_len, dtype=np.uint8)
            at = 0
            for kind, length in branch.turns:
                if kind != TOOL:
                    own_mask[at : at + length] = 1
                at += length
            own_lp = -rng.exponential(1.0, own_len)
            if branch.parent == -1:
                base_tokens, base_mask, base_lp = prompt, prompt_mask, prompt_lp
            else:
                base_tokens, base_mask, base_lp = (a[: branch.fork] for a in paths[branch.parent])
                parent_next = int(paths[branch.parent][0][branch.fork])
                first_tokens.setdefault((branch.parent, branch.fork), {parent_next})
            group = first_tokens.setdefault((branch.parent, branch.fork), set())
            own[0] = _distinct(int(own[0]), group, low, high)
            paths.append((
                np.concatenate([base_tokens, own]),
                np.concatenate([base_mask, own_mask]),
                np.concatenate([base_lp, own_lp]),
            ))

        success_rate = rng.uniform(0.1, 0.9)
        task_rewards = (rng.random(len(task.branches)) < success_rate).astype(np.float32)
        task_advantages = grpo_advantages(task_rewards, [""] * len(task_rewards))
        for b, (path_tokens, path_mask, path_lp) in enumerate(paths):
            ids.append(f"s{step_index:03d}-t{task_index:03d}-b{b:03d}")
            trees.append(f"s{step_index:03d}-t{task_index:03d}")
            tokens.append(path_tokens)
            mask = path_mask.copy()
            mask[0] = 0
            masks.append(mask)
            rewards.append(task_rewards[b])
            advantages.append(task_advantages[b])
            old_lps.append(path_lp)
            ref_lps.append(np.minimum(path_lp + 0.05 * rng.standard_normal(len(path_lp)), 0.0))

    order = np.random.default_rng([seed, step_index, 1 << 21]).permutation(len(ids))
    lengths = np.asarray([len(tokens[k]) for k in order], dtype=np.int64)
    offsets = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Step(
        ids=tuple(ids[k] for k in order),
        trees=tuple(trees[k] for k in order),
        offsets=offsets,
        tokens=np.concatenate([tokens[k] for k in order]).astype(TOKEN_DTYPE),
        loss_mask=np.concatenate([masks[k] for k in order]),
        rewards=np.asarray([rewards[k] for k in order], dtype=np.float32),
        advantage_per_trajectory=np.asarray([advantages[k] for k in order], dtype=np.float32),
        old_logprobs=np.concatenate([old_lps[k] for k in order]).astype(np.float32) if config.logprobs else None,
        ref_logprobs=np.concatenate([ref_lps[k] for k in order]).astype(np.float32) if config.logprobs else None,
        source=f"synth(seed={seed}, step={step_index})",
    )


def _distinct(token: int, used: set[int], low: int, high: int) -> int:
    """`token`, or the next id (cyclically) not in `used`; records the result in `used`."""
    while token in used:
        token = low + (token + 1 - low) % (high - low)
    used.add(token)
    return token
