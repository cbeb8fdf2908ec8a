"""`run_seed`: online GRPO on rollout trees the model samples itself, in both executions side by side.

For a seed: the initial policy is the model initialised with the seed (`HybridModel.init_weights`)
after the warm start (`warm_start`: supervised steps on a scripted agent's episodes, which takes the
optimal action at each decision with probability `accuracy`, as an SFT checkpoint precedes RL); a
frozen copy of it is the reference policy (the KL is measured against the initial policy), and one
learner per execution
(`compact`, `baseline`), each a copy of the same initial weights with its own AdamW and schedule
(harts.optim.adamw). Step t = 0..N (N = num_steps), the executions in lockstep (their order
alternating from step to step, so that neither always runs first on a loaded machine):
1. the step's tasks, from numpy's generator seeded by (seed, t): the same in every execution;
2. sampling: `generate_trees` with the learner's current weights and a torch generator seeded by
   (seed, t) (so both executions start from the same draws; their trees part once their weights
   differ by rounding);
3. the `Step`: one trajectory per leaf, its tree id, loss mask (the sampled decisions), reward and
   GRPO advantage within its tree (`grpo_advantages`), on-policy (one update per batch, ratio 1);
4. the microbatch plan (`Engine.plan` of harts.engine: capacity T; `harts` for compact, `per-trajectory` for
   baseline, unless execution.planner names one);
5. the reference log-probs: the initial policy's forward over the same microbatches;
6. the training step: `Engine.run` (forward, GRPO loss, backward), the global-norm clip, AdamW, the
   schedule and the expert-bias update, as `harts train` does (t < N; step N runs the forward only,
   to measure the final policy's loss and KL).
Sampling (2) and the reference forward (5) are outside the timed training step: a step record
gives `seconds.sample`, `seconds.reference` and `seconds.train` = plan + layout + forward +
backward + optimizer (each also on its own).

With `execution.recompute_blocks: auto` (CUDA) a learner's engine searches the fewest recomputed blocks that fit
(`Engine.fit_recompute_blocks`, leaving room for the AdamW moments of every learner not yet allocated) before its
first update, and again before an update with a microbatch that no searched microbatch covers (rollouts vary in
size; the blocks only grow): that step's record holds it under `recompute_search`, outside its timed phases.

Step record: step, reward (mean over the step's samples: the policy's success rate from the prompt), reward_all (over
every trajectory, retries included), tool calls per sample, the fraction of samples that ended on a token outside the
grammar (malformed), loss, policy and MoE loss (with `loss.pooled_balance_coeff` > 0 also `pooled_balance_loss`: the
pooled load-balancing loss, mean over microbatches, without its coefficient, as `harts train` records it), KL (mean k3
estimate over the loss tokens), gradient norm, lr, trajectories, samples, retries, S, C (the step's trie), S/C, rows
computed, microbatches, seconds. Deterministic: a run is a function of its config and seed (tests/rl/test_loop.py
repeats one); with `tracker`, every step is logged live (harts.rl.tracking).
"""

from __future__ import annotations

import copy
import math
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from harts.config import config_to_dict
from harts.config.execution import ExecutionConfig
from harts.engine import Engine
from harts.model.model import HybridModel
from harts.objective.losses import step_kl
from harts.objective.step import pooled_balance_record
from harts.objective.targets import semantic_targets_from_step
from harts.optim.adamw import MasterWeightAdamW, make_scheduler
from harts.optim.config import OptimizerConfig
from harts.optim.update import apply_update
from harts.rl.config import RLConfig, model_config_of
from harts.rollout.env import CALL, LookupEnv
from harts.rollout.generate import Trajectory, generate_trees
from harts.trees.step import TOKEN_DTYPE, Step, grpo_advantages

TIMING = ("seconds.train = plan + layout + forward + backward + optimizer of the training step; sampling "
          "(seconds.sample) and the reference policy's forward (seconds.reference) run outside it")


