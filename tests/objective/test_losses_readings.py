"""verl's and TRL's policy losses read by HARTS's `grpo_loss`/`ppo_loss` (docs/losses.md): for every reading, the
loss and its gradients w.r.t. the log-probs (and the entropies) equal

- a transcription of the library's formula written here, in our own words (always run, so CI checks the math
  without the libraries): verl 0.9.1 `verl/trainer/ppo/core_algos.py` (`agg_loss`,
  `compute_policy_loss_vanilla`, `compute_policy_loss_cispo`, `compute_policy_loss_sapo`, `kl_penalty`,
  `kl_penalty_forward`) combined as `verl/workers/utils/losses.py::ppo_loss` does, and TRL 1.16.0
  `trl/trainer/grpo_trainer.py` (`GRPOTrainer._compute_loss`, `GRPOTrainer.get_gamma_weights`);
- the library's own function on the same tensors, where the library imports (skipped otherwise, with the
  reason): verl's `ppo_loss` with an `ActorConfig` and a TensorDict batch, TRL's `GRPOTrainer._compute_loss` on a
  stand-in trainer whose `_get_per_token_logps_and_entropies` returns the test's tensors.

The batch is far off-policy (log-ratios ~ N(0, 1) and two of ±25, reference log-ratios ~ N(0, 4): every clip, the
dual clip and verl's clamps are active), fp64, B = 6 sequences of up to R = 9 response tokens, one of them with no
masked token (where verl's and TRL's sequence counts differ). `python -m tests.objective.test_losses_readings`
prints the table of differences.
"""

from __future__ import annotations

import math
import types
from collections import defaultdict
from dataclasses import dataclass, field

import pytest
import torch

from harts.objective.losses import GRPOConfig, PPOConfig, grpo_loss, ppo_loss

B, R = 6, 9
MAX_COMPLETION_LENGTH = 16
"""TRL's dr_grpo constant, other than R so that a mix-up of the two shows."""
GLOBAL_TOKENS = 101
"""A global-batch token count (verl's `batch_num_tokens`, TRL's `num_items_in_batch`) larger than the batch's."""
GLOBAL_SEQUENCES = 11
"""A global batch size (verl's `global_batch_size`)."""


@dataclass
class Batch:
    """Response-shaped [B, R] tensors, fp64."""

    logprobs: torch.Tensor
    old: torch.Tensor
    ref: torch.Tensor
    advantages: torch.Tensor
    """[B, R] (constant along a row unless per-token)."""
    entropy: torch.Tensor
    mask: torch.Tensor
    """bool [B, R]: a prefix of each row (row 3 empty)."""


def make_batch(seed: int = 42, per_token_advantages: bool = False) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([9, 4, 7, 0, 1, 6])
    mask = torch.arange(R)[None, :] < lengths[:, None]
    logprobs = -3 * torch.rand(B, R, generator=generator, dtype=torch.float64)
    old = logprobs + torch.randn(B, R, generator=generator, dtype=torch.float64)
    # Two log-ratios beyond verl's clamp at ±20, on rows of positive advantage (row 0's tiny ratio keeps the
    # unclipped term active, so the clamp shows in the gradient).
    old[0, 2], old[1, 1] = logprobs[0, 2] + 25, logprobs[1, 1] - 25
    ref = logprobs + 2 * torch.randn(B, R, generator=generator, dtype=torch.float64)
    if per_token_advantages:
        advantages = torch.randn(B, R, generator=generator, dtype=torch.float64)
    else:
        advantages = torch.randn(B, 1, generator=generator, dtype=torch.float64).expand(B, R).clone()
    advantages[:2] = advantages[:2].abs()
    entropy = 2 * torch.rand(B, R, generator=generator, dtype=torch.float64)
    return Batch(logprobs, old, ref, advantages, entropy, mask)


