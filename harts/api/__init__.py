"""HARTS on an RL trainer's batch: log-probs, entropy and the GRPO/PPO loss of a padded, packed or
listed batch of trajectories, with every shared prefix computed once.

An RL framework (verl, OpenRLHF, AReaL, slime, ...) hands its actor a batch of trajectories in its
own layout. `padded_batch`, `packed_batch` and `trajectory_batch` (harts.api.batches) turn such a batch into a HARTS
step (`harts.trees.step.Step`) and remember the way back; `logprobs(model, batch)` and
`policy_loss(model, batch)` run a `HybridModel` over the step's compact rows (DESIGN §4: the trie of
the batch, so identical prefixes, such as a prompt shared by a GRPO group, are computed once) and
return every per-token output in the batch's own layout and shape. Both also take the raw batch (a
mapping or a list) and convert it. Nothing here knows about layers: the model runs through
`harts.engine.Engine` (its microbatch grain: `forward_microbatch`, `balance_counts`) exactly as `harts train-step`
runs it; each call builds the engine of its model and config.

Layouts (per-token fields are indexed by the token they describe: the value at position t belongs
to token t *as a target*, predicted from the tokens before it, DESIGN §5):

- padded (`padded_batch`): a mapping of `input_ids` int [B, L] and `attention_mask` [B, L] (0/1
  or bool), whose 1s must form one contiguous run per row: left padding (OpenRLHF's `sequences`,
  and any prompt-only left padding), right padding, or both (verl: a left-padded prompt followed
  by a right-padded response). `padding_side` ("left"/"right") is optional and then checked;
  by default it is read off the mask. Padding tokens are never read. Optional per-token fields,
  each [B, L], or [B, R] with R < L meaning the LAST R columns (verl's `responses`-shaped tensors,
  OpenRLHF's `action_mask`-shaped ones): `loss_mask` (or verl's name `response_mask`; 0/1, 1 only
  on real tokens, never on a row's first real token), `old_log_probs`, `ref_log_probs` (or verl's
  `ref_log_prob`), and `advantages` ([B, L], [B, R], or [B] or [B, 1]: one per sequence). Every field
  given as [B, R] has the same R (one response width), and log-probs are in [-1e4, 0] where the loss mask is 1.
- packed (`packed_batch`): `input_ids` int [T] and `cu_seqlens` int [B + 1] (sequence b is
  `input_ids[cu_seqlens[b]:cu_seqlens[b + 1]]`, no padding), per-token fields [T] (`advantages`
  [T], or [B] or [B, 1]). Frameworks that align log-probs with the *predicting* position instead
  (labels = roll(input_ids, -1), as AReaL's actor does) shift by one within each sequence: HARTS's
  value at t is theirs at t − 1.
- a list of trajectories (`trajectory_batch`): mappings with `input_ids` int [n] and the same
  per-token fields [n] (`advantages` [n] or a number).

Outputs, in the batch's layout ([B, L] padded, [T] packed, a list of [n] tensors): `log_probs`
at position t is log p(token t | the sequence's tokens before t) under softmax(logits / T) (T =
`temperature`), `entropy` at t is the entropy of that same distribution (the one that predicts
token t), and both are 0 where nothing is predicted: padding and each sequence's first real token
(`mask` is True exactly where a prediction exists). This is verl's alignment: its response-shaped
log-probs and entropy ([B, R]) are `out.log_probs[:, -R:]` and `out.entropy[:, -R:]`.
Values that a loss mask of 0 excludes (advantages, old and reference log-probs there) are never
read, so padding may hold anything; where the loss mask is 1 they must be finite.

The loss (`policy_loss`) is `harts.objective.losses` GRPO or PPO with the config's
hyper-parameters (`StepConfig.loss`, `.grpo`, `.ppo`) over the loss-masked tokens, normalised over
this batch (token-mean: masked tokens; token-sum: 1; the seq-mean modes: sequences with a masked
token), with an entropy bonus when `entropy_coef` > 0 (its entropies come from the same pass; verl's
and TRL's readings: docs/losses.md); `loss` adds the MoE losses (q-weighted, DESIGN §4), `policy_loss`
and `moe_loss` are its parts (`pooled_balance=True` returns transformers' pooled load-balancing loss of the
batch, `pooled_balance_loss`, for a trainer that adds it itself: TRL's router aux loss; the config's
`pooled_balance_coeff` adds it to `moe_loss`, ÷ `num_microbatches`).
Without `old_log_probs` the step is on-policy (ratio 1); GRPO's KL term
needs `ref_log_probs`. `policy_loss` and `logprobs` run the batch as one microbatch (its whole trie in one
forward; `capacity` refuses one over that many rows). A mini-batch larger than a microbatch: `plan(batch,
capacity, dp)` splits it with the HARTS planner (DESIGN §2: GRPO groups stay whole where they fit, cuts fall
where the least sharing is lost) and `policy_step(model, plan)` runs it as ONE step: gradient accumulation over
the planned microbatches, every loss part normalised over the whole batch (the policy loss's and the entropy
bonus's denominators, and the MoE losses through `harts.model.moe.step_share`), so that the microbatches' losses
and gradients add up to the batch's run as one microbatch; with the config's `pooled_balance_coeff`, each
microbatch's pooled load-balancing loss ÷ the plan's microbatches is added besides, as `run_step` and the parallel
step add it (it is a loss per microbatch, not one of the batch). (A trainer that splits the step itself may instead
call `policy_loss` per micro-batch with `normalizer`, the step's count, and `num_microbatches`: the MoE losses are
then a mean over micro-batches, as in `harts.objective.step.run_step`.) The model may be wrapped:
DistributedDataParallel (called for the forward, so that it reduces the gradients), FSDP2's `fully_shard` (keep
the LM head in the root's group: it is applied outside the model's forward) or torch.compile.

Invariant (tests/test_api.py): for left, right and two-sided padding, GRPO groups sharing prompts
and batches without sharing, the outputs equal those of each sequence run alone through the model
(fp32 CPU, ≤ 1e-5), with temperature and entropy, and the loss and every parameter gradient equal
the per-trajectory ones; a planned step's loss, MoE losses and gradients equal the whole batch's as one
microbatch (groups whole or split, D = 1 and 2). tests/test_api_pooled_step.py: a planned step's pooled load-balancing
loss against `policy_loss` per microbatch. Legend: B sequences, L padded length, R response columns, T packed
tokens, S semantic tokens (real tokens of all sequences), C compact rows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from harts.api.batches import RLBatch, as_batch, packed_batch, padded_batch, trajectory_batch
from harts.config.execution import DEVICES, ExecutionConfig
from harts.engine import Engine, MicrobatchOutputs, OverCapacity
from harts.model.model import HybridModel, unwrap_model
from harts.model.moe import pooled_load_balancing_loss, step_share
from harts.objective.losses import PolicyLoss
from harts.objective.step import (
    StepConfig, aggregation_normalizer, check_pooled_balance, loss_config_of, policy_loss_of, step_config,
    step_normalizer,
)
from harts.objective.targets import SemanticTargets, semantic_targets_from_step
from harts.planning import Plan
from harts.planning import plan as plan_microbatches
from harts.planning import validate as validate_plan
from harts.trees.trie import PrefixIndex

__all__ = [
    "BatchLoss", "BatchPlan", "RLBatch", "StepLoss", "TokenOutputs", "as_batch", "default_config", "device_config",
    "logprobs", "packed_batch", "padded_batch", "plan", "policy_loss", "policy_step", "trajectory_batch",
]


@dataclass(frozen=True, eq=False)
class TokenOutputs:
    """Per-token outputs in the batch's layout (module docstring: alignment)."""

    log_probs: torch.Tensor | list[torch.Tensor]
    """fp32: log p(token t | tokens before t) at temperature T; 0 where `mask` is False."""
    entropy: torch.Tensor | list[torch.Tensor] | None
    """fp32: the entropy of the distribution that predicts token t (when asked for)."""
    mask: torch.Tensor | list[torch.Tensor]
    """bool: where a prediction exists (a real token that is not its sequence's first)."""
    num_rows: int
    """Rows the model computed: C compact rows (S for the baseline execution)."""
    num_tokens: int
    """S: real tokens of the batch."""