def make_step(ids: list[str], trees: list[str], tokens: list[list[int]], loss_masks: list[list[int]],
              rewards: list[float], advantages: np.ndarray) -> Step:
    """A `Step` of whole trajectories (lists of tokens and loss masks), one scalar advantage each."""
    lengths = np.array([len(t) for t in tokens], dtype=np.int64)
    offsets = np.zeros(len(tokens) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Step(
        ids=tuple(ids), trees=tuple(trees), offsets=offsets,
        tokens=np.concatenate([np.asarray(t, dtype=TOKEN_DTYPE) for t in tokens]),
        loss_mask=np.concatenate([np.asarray(m, dtype=np.uint8) for m in loss_masks]),
        rewards=np.asarray(rewards, dtype=np.float32), advantage_per_trajectory=np.asarray(advantages, dtype=np.float32),
        source="rollouts",
    )


def step_from_trajectories(trajectories: list[Trajectory]) -> Step:
    """The training step of sampled trees: GRPO advantages within each tree, on-policy."""
    trees = [f"t{t.tree}" for t in trajectories]
    rewards = [t.reward for t in trajectories]
    return make_step([t.name for t in trajectories], trees, [t.tokens for t in trajectories],
                     [t.loss_mask for t in trajectories], rewards, grpo_advantages(np.asarray(rewards), trees))


def target_logprobs(step: Step, logprobs_S: torch.Tensor) -> np.ndarray:
    """Log-probs per token as a target (token i predicted at position i − 1; 0 for first tokens)."""
    values = logprobs_S.numpy()
    shifted = np.zeros_like(values)
    shifted[1:] = values[:-1]
    shifted[step.offsets[:-1]] = 0.0
    return shifted


def _generator_seed(seed: int, step: int) -> int:
    return int(np.random.SeedSequence([seed, step, 1]).generate_state(1, dtype=np.uint64)[0] >> 1)


def step_tasks(env: LookupEnv, seed: int, step: int, count: int):
    rng = np.random.default_rng([seed, step, 0])
    return [env.sample_task(rng) for _ in range(count)]


@dataclass
class _Learner:
    """One execution's policy, optimizer and schedule."""

    execution: str
    model: HybridModel
    optimizer: MasterWeightAdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR
    engine: Engine


def _learner(execution: str, model: HybridModel, config: RLConfig) -> _Learner:
    optimizer = MasterWeightAdamW(model.named_parameters(), config.optimizer)
    engine = Engine.build(model, config.execution, config.device, loss_config=config.loss, execution=execution)
    return _Learner(execution=execution, model=model, optimizer=optimizer,
                    scheduler=make_scheduler(optimizer, config.schedule, config.num_steps), engine=engine)


def initial_model(config: RLConfig, seed: int) -> HybridModel:
    with torch.device(config.device):
        model = HybridModel(model_config_of(config))
    model.init_weights(seed)
    if config.dtype == "bf16":
        model.to(torch.bfloat16)
    return model


def warm_start(model: HybridModel, env: LookupEnv, config: RLConfig, seed: int) -> dict[str, Any]:
    """Supervised steps on demonstrations (in place); their negative log-likelihood per decision
    at the first and last step and the demonstrations' mean reward."""
    warm = config.warm_start
    if warm.steps == 0:
        return {"steps": 0}
    rng = np.random.default_rng([seed, 0, 2])
    optimizer = MasterWeightAdamW(model.named_parameters(), OptimizerConfig(lr=warm.lr, weight_decay=0.0))
    # GRPO's surrogate with advantage 1, on-policy, has the gradient of the mean negative log-likelihood.
    e = config.execution
    engine = Engine.build(model, ExecutionConfig(
        attention_backend=e.attention_backend, kda_backend=e.kda_backend, dtype=e.dtype,
        logprob_grad_precision=e.logprob_grad_precision, logprob_chunk_rows=e.logprob_chunk_rows,
    ), config.device, execution="compact")
    nll, rewards = [], []
    try:
        for _ in range(warm.steps):
            episodes = [env.demonstration(env.sample_task(rng), rng, warm.accuracy) for _ in range(warm.episodes)]
            names = [f"d{k}" for k in range(warm.episodes)]
            tokens, loss_masks, episode_rewards = zip(*episodes)
            rewards += episode_rewards
            step = make_step(names, names, list(tokens), list(loss_masks), list(episode_rewards),
                             np.ones(warm.episodes, dtype=np.float32))
            optimizer.zero_grad()
            result = engine.run_microbatches(step, [np.arange(step.num_trajectories)], collect_logprobs=True)
            optimizer.clip_grad_norm(1.0)
            optimizer.step()
            mask = semantic_targets_from_step(step).loss_mask
            nll.append(float(-result.logprobs[torch.from_numpy(mask)].mean()))
    finally:
        optimizer.remove_hooks()
    return {"steps": warm.steps, "nll_first": nll[0], "nll_last": nll[-1],
            "demonstration_reward": float(np.mean(rewards))}


def run_seed(config: RLConfig, seed: int, *, progress: bool = False,
             tracker=None) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """Warm start and RL of every execution of `config` (resolved) with `seed`: (the warm start's
    summary, {execution: [record per step]})."""
    env = LookupEnv(config.env)
    model = initial_model(config, seed)
    warm = warm_start(model, env, config, seed)
    reference = copy.deepcopy(model).requires_grad_(False)
    learners = [_learner(e, copy.deepcopy(model), config) for e in config.executions]
    records: dict[str, list[dict[str, Any]]] = {e: [] for e in config.executions}
    bar = tqdm(total=config.num_steps + 1, desc=f"{config.name} seed {seed}", unit="step", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    try:
        for t in range(config.num_steps + 1):
            tasks = step_tasks(env, seed, t, config.rollout.tasks_per_step)
            order = learners if t % 2 == 0 else learners[::-1]
            logged = {}
            for learner in order:
                # A search before this learner's update leaves room for every learner's AdamW moments not yet
                # allocated (the other learner's may come after it).
                reserved = sum(each.optimizer.pending_state_bytes() for each in learners)
                record = _step(config, env, learner, reference, tasks, seed, t, reserved)
                records[learner.execution].append(record)
                logged[learner.execution] = record
            if tracker is not None:
                tracker.log({"step": t, **logged})
            bar.set_postfix({e: f"{r['reward']:.2f}" for e, r in logged.items()}, refresh=False)
            bar.update(1)
    finally:
        bar.close()
        for learner in learners:
            learner.optimizer.remove_hooks()
    return warm, records


def _step(config: RLConfig, env: LookupEnv, learner: _Learner, reference: HybridModel, tasks, seed: int,
          t: int, reserved_bytes: int = 0) -> dict[str, Any]:
    where = f"seed {seed}, {learner.execution}, step {t}"
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(_generator_seed(seed, t))
    trajectories = generate_trees(learner.model, env, tasks, config.rollout, generator)
    step = step_from_trajectories(trajectories)
    sample_seconds = time.perf_counter() - start

    planned = learner.engine.plan(step)
    update = t < config.num_steps

    start = time.perf_counter()
    # The reference forward is for its log-probs; its loss is unused, and a KL term would read the very log-probs
    # it is computing.
    engine_config = learner.engine.config
    reference_config = replace(engine_config, grpo=replace(engine_config.grpo, kl_coef=0.0))
    ref = Engine(reference, reference_config).run(step, planned, backward=False, collect_logprobs=True)
    step = replace(step, ref_logprobs=target_logprobs(step, ref.logprobs))
    reference_seconds = time.perf_counter() - start
    # After the reference log-probs: the probes run the step's loss, whose KL term reads them.
    search = _search(learner.engine, step, planned, reserved_bytes) if update else None

    lr = learner.scheduler.get_last_lr()[0]
    learner.optimizer.zero_grad()
    result = learner.engine.run(step, planned, backward=update, collect_logprobs=True)
    if not math.isfinite(result.loss):
        raise ValueError(f"{where}: the loss is {result.loss}")
    grad_norm = None
    start = time.perf_counter()
    if update:
        grad_norm = apply_update(learner.model, learner.optimizer, learner.scheduler, config.optimizer.max_grad_norm,
                                 result.tokens_per_expert, where)
        # Freed now rather than at this learner's next step: the other learner's step (and its search) runs in
        # between, and a recompute search leaves room only for the moments not yet allocated.
        learner.optimizer.zero_grad()
        # The optimizer's kernels are asynchronous on CUDA: its time is up to their end, as run_step's phases.
        if learner.model.embed.weight.is_cuda:
            torch.cuda.synchronize(learner.model.embed.weight.device)
    optimizer_seconds = time.perf_counter() - start

    samples = [tr for tr in trajectories if tr.retry is None]
    compact_tokens = planned.index.segment_tree().num_compact_tokens
    seconds = {"sample": sample_seconds, "reference": reference_seconds, "plan": planned.seconds, **result.seconds,
               "optimizer": optimizer_seconds}
    seconds["train"] = sum(seconds[k] for k in ("plan", "layout", "forward", "backward", "optimizer"))
    return {
        "step": t,
        "update": update,
        "reward": float(np.mean([tr.reward for tr in samples])),
        "reward_all": float(step.rewards.mean()),
        "tool_calls": float(np.mean([tr.tokens.count(CALL) for tr in samples])),
        "malformed": float(np.mean([tr.malformed for tr in samples])),
        "loss": result.loss,
        "policy_loss": result.policy_loss,
        "moe_loss": result.moe_loss,
        **pooled_balance_record(result),
        "kl": step_kl(step, result.logprobs),
        "grad_norm": grad_norm,
        "lr": lr if update else None,
        "trajectories": step.num_trajectories,
        "samples": len(samples),
        "retries": step.num_trajectories - len(samples),
        "semantic_tokens": step.num_semantic_tokens,
        "compact_tokens": compact_tokens,
        "compression": step.num_semantic_tokens / compact_tokens,
        "rows": result.num_rows,
        **result.mtp_record(),
        "microbatches": planned.num_microbatches,
        "seconds": seconds,
        **({"recompute_search": search} if search is not None else {}),
    }


def _search(engine: Engine, step, planned, reserved_bytes: int) -> dict[str, Any] | None:
    """recompute_blocks auto: `Engine.search_if_needed` on this step before its update (the first update, or a
    microbatch outside those searched on), leaving `reserved_bytes` free; its record with its seconds (outside the
    step's timed phases), or None."""
    start = time.perf_counter()
    search = engine.search_if_needed(step, planned, reserved_bytes=reserved_bytes)
    return None if search is None else {**search, "seconds": time.perf_counter() - start}


def run_config(config: RLConfig, seed: int) -> dict[str, Any]:
    """The config part of a run's record: the resolved RL config, the model config, seed, execution timing note."""
    return {"rl": config_to_dict(config), "model": config_to_dict(model_config_of(config)), "name": config.name,
            "seed": seed, "timing": TIMING, "torch_threads": torch.get_num_threads()}