@dataclass
class Reading:
    """One library setting and HARTS's reading of it."""

    library: str
    """"verl" or "trl"."""
    settings: dict
    """verl: ActorConfig fields (policy_loss.loss_mode as `loss_mode`; batch_num_tokens/global_batch_size as in
    the TensorDict); TRL: GRPOConfig (trainer) fields plus `num_items_in_batch`."""
    harts: GRPOConfig | PPOConfig
    normalizer: float | None = None
    """HARTS's `normalizer` (None: counted from the batch)."""
    entropy_normalizer: float | None = None
    per_token_advantages: bool = False
    tolerance: float = 1e-12
    """Max abs difference allowed in the loss and each gradient, relative to the largest of 1 and the reference's
    values: fp64 round-off unless a reading says why not."""
    uses_entropy: bool = field(init=False)

    def __post_init__(self) -> None:
        self.uses_entropy = self.harts.entropy_coef > 0


VERL_DEFAULT = dict(dual_clip_ratio=3.0, log_ratio_clamp=20.0)
"""verl's vanilla loss always applies its dual clip (clip_ratio_c = 3) and clamps λ − λ_old to ±20."""
TRL_KL = dict(kl_estimator="k3", kl_importance_weighted=True)
"""TRL's KL term: k3, multiplied by the importance ratio (use_bias_correction_kl=True, its default)."""
TRL_SAPO = 5e-8
"""TRL builds SAPO's temperatures with torch.where on Python floats, so 1.05 is a float32 value (2e-8 off);
HARTS keeps them in the log-probs' dtype (measured: 1.5e-8 here)."""
NUM_ROWS = float(B)
"""TRL's grpo/sapo/dr_grpo/luspo divide by the batch's rows, fully masked ones included."""