@dataclass(frozen=True, eq=False)
class BatchLoss(TokenOutputs):
    """The policy loss of a batch, with its per-token outputs."""

    loss: torch.Tensor
    """Scalar to back-propagate: policy_loss + moe_loss."""
    policy_loss: torch.Tensor
    """The GRPO/PPO loss (`harts.objective.losses`)."""
    moe_loss: torch.Tensor
    """The model's MoE auxiliary losses (q-weighted over compact rows), and with the config's `pooled_balance_coeff`
    c, c × `pooled_balance_loss`; divided by `num_microbatches`."""
    clip_fraction: torch.Tensor
    """Fraction of loss-masked tokens whose clipped surrogate term is active."""
    kl: torch.Tensor | None
    """Mean KL estimate (the config's `kl_estimator`, k3 by default) over loss-masked tokens (GRPO with reference
    log-probs)."""
    pooled_balance_loss: torch.Tensor | None = None
    """With `pooled_balance` or the config's `pooled_balance_coeff`: transformers' load-balancing loss of the batch
    (`harts.model.moe.pooled_load_balancing_loss`: every MoE layer's router statistics pooled over the batch's real
    tokens, each token once per sequence), without coefficient nor ÷ `num_microbatches` (in `loss` only through the
    coefficient)."""


# ---------------------------------------------------------------------------------------------
# Model execution


def default_config(model: torch.nn.Module) -> StepConfig:
    """`device_config` of the model's device (CPU defaults for a device other than CUDA)."""
    device = next(model.parameters()).device.type
    return device_config(device if device in DEVICES else "cpu")


def device_config(device: str) -> StepConfig:
    """The compact execution with the backends `harts train-step` picks for `device` (sdpa and the PyTorch KDA on
    CPU, varlen attention and fla's KDA on CUDA), GRPO with default settings."""
    # No autocast: the model computes in its parameters' dtype.
    return step_config(ExecutionConfig(dtype="fp32"), device, execution="compact")


def _model(model: torch.nn.Module) -> HybridModel:
    inner = unwrap_model(model)
    if not isinstance(inner, HybridModel):
        raise ValueError(f"expected a HybridModel or a wrapper of one (DistributedDataParallel, fully_shard, "
                         f"torch.compile), got {type(model).__name__}")
    return inner


def _check_vocabulary(model: torch.nn.Module, batch: RLBatch) -> None:
    vocab = _model(model).config.vocab_size
    too_large = np.flatnonzero(batch.step.tokens >= vocab)
    if len(too_large):
        k = int(too_large[0])
        raise ValueError(f"{batch.step.source}: field 'input_ids': token {int(batch.step.tokens[k])} at "
                         f"{batch.locate(k)} is outside the model's vocabulary [0, {vocab})")


def _index(batch: RLBatch, config: StepConfig) -> PrefixIndex | None:
    return PrefixIndex.from_step(batch.step) if config.execution == "compact" else None


def _forward(engine: Engine, batch: RLBatch, members: np.ndarray, index: PrefixIndex | None,
             targets: SemanticTargets, temperature: float, entropy: bool,
             capacity: int | None = None) -> MicrobatchOutputs:
    """The model over the sequences `members` of the batch, one microbatch (a batch over `capacity` rows refused)."""
    try:
        return engine.forward_microbatch(batch.step, members, targets.targets, index=index, temperature=temperature,
                                         return_entropy=entropy, capacity=capacity)
    except OverCapacity as error:
        raise ValueError(f"{error}: plan the batch into microbatches (harts.api.plan) and run them with "
                         "harts.api.policy_step") from None


def _run(model: torch.nn.Module, batch: RLBatch, config: StepConfig, temperature: float, entropy: bool,
         capacity: int | None) -> tuple[MicrobatchOutputs, SemanticTargets]:
    """The whole batch as one microbatch."""
    _check_vocabulary(model, batch)
    targets = semantic_targets_from_step(batch.step)
    members = np.arange(batch.num_sequences)
    return _forward(Engine(model, config), batch, members, _index(batch, config), targets, temperature, entropy,
                    capacity), targets


def _outputs(batch: RLBatch, logprobs_S: torch.Tensor, entropy_S: torch.Tensor | None, num_rows: int) -> dict:
    return dict(
        log_probs=batch.to_layout(batch.targets_from_predictions(logprobs_S)),
        entropy=None if entropy_S is None else batch.to_layout(batch.targets_from_predictions(entropy_S)),
        mask=batch.prediction_mask(),
        num_rows=num_rows,
        num_tokens=batch.step.num_semantic_tokens,
    )