READINGS = {
    # verl: ActorConfig defaults, then one setting changed at a time.
    "verl-default": Reading("verl", {}, GRPOConfig(**VERL_DEFAULT)),
    "verl-clip-higher-c5": Reading("verl", dict(clip_ratio_high=0.28, clip_ratio_c=5.0),
                                   GRPOConfig(clip_ratio_high=0.28, dual_clip_ratio=5.0, log_ratio_clamp=20.0)),
    "verl-token-sum": Reading("verl", dict(loss_agg_mode="token-sum"),
                              GRPOConfig(aggregation="token-sum", **VERL_DEFAULT)),
    "verl-seq-mean-token-sum": Reading("verl", dict(loss_agg_mode="seq-mean-token-sum"),
                                       GRPOConfig(aggregation="seq-mean-token-sum", **VERL_DEFAULT)),
    "verl-seq-mean-token-mean": Reading("verl", dict(loss_agg_mode="seq-mean-token-mean"),
                                        GRPOConfig(aggregation="seq-mean-token-mean", **VERL_DEFAULT)),
    "verl-seq-mean-token-sum-norm-width": Reading(
        "verl", dict(loss_agg_mode="seq-mean-token-sum-norm"),
        GRPOConfig(aggregation="seq-mean-token-sum-norm", loss_scale_factor=R, **VERL_DEFAULT)),
    "verl-seq-mean-token-sum-norm-512": Reading(
        "verl", dict(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=512),
        GRPOConfig(aggregation="seq-mean-token-sum-norm", loss_scale_factor=512, **VERL_DEFAULT)),
    "verl-global-tokens": Reading("verl", dict(batch_num_tokens=GLOBAL_TOKENS), GRPOConfig(**VERL_DEFAULT),
                                  normalizer=GLOBAL_TOKENS),
    "verl-global-sequences": Reading(
        "verl", dict(loss_agg_mode="seq-mean-token-mean", global_batch_size=GLOBAL_SEQUENCES),
        GRPOConfig(aggregation="seq-mean-token-mean", **VERL_DEFAULT), normalizer=GLOBAL_SEQUENCES),
    **{
        f"verl-kl-{verl_name}": Reading(
            "verl", dict(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type=verl_name, loss_agg_mode=aggregation),
            GRPOConfig(kl_coef=0.1, kl_estimator=harts_name, aggregation=aggregation, **VERL_DEFAULT))
        for verl_name, harts_name, aggregation in [
            ("low_var_kl", "low_var_kl", "token-mean"), ("k3", "low_var_kl", "seq-mean-token-mean"),
            ("kl", "k1", "token-mean"), ("abs", "abs", "seq-mean-token-sum"), ("mse", "k2", "token-mean"),
            ("k3+", "low_var_kl+", "token-mean"), ("kl+", "k1+", "seq-mean-token-mean"), ("abs+", "abs+", "token-mean"),
        ]
    },
    "verl-entropy": Reading("verl", dict(entropy_coeff=0.01), GRPOConfig(entropy_coef=0.01, **VERL_DEFAULT)),
    "verl-entropy-kl-seq-mean": Reading(
        "verl", dict(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.001, loss_agg_mode="seq-mean-token-mean"),
        GRPOConfig(entropy_coef=0.01, kl_coef=0.001, kl_estimator="low_var_kl", aggregation="seq-mean-token-mean",
                   **VERL_DEFAULT)),
    "verl-cispo": Reading("verl", dict(loss_mode="cispo"), GRPOConfig(surrogate="cispo", log_ratio_clamp=20.0)),
    "verl-sapo": Reading("verl", dict(loss_mode="sapo"),
                         GRPOConfig(surrogate="sapo", aggregation="seq-mean-token-mean", log_ratio_clamp=20.0)),
    "verl-ppo-gae": Reading("verl", dict(entropy_coeff=0.01),
                            PPOConfig(entropy_coef=0.01, **VERL_DEFAULT), per_token_advantages=True),
    # TRL: GRPOConfig (trainer) defaults (loss_type dapo, epsilon 0.2, beta 0), then one setting changed at a time.
    "trl-dapo": Reading("trl", {}, GRPOConfig()),
    "trl-dapo-global-tokens": Reading("trl", dict(num_items_in_batch=GLOBAL_TOKENS), GRPOConfig(),
                                      normalizer=GLOBAL_TOKENS),
    "trl-dapo-epsilon-high": Reading("trl", dict(epsilon_high=0.28), GRPOConfig(clip_ratio_high=0.28)),
    "trl-grpo": Reading("trl", dict(loss_type="grpo"), GRPOConfig(aggregation="seq-mean-token-mean"),
                        normalizer=NUM_ROWS),
    "trl-dr_grpo": Reading("trl", dict(loss_type="dr_grpo"),
                           GRPOConfig(aggregation="seq-mean-token-sum-norm", loss_scale_factor=MAX_COMPLETION_LENGTH),
                           normalizer=NUM_ROWS),
    "trl-bnpo": Reading("trl", dict(loss_type="bnpo"), GRPOConfig()),
    "trl-cispo": Reading("trl", dict(loss_type="cispo", epsilon_high=5.0),
                         GRPOConfig(surrogate="cispo", clip_ratio_low=1.0, clip_ratio_high=4.0)),
    "trl-sapo": Reading("trl", dict(loss_type="sapo"), GRPOConfig(surrogate="sapo", aggregation="seq-mean-token-mean"),
                        normalizer=NUM_ROWS, tolerance=TRL_SAPO),
    "trl-luspo": Reading("trl", dict(loss_type="luspo", importance_sampling_level="sequence"),
                         GRPOConfig(aggregation="seq-mean-token-sum", importance_sampling_level="sequence"),
                         normalizer=NUM_ROWS),
    "trl-vespo": Reading("trl", dict(loss_type="vespo"), GRPOConfig(surrogate="vespo")),
    "trl-gspo": Reading("trl", dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04),
                        GRPOConfig(aggregation="seq-mean-token-mean", importance_sampling_level="sequence",
                                   kl_coef=0.04, **TRL_KL), normalizer=NUM_ROWS),
    "trl-delta": Reading("trl", dict(delta=1.5), GRPOConfig(ratio_cap=1.5)),
    "trl-beta": Reading("trl", dict(beta=0.04), GRPOConfig(kl_coef=0.04, **TRL_KL)),
    "trl-beta-no-bias-correction": Reading("trl", dict(beta=0.04, use_bias_correction_kl=False),
                                           GRPOConfig(kl_coef=0.04)),
    "trl-entropy-grpo": Reading("trl", dict(loss_type="grpo", entropy_coef=0.01),
                                GRPOConfig(aggregation="seq-mean-token-mean", entropy_coef=0.01,
                                           entropy_aggregation="token-mean"), normalizer=NUM_ROWS),
    "trl-entropy-dapo": Reading("trl", dict(entropy_coef=0.01), GRPOConfig(entropy_coef=0.01)),
}