def _check_capacity_argument(capacity: int | None, caller: str) -> None:
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
        raise ValueError(f"{caller}: capacity must be an integer >= 1 or None, got {capacity!r}")


def logprobs(
    model: torch.nn.Module,
    batch: BatchPlan | RLBatch | Mapping[str, Any] | Sequence[Mapping[str, Any]],
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    config: StepConfig | None = None,
    capacity: int | None = None,
) -> TokenOutputs:
    """Per-token log-probs (and entropy) of `batch` under `model`, in the batch's layout.

    Args:
        model: the policy (or reference) HybridModel, or a wrapper of it (module docstring); its parameters'
            device is where it runs.
        batch: an RLBatch, or a padded/packed mapping or list of trajectories (`as_batch`): run as one
            microbatch; or a `BatchPlan` (`plan`): its microbatches run one after another (every replica's).
        temperature: T > 0: log-probs and entropy of softmax(logits / T).
        entropy: also return the entropy of every predicting distribution.
        config: execution (compact or baseline), recompute, dtype and backends; default
            `default_config(model)`.
        capacity: the most rows one microbatch may have: a batch over it is refused (plan it instead).

    Returns:
        TokenOutputs on the model's device, differentiable w.r.t. the model's parameters unless
        called under `torch.no_grad()` (as for old or reference log-probs).
    """
    _check_capacity_argument(capacity, "logprobs")
    config = config or default_config(model)
    if isinstance(batch, BatchPlan):
        plan = batch
        _check_plan_execution(plan, config)
        batch = plan.batch
        _check_vocabulary(model, batch)
        targets = semantic_targets_from_step(batch.step)
        index = _index(batch, config)
        engine = Engine(model, config)
        device = engine.device
        logprobs_S = torch.zeros(batch.step.num_semantic_tokens, device=device)
        entropy_S = torch.zeros_like(logprobs_S) if entropy else None
        num_rows = 0
        for members in plan.microbatches:
            if not len(members):
                continue
            part = _forward(engine, batch, members, index, targets, temperature, entropy)
            sem = torch.from_numpy(part.semantic_index).to(device)
            logprobs_S = logprobs_S.index_put((sem,), part.logprobs_S)
            if entropy:
                entropy_S = entropy_S.index_put((sem,), part.entropy_S)
            num_rows += part.num_rows
        return TokenOutputs(**_outputs(batch, logprobs_S, entropy_S, num_rows))
    batch = as_batch(batch)
    part, _ = _run(model, batch, config, temperature, entropy, capacity)
    return TokenOutputs(**_outputs(batch, part.logprobs_S, part.entropy_S, part.num_rows))


def _check_policy_inputs(batch: RLBatch, config: StepConfig) -> None:
    if not batch.has_loss_mask:
        raise ValueError(f"{batch.step.source}: policy_loss needs a loss mask (field 'loss_mask' or 'response_mask')")
    if not batch.has_advantages:
        raise ValueError(f"{batch.step.source}: policy_loss needs field 'advantages'")
    if config.loss == "grpo" and config.grpo.kl_coef > 0 and batch.step.ref_logprobs is None:
        raise ValueError(f"{batch.step.source}: GRPO with kl_coef > 0 needs field 'ref_log_probs'")


def _policy(part: MicrobatchOutputs, targets: SemanticTargets, config: StepConfig, normalizer: float,
            entropy_normalizer: float | None) -> PolicyLoss:
    """The policy loss of a microbatch's positions with the given normalisers."""
    device = part.logprobs_S.device
    sem = part.semantic_index

    def pick(array):
        return None if array is None else torch.from_numpy(array[sem]).to(device)

    return policy_loss_of(
        part.logprobs_S, config, advantages_S=pick(targets.advantages), loss_mask_S=pick(targets.loss_mask),
        old_logprobs_S=pick(targets.old_logprobs), ref_logprobs_S=pick(targets.ref_logprobs),
        trajectory_index_S=pick(targets.trajectory_index), normalizer=normalizer,
        entropy_S=part.entropy_S if loss_config_of(config).entropy_coef > 0 else None,
        entropy_normalizer=entropy_normalizer,
    )