# ---------------------------------------------------------------------------------------------------------------
# HARTS


def harts_loss(reading: Reading, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(loss, ∂loss/∂λ [B, R], ∂loss/∂H [B, R] or None) of HARTS's reading on the batch, flattened by rows."""
    logprobs = batch.logprobs.clone().requires_grad_()
    entropy = batch.entropy.clone().requires_grad_() if reading.uses_entropy else None
    common = dict(
        advantages_S=batch.advantages.reshape(-1), loss_mask_S=batch.mask.reshape(-1),
        old_logprobs_S=batch.old.reshape(-1), trajectory_index_S=torch.arange(B).repeat_interleave(R),
        normalizer=reading.normalizer, entropy_normalizer=reading.entropy_normalizer,
        entropy_S=None if entropy is None else entropy.reshape(-1),
    )
    if isinstance(reading.harts, PPOConfig):
        out = ppo_loss(logprobs.reshape(-1), config=reading.harts, **common)
    else:
        out = grpo_loss(logprobs.reshape(-1), config=reading.harts, ref_logprobs_S=batch.ref.reshape(-1), **common)
    out.loss.backward()
    return out.loss.detach(), logprobs.grad, None if entropy is None else entropy.grad


# ---------------------------------------------------------------------------------------------------------------
# Transcriptions. verl 0.9.1: verl/trainer/ppo/core_algos.py and verl/workers/utils/losses.py::ppo_loss.


def verl_agg(values, mask, mode, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None):
    """core_algos.agg_loss with dp_size 1 (masked_sum zeroes values outside the mask first)."""
    m = mask.to(values.dtype)
    kept = torch.where(mask, values, 0.0) * m
    if mode == "token-mean":
        return kept.sum() / (m.sum() if batch_num_tokens is None else batch_num_tokens)
    if mode == "token-sum":
        return kept.sum()
    rows_with_tokens = (m.sum(-1) > 0).to(values.dtype)
    sequences = rows_with_tokens.sum() if global_batch_size is None else global_batch_size
    if mode == "seq-mean-token-mean":
        # verl adds 1e-8 to the count of a bool mask: an integer tensor, so the sum is float32 and the 1e-8 vanishes.
        per_row = kept.sum(-1) / (mask.sum(-1) + 1e-8)
    else:
        per_row = kept.sum(-1)
    loss = (torch.where(rows_with_tokens.bool(), per_row, 0.0) * rows_with_tokens).sum() / sequences
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (values.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


def verl_kl(logprobs, ref, kind):
    """core_algos.kl_penalty: the estimator's value; with '+', the gradient of k2 (straight-through)."""
    base = kind.removesuffix("+")
    if base in ("kl", "k1"):
        value = logprobs - ref
    elif base == "abs":
        value = (logprobs - ref).abs()
    elif base in ("mse", "k2"):
        value = 0.5 * (logprobs - ref) ** 2
    else:  # low_var_kl / k3
        d = torch.clamp(ref - logprobs, -20, 20)
        value = torch.clamp(d.exp() - d - 1, -10, 10)
    if not kind.endswith("+"):
        return value
    k2 = 0.5 * (logprobs - ref) ** 2
    return value.detach() + (k2 - k2.detach())


def verl_transcription(settings: dict, logprobs, entropy, batch: Batch):
    get = settings.get
    clip_low, clip_high = get("clip_ratio_low", 0.2), get("clip_ratio_high", 0.2)
    agg = dict(batch_num_tokens=get("batch_num_tokens"), global_batch_size=get("global_batch_size"),
               loss_scale_factor=get("loss_scale_factor"))
    mode, mask, advantages = get("loss_agg_mode", "token-mean"), batch.mask, batch.advantages
    log_ratio = torch.clamp(logprobs - batch.old, -20.0, 20.0)
    ratio = log_ratio.exp()
    loss_mode = get("loss_mode", "vanilla")
    if loss_mode == "vanilla":
        surrogate = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip_low, 1 + clip_high))
        dual = torch.minimum(surrogate, -advantages * get("clip_ratio_c", 3.0))
        policy = verl_agg(torch.where(advantages < 0, dual, surrogate), mask, mode, **agg)
    elif loss_mode == "cispo":
        weight = ratio.clamp(1 - clip_low, 1 + clip_high).detach()
        policy = verl_agg(-weight * advantages * logprobs, mask, mode, **agg)
    else:  # sapo: aggregated seq-mean-token-mean whatever loss_agg_mode says
        tau = torch.where(advantages > 0, advantages.new_tensor(1.0), advantages.new_tensor(1.05))
        gate = torch.sigmoid(tau * (ratio - 1)) * (4 / tau)
        policy = verl_agg(-gate * advantages, mask, "seq-mean-token-mean", **agg)
    if entropy is not None:
        policy = policy - get("entropy_coeff", 0.0) * verl_agg(entropy, mask, mode, **agg)
    if get("use_kl_loss", False):
        kl = verl_kl(logprobs, batch.ref, get("kl_loss_type", "low_var_kl"))
        policy = policy + verl_agg(kl, mask, mode, **agg) * get("kl_loss_coef", 0.001)
    return policy


# TRL 1.16.0: trl/trainer/grpo_trainer.py, GRPOTrainer._compute_loss (one process, gradient accumulation 1,
# steps_per_generation 1, no vLLM, top_entropy_quantile 1, no off-policy mask).


def trl_transcription(settings: dict, logprobs, entropy, batch: Batch):
    get = settings.get
    loss_type = get("loss_type", "dapo")
    eps_low = get("epsilon", 0.2)
    eps_high = get("epsilon_high") if get("epsilon_high") is not None else eps_low
    beta, mask = get("beta", 0.0), batch.mask.to(torch.float64)
    advantages = batch.advantages[:, :1]  # TRL's advantages are one per sequence: (B,) unsqueezed to (B, 1)
    log_ratio = logprobs - batch.old
    if get("importance_sampling_level", "token") == "sequence":
        weights_log = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
    else:
        weights_log = log_ratio
    ratio = weights_log.exp()
    if beta != 0:
        kl = (batch.ref - logprobs).exp() - (batch.ref - logprobs) - 1
        if get("use_bias_correction_kl", True):
            kl = kl * ratio
    if loss_type == "cispo":
        per_token = -ratio.clamp(max=eps_high).detach() * advantages * logprobs
    elif loss_type == "sapo":
        # TRL builds the temperatures with torch.where on Python floats: float32 values.
        tau = torch.where(advantages > 0, 1.0, 1.05)
        per_token = -(torch.sigmoid(tau * (ratio - 1)) * 4 / tau) * advantages
    elif loss_type == "vespo":
        log_w = (log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True).clamp(math.log(1e-8), 20.0)
        k = torch.where(advantages >= 0, 2.0, 3.0)
        lam = torch.where(advantages >= 0, 3.0, 2.0).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).detach()
        per_token = -phi * advantages * logprobs
    else:
        capped = ratio if get("delta") is None else ratio.clamp(max=get("delta"))
        per_token = -torch.minimum(capped * advantages, ratio.clamp(1 - eps_low, 1 + eps_high) * advantages)
    if beta != 0:
        per_token = per_token + beta * kl
    masked = per_token * mask
    if loss_type in ("grpo", "sapo"):
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = masked.sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = masked.sum() / (logprobs.shape[0] * MAX_COMPLETION_LENGTH)
    elif loss_type == "luspo":
        loss = masked.sum(-1).mean()
    else:  # dapo, cispo, vespo
        loss = masked.sum() / max(get("num_items_in_batch", float(mask.sum())), 1.0)
    if entropy is not None:
        loss = loss - get("entropy_coef", 0.0) * (entropy * mask).sum() / mask.sum().clamp(min=1.0)
    return loss