def policy_loss(
    model: torch.nn.Module,
    batch: RLBatch | Mapping[str, Any] | Sequence[Mapping[str, Any]],
    *,
    config: StepConfig | None = None,
    temperature: float = 1.0,
    entropy: bool = False,
    normalizer: float | None = None,
    num_microbatches: int | None = None,
    entropy_normalizer: float | None = None,
    capacity: int | None = None,
    pooled_balance: bool = False,
) -> BatchLoss:
    """The GRPO/PPO loss of `batch` (needs a loss mask and advantages) run as one microbatch, its MoE losses and
    per-token outputs; `result.loss.backward()` accumulates the parameters' gradients. A batch larger than one
    microbatch: `plan` and `policy_step`.

    Args:
        model, batch, temperature, entropy, capacity: as for `logprobs`.
        config: `loss` ("grpo"/"ppo") with its `grpo`/`ppo` hyper-parameters, and the execution
            settings; default `default_config(model)` (GRPO, clip 0.2/0.2, no KL, token-mean).
        normalizer: the aggregation's denominator (masked tokens, or sequences for
            seq-mean-token-mean) of the whole step when `batch` is one micro-batch of it; default:
            this batch's own count.
        num_microbatches: with `normalizer`, how many micro-batches the step has: the MoE losses are
            divided by it (their mean over the step's micro-batches, as `run_step` takes it; `policy_step`
            normalises them as one step instead).
        entropy_normalizer: with an entropy bonus whose `entropy_aggregation` is not the loss's, the step's
            denominator of that aggregation (default: this batch's own count); otherwise `normalizer` serves.
        pooled_balance: also return transformers' load-balancing loss of the batch (`pooled_balance_loss`: what a
            transformers MoE model's `aux_loss` is under the batch's attention mask); needs softmax routing whose
            layers report their statistics (`moe.balance_statistics` or `aux_loss_coeff` > 0). The config's
            `pooled_balance_coeff` c > 0 returns it too and adds c × it ÷ `num_microbatches` to `moe_loss` (a model
            that cannot give it is refused before the forward, `harts.objective.step.check_pooled_balance`).
    """
    if (normalizer is None) != (num_microbatches is None):
        raise ValueError("policy_loss: give normalizer and num_microbatches together (a micro-batch of a step: the "
                         "policy loss is normalised over the step, the MoE losses averaged over its micro-batches) "
                         "or neither (the batch is the whole step)")
    if num_microbatches is not None and (isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int)
                                         or num_microbatches < 1):
        raise ValueError(f"policy_loss: num_microbatches must be an integer >= 1, got {num_microbatches!r}")
    for name, value in (("normalizer", normalizer), ("entropy_normalizer", entropy_normalizer)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"policy_loss: {name} must be a finite count > 0, got {value!r}")
    _check_capacity_argument(capacity, "policy_loss")
    if pooled_balance and _model(model).config.moe.score_function != "softmax":
        raise ValueError(f"policy_loss: pooled_balance reads transformers' softmax load-balancing loss; the model "
                         f"routes with {_model(model).config.moe.score_function} scores")
    batch = as_batch(batch)
    config = config or default_config(model)
    check_pooled_balance(_model(model).config, config, "policy_loss")
    _check_policy_inputs(batch, config)
    loss_config = loss_config_of(config)
    part, targets = _run(model, batch, config, temperature, entropy or loss_config.entropy_coef > 0, capacity)
    policy = _policy(
        part, targets, config,
        normalizer=step_normalizer(targets, config) if normalizer is None else float(normalizer),
        entropy_normalizer=(
            float(entropy_normalizer) if entropy_normalizer is not None
            else None if normalizer is not None and loss_config.entropy_aggregation in (None, loss_config.aggregation)
            else aggregation_normalizer(loss_config.aggregation_of_entropy, targets)
        ),
    )
    pooled = pooled_load_balancing_loss(part.auxes) if pooled_balance or config.pooled_balance_coeff > 0 else None
    moe = part.moe_loss if config.pooled_balance_coeff == 0 else part.moe_loss + config.pooled_balance_coeff * pooled
    moe = moe / (num_microbatches or 1)
    return BatchLoss(
        **_outputs(batch, part.logprobs_S, part.entropy_S if entropy else None, part.num_rows),
        loss=policy.loss + moe, policy_loss=policy.loss, moe_loss=moe, clip_fraction=policy.clip_fraction,
        kl=policy.kl, pooled_balance_loss=pooled,
    )


# ---------------------------------------------------------------------------------------------
# Planned microbatches: a whole mini-batch as one step


PLAN_WORK_MODELS = {"compact": "compact", "baseline": "semantic"}
"""The plan's work model that bounds each execution's rows (compact rows, or every token)."""


@dataclass(frozen=True, eq=False)
class BatchPlan:
    """A batch split into microbatches by a HARTS planner (DESIGN §2), each at most `capacity` rows."""

    batch: RLBatch
    microbatches: tuple[np.ndarray, ...]
    """int64 sequence indices of each microbatch (ascending), K of them in (slot, replica) order: microbatch k
    runs on replica k mod D. A sequence is in exactly one; one is empty only when the batch has fewer than D
    sequences."""
    num_rows: tuple[int, ...]
    """Rows of each microbatch under the plan's work model (compact rows: its trie's size)."""
    plan: Plan
    """The planner's record (slots, replicas, planning time; `harts.planning.plan_metrics` reads it)."""

    @property
    def capacity(self) -> int:
        return self.plan.capacity

    @property
    def dp(self) -> int:
        return self.plan.dp

    def of_replica(self, rank: int) -> list[np.ndarray]:
        """The microbatches replica `rank` runs, in slot order."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.dp:
            raise ValueError(f"rank must be an integer in [0, {self.dp}) (the plan's D), got {rank!r}")
        return [m for k, m in enumerate(self.microbatches) if k % self.dp == rank]


def plan(
    batch: RLBatch | Mapping[str, Any] | Sequence[Mapping[str, Any]],
    capacity: int,
    dp: int = 1,
    *,
    planner: str = "harts",
) -> BatchPlan:
    """The batch's sequences in microbatches of at most `capacity` rows each, for `dp` data-parallel replicas.

    The HARTS planner cuts the batch's trie where the least sharing is lost: a GRPO group (sequences sharing a
    prompt) stays in one microbatch wherever it fits, and sequences of different groups share a microbatch when
    the planner finds that best. A sequence longer than `capacity` is a ValueError (never split). `planner`: one
    of `harts.planning.PLANNER_NAMES` ("per-trajectory" bounds every token, for the baseline execution).
    """
    _check_capacity_argument(capacity, "plan")
    if capacity is None:
        raise ValueError("plan: capacity must be an integer >= 1, got None")
    batch = as_batch(batch)
    step = batch.step
    index = PrefixIndex.from_step(step)
    planned = plan_microbatches(step, capacity, dp, planner, index=index)
    validate_plan(planned, step, index)
    microbatches = tuple(np.sort(members) for members in planned.members(step))
    return BatchPlan(batch=batch, microbatches=microbatches, num_rows=tuple(mb.work for mb in planned.microbatches),
                     plan=planned)


def _check_plan_execution(plan: BatchPlan, config: StepConfig) -> None:
    if PLAN_WORK_MODELS[config.execution] != plan.plan.work_model:
        raise ValueError(f"the plan bounds {plan.plan.work_model} rows but the {config.execution} execution runs "
                         f"{PLAN_WORK_MODELS[config.execution]} rows: plan with planner "
                         f"{'harts' if config.execution == 'compact' else 'per-trajectory'!r}")


@dataclass(frozen=True, eq=False)
class StepLoss(TokenOutputs):
    """A mini-batch step's losses (detached: the gradients are already accumulated) and per-token outputs.

    With D > 1 the values are this replica's shares (the replicas' add up to the batch's) and the per-token
    outputs hold this replica's sequences (zero elsewhere, `mask` False there); `num_rows` and `num_tokens`
    count this replica's."""

    loss: torch.Tensor
    """policy_loss + moe_loss."""
    policy_loss: torch.Tensor
    moe_loss: torch.Tensor
    """The MoE losses of the batch's rows as one step (`harts.model.moe.step_share`), and with the config's
    `pooled_balance_coeff` c, c × `pooled_balance_loss`."""
    clip_fraction: torch.Tensor
    """Over the loss-masked tokens."""
    kl: torch.Tensor | None
    """Mean KL estimate over the loss-masked tokens (GRPO with reference log-probs)."""
    num_microbatches: int
    """Microbatches this replica ran."""
    pooled_balance_loss: torch.Tensor | None = None
    """With the config's `pooled_balance_coeff`: the sum over this replica's microbatches of each one's transformers'
    load-balancing loss ÷ the plan's (non-empty) microbatches K, without the coefficient; the replicas' add up to the
    mean over the step's microbatches."""