def transcription_loss(reading: Reading, batch: Batch):
    logprobs = batch.logprobs.clone().requires_grad_()
    entropy = batch.entropy.clone().requires_grad_() if reading.uses_entropy else None
    function = verl_transcription if reading.library == "verl" else trl_transcription
    loss = function(reading.settings, logprobs, entropy, batch)
    loss.backward()
    return loss.detach(), logprobs.grad, None if entropy is None else entropy.grad


# ---------------------------------------------------------------------------------------------------------------
# The libraries' own functions.


def verl_library_loss(reading: Reading, batch: Batch):
    """verl's `ppo_loss` (the engine's actor loss) on a TensorDict of 2-token prompts and the batch's responses;
    the model's outputs are unpadded, one value per token, each response token's log-prob at the position
    before it (no_padding_2_padding's layout)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import ActorConfig, PolicyLossConfig
    from verl.workers.utils.losses import ppo_loss as verl_ppo_loss

    settings = dict(reading.settings)
    batch_num_tokens, global_batch_size = settings.pop("batch_num_tokens", None), settings.pop("global_batch_size",
                                                                                               None)
    loss_mode = settings.pop("loss_mode", "vanilla")
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                         policy_loss=PolicyLossConfig(loss_mode=loss_mode), **settings)
    logprobs = batch.logprobs.clone().requires_grad_()
    entropy = batch.entropy.clone().requires_grad_() if reading.uses_entropy else None
    prompt_length, lengths = 2, batch.mask.sum(-1)

    def unpadded(values):
        pieces = []
        for b in range(B):
            # Positions prompt_length - 1 ... predict the response tokens; the last position predicts nothing.
            filler = values.new_zeros(prompt_length - 1)
            pieces += [filler, values[b, :lengths[b]], values.new_zeros(1)]
        return torch.cat(pieces)

    attention = torch.cat([torch.ones(B, prompt_length, dtype=torch.int64), batch.mask.to(torch.int64)], dim=1)
    data = TensorDict({
        "prompts": torch.zeros(B, prompt_length, dtype=torch.int64), "responses": torch.zeros(B, R, dtype=torch.int64),
        "attention_mask": attention, "response_mask": batch.mask.to(torch.int64), "old_log_probs": batch.old,
        "advantages": batch.advantages, "ref_log_prob": batch.ref,
    }, batch_size=[B])
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size)
    outputs = {"log_probs": unpadded(logprobs)}
    if entropy is not None:
        outputs["entropy"] = unpadded(entropy)
    loss, _ = verl_ppo_loss(config, outputs, data)
    loss.backward()
    return loss.detach(), logprobs.grad, None if entropy is None else entropy.grad


def trl_library_loss(reading: Reading, batch: Batch):
    """TRL's `GRPOTrainer._compute_loss` on a stand-in trainer with the settings' values (TRL's defaults
    otherwise), one process, no gradient accumulation."""
    from trl import GRPOConfig as TRLConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    settings = dict(reading.settings)
    num_items = settings.pop("num_items_in_batch", None)
    args = TRLConfig(output_dir="/tmp/harts-trl-unused", max_completion_length=MAX_COMPLETION_LENGTH,
                     report_to="none", use_cpu=True, bf16=False, **settings)
    logprobs = batch.logprobs.clone().requires_grad_()
    entropy = batch.entropy.clone().requires_grad_() if reading.uses_entropy else None
    accelerator = types.SimpleNamespace(num_processes=1, sync_gradients=True, gather=lambda x: x,
                                        gather_for_metrics=lambda x: x, reduce=lambda x, reduction: x)
    trainer = types.SimpleNamespace(
        args=args, loss_type=args.loss_type, beta=args.beta, epsilon_low=args.epsilon,
        epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
        importance_sampling_level=args.importance_sampling_level, top_entropy_quantile=args.top_entropy_quantile,
        off_policy_mask_threshold=args.off_policy_mask_threshold, use_vllm=False,
        vllm_importance_sampling_correction=False, max_completion_length=args.max_completion_length,
        model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=1, accelerator=accelerator,
        _entropy_bonus_enabled=args.entropy_coef != 0, entropy_coef=args.entropy_coef, use_adaptive_entropy=False,
        aux_loss_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)),
        get_gamma_weights=GRPOTrainer.get_gamma_weights, get_off_policy_mask=GRPOTrainer.get_off_policy_mask,
        get_high_entropy_mask=None,
        _get_per_token_logps_and_entropies=lambda *a, **k: (logprobs, entropy if entropy is not None
                                                             else batch.entropy, None),
    )
    inputs = {
        "prompt_ids": torch.zeros(B, 2, dtype=torch.int64), "prompt_mask": torch.ones(B, 2, dtype=torch.int64),
        "completion_ids": torch.zeros(B, R, dtype=torch.int64), "completion_mask": batch.mask.to(torch.int64),
        "advantages": batch.advantages[:, 0], "old_per_token_logps": batch.old, "ref_per_token_logps": batch.ref,
        "num_items_in_batch": torch.tensor(float(batch.mask.sum() if num_items is None else num_items),
                                           dtype=torch.float64),
    }
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    loss.backward()
    return loss.detach(), logprobs.grad, None if entropy is None else entropy.grad


LIBRARY_LOSSES = {"verl": verl_library_loss, "trl": trl_library_loss}
LIBRARY_MODULES = {"verl": "verl.workers.utils.losses", "trl": "trl.trainer.grpo_trainer"}


def differences(got, expected) -> tuple[float, float, float]:
    """Max abs differences of (loss, ∂/∂λ, ∂/∂H)."""
    (loss, grad, grad_entropy), (loss_ref, grad_ref, grad_entropy_ref) = got, expected
    entropy = 0.0 if grad_entropy is None else float((grad_entropy - grad_entropy_ref).abs().max())
    return float((loss - loss_ref).abs()), float((grad - grad_ref).abs().max()), entropy


def _check(reading: Reading, got, expected) -> None:
    loss, grad, grad_entropy = got
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert float(grad.abs().max()) > 0 and (grad_entropy is None or float(grad_entropy.abs().max()) > 0)
    scale = max([1.0] + [float(t.abs().max()) for t in expected if t is not None])
    assert max(differences(got, expected)) <= reading.tolerance * scale, (differences(got, expected), scale)


@pytest.mark.parametrize("name", READINGS)
def test_reading_equals_the_transcription(name):
    reading = READINGS[name]
    batch = make_batch(per_token_advantages=reading.per_token_advantages)
    _check(reading, harts_loss(reading, batch), transcription_loss(reading, batch))


@pytest.mark.parametrize("name", READINGS)
def test_reading_equals_the_library(name):
    reading = READINGS[name]
    pytest.importorskip(LIBRARY_MODULES[reading.library],
                        reason=f"{reading.library} is not installed (the transcription test checks the formula)")
    batch = make_batch(per_token_advantages=reading.per_token_advantages)
    _check(reading, harts_loss(reading, batch), LIBRARY_LOSSES[reading.library](reading, batch))


def main() -> None:
    """The table of docs/losses.md: max abs differences of loss and gradients, HARTS vs each reference."""
    print("| reading | vs transcription (loss, dλ, dH) | vs library (loss, dλ, dH) |")
    print("| --- | --- | --- |")
    for name, reading in READINGS.items():
        batch = make_batch(per_token_advantages=reading.per_token_advantages)
        got = harts_loss(reading, batch)
        cells = [", ".join(f"{d:.1e}" for d in differences(got, transcription_loss(reading, batch)))]
        try:
            library = LIBRARY_LOSSES[reading.library](reading, batch)
            cells.append(", ".join(f"{d:.1e}" for d in differences(got, library)))
        except ImportError as error:
            cells.append(f"not run ({error.name} absent)")
        print(f"| {name} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