def _averages_gradients(model: torch.nn.Module) -> bool:
    """Whether the wrapper reduces gradients as a mean over its replicas (DDP, FSDP2)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, (DistributedDataParallel, FSDPModule))


def _gradient_sync(model: torch.nn.Module, last: bool):
    """Reduce gradients only after a replica's last microbatch (DDP's no_sync, FSDP2's requires_gradient_sync)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel) and not last:
        return model.no_sync()
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(last)
    return nullcontext()


def _balance_counts(engine: Engine, batch: RLBatch, microbatches: list[np.ndarray], index: PrefixIndex | None,
                    dp: int, group) -> list[torch.Tensor]:
    """Per MoE layer, the load-balancing assignments of the whole step: a forward without gradients of each
    of this replica's microbatches (`Engine.balance_counts`: its routing is the training forward's), summed, and
    over the replicas with D > 1 (a replica without sequences, fewer than D, still joins the sum)."""
    counts = engine.balance_counts(batch.step, microbatches, index=index)
    if dp > 1:
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(f"policy_step: the load-balancing loss of a step over D = {dp} replicas needs the step's "
                             "expert counts of every replica: initialise torch.distributed (the replicas' group)")
        for tensor in counts:
            dist.all_reduce(tensor, group=group)
    return counts


def policy_step(
    model: torch.nn.Module,
    plan: BatchPlan,
    *,
    config: StepConfig | None = None,
    temperature: float = 1.0,
    entropy: bool = False,
    rank: int = 0,
    backward: bool = True,
    group=None,
) -> StepLoss:
    """Forward and backward of a planned mini-batch as ONE step: gradient accumulation over replica `rank`'s
    microbatches, every loss part normalised over the whole batch, so the microbatches' losses and gradients
    add up to those of the whole batch run as one microbatch.

    - Policy loss: the aggregation's denominator (masked tokens, or sequences) and the entropy bonus's are
      the batch's counts, not a microbatch's.
    - MoE losses: each microbatch adds its share of the batch's (`harts.model.moe.step_share`): its z-loss
      numerator over the batch's tokens, and its load-balancing probability mass times the batch's expert
      counts. Those counts come from the routing of every microbatch, so with a load-balancing loss and more
      than one microbatch a forward without gradients of each microbatch runs first (one forward more), and
      with D > 1 the counts are summed over the replicas through torch.distributed (`group`, default WORLD).
    - Pooled load-balancing loss (the config's `pooled_balance_coeff` c > 0): each microbatch adds c × its own
      transformers' load-balancing loss (`harts.model.moe.pooled_load_balancing_loss`) ÷ K, the plan's non-empty
      microbatches over all replicas, as `harts.objective.step.run_step` and the parallel step do (TRL's router aux
      loss over its accumulation steps); a model that cannot give it is refused before any forward.
    - Data parallelism: each replica holds the whole batch and runs its own microbatches (`BatchPlan.of_replica`);
      the replicas' gradients add up to the batch's. A DistributedDataParallel or FSDP2 model averages its
      replicas' gradients, so for such a model the step back-propagates D times its share, and reduces only
      after its last microbatch.

    Args:
        model: a HybridModel or a wrapper of it (module docstring).
        plan: `plan(batch, capacity, dp)`; every microbatch has at most `plan.capacity` rows.
        config, temperature, entropy: as for `policy_loss`.
        rank: this replica (0 <= rank < D).
        backward: False runs the forwards only (no gradients).

    Returns:
        StepLoss: detached values and per-token outputs in the batch's layout.
    """
    if not isinstance(plan, BatchPlan):
        raise ValueError(f"policy_step: expected a BatchPlan (harts.api.plan(batch, capacity)), got "
                         f"{type(plan).__name__}")
    config = config or default_config(model)
    _check_plan_execution(plan, config)
    check_pooled_balance(_model(model).config, config, "policy_step")
    batch = plan.batch
    _check_policy_inputs(batch, config)
    _check_vocabulary(model, batch)
    microbatches = [m for m in plan.of_replica(rank) if len(m)]
    averaging = _averages_gradients(model)
    if averaging and len(microbatches) != len(plan.of_replica(rank)):
        raise ValueError(f"policy_step: the plan gives replica {rank} an empty microbatch (fewer sequences than "
                         f"D = {plan.dp}); a {type(model).__name__} needs every replica to run as many")
    step = batch.step
    targets = semantic_targets_from_step(step)
    loss_config = loss_config_of(config)
    normalizer = step_normalizer(targets, config)
    entropy_normalizer = aggregation_normalizer(loss_config.aggregation_of_entropy, targets)
    index = _index(batch, config)
    engine = Engine(model, config)
    device = engine.device
    moe_config = _model(model).config.moe
    num_tokens = float(step.num_semantic_tokens)
    num_microbatches = sum(1 for m in plan.microbatches if len(m))
    counts = None
    if moe_config.aux_loss_coeff > 0 and num_microbatches > 1:
        counts = _balance_counts(engine, batch, microbatches, index, plan.dp, group)
    # DDP and FSDP2 average the replicas' gradients; the step's are their sum.
    scale = float(plan.dp) if averaging else 1.0
    logprobs_S = torch.zeros(step.num_semantic_tokens)
    entropy_S = torch.zeros(step.num_semantic_tokens) if entropy else None
    mine = np.zeros(step.num_semantic_tokens, dtype=bool)
    total_policy = total_moe = total_pooled = clipped = kl_sum = masked = 0.0
    has_kl = False
    num_rows = 0
    for j, members in enumerate(microbatches):
        with torch.set_grad_enabled(backward), _gradient_sync(model, last=j == len(microbatches) - 1):
            part = _forward(engine, batch, members, index, targets, temperature,
                            entropy or loss_config.entropy_coef > 0)
            assert part.num_rows <= plan.capacity, (part.num_rows, plan.capacity)  # the planner bounded it
            policy = _policy(part, targets, config, normalizer, entropy_normalizer)
            moe = sum((step_share(aux, moe_config, step_tokens=num_tokens,
                                  step_balance_counts_E=aux.balance_counts_E if counts is None else counts[layer])
                       for layer, aux in enumerate(part.auxes)), policy.loss.new_zeros(()))
            if config.pooled_balance_coeff > 0:
                pooled = pooled_load_balancing_loss(part.auxes) / num_microbatches
                total_pooled += float(pooled.detach())
                moe = moe + config.pooled_balance_coeff * pooled
            if backward:
                ((policy.loss + moe) * scale).backward()
        total_policy += float(policy.loss.detach())
        total_moe += float(moe.detach())
        count = float(targets.loss_mask[part.semantic_index].sum())
        masked += count
        clipped += float(policy.clip_fraction) * count
        if policy.kl is not None:
            has_kl, kl_sum = True, kl_sum + float(policy.kl) * count
        sem = torch.from_numpy(part.semantic_index)
        logprobs_S[sem] = part.logprobs_S.detach().float().cpu()
        if entropy:
            entropy_S[sem] = part.entropy_S.detach().float().cpu()
        mine[part.semantic_index] = True
        num_rows += part.num_rows
    outputs = _outputs(batch, logprobs_S.to(device), None if entropy_S is None else entropy_S.to(device), num_rows)
    outputs.update(mask=batch.prediction_mask(mine).to(device) if batch.kind != "trajectories"
                   else [m.to(device) for m in batch.prediction_mask(mine)], num_tokens=int(mine.sum()))
    return StepLoss(
        **outputs, loss=torch.tensor(total_policy + total_moe), policy_loss=torch.tensor(total_policy),
        moe_loss=torch.tensor(total_moe), clip_fraction=torch.tensor(clipped / max(masked, 1.0)),
        kl=torch.tensor(kl_sum / max(masked, 1.0)) if has_kl else None, num_microbatches=len(microbatches),
        pooled_balance_loss=torch.tensor(total_pooled) if config.pooled_balance_coeff > 0 else None,
    )
