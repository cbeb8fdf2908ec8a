"""GRPO and PPO policy losses as functions L = F(λ, ξ) over semantic positions (DESIGN §5).

Inputs are per-semantic-position tensors of equal length S in one order (the original batch
order, or any subset of it): λ = `logprobs_S` (current policy, with grad, e.g. from
`compact_logprobs`) and ξ = advantages, loss mask, old/ref log-probs and trajectory ids (see
`harts.objective.targets` for moving target-indexed step data onto these positions). Nothing
here knows about compact rows: with compact log-probs the loss and its gradient w.r.t. λ are
exactly those of the per-trajectory computation, because F only sees λ.

Per token (ratio r = exp(λ − λ_old), λ_old = old log-probs, or λ detached when on-policy so that
r = 1 and ∂r/∂λ = 1):
    ℓ = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high))                      (clipped surrogate)
PPO's optional dual clip (Ye et al. 2020) bounds the loss of negative-advantage tokens:
    ℓ = min(ℓ, −A·c) where A < 0, c = `dual_clip_ratio` > 1.
GRPO's optional KL penalty uses the k3 estimator of KL(π‖π_ref) (Schulman, "Approximating KL
divergence"; DeepSeekMath eq. 4), non-negative and unbiased for samples drawn from π:
    ℓ += β·(exp(λ_ref − λ) − (λ_ref − λ) − 1).

Aggregation over positions with mask = 1:
- "token-mean" (default): Σ ℓ / N_tokens, N_tokens = masked tokens of the whole step. Every
  token weighs the same (DAPO's token-level loss; no length bias), and since the normaliser is a
  step constant, microbatch losses with the step's N_tokens add up to the step's loss.
- "seq-mean-token-mean": mean over a trajectory's masked tokens, then Σ over trajectories /
  N_seqs, N_seqs = trajectories of the step with at least one masked token (DeepSeekMath's
  1/G Σ_i 1/|o_i| Σ_t). Needs `trajectory_index_S`, and whole trajectories per call.
`normalizer` passes the step-level N (default: counted from the given positions, right when the
call sees the whole step). With N = 0 the loss is 0 (still attached to the graph).

GRPO = this surrogate with group-normalised advantages (`harts.trees.step.grpo_advantages`)
and the k3 penalty (DeepSeekMath; DAPO: ε_high = 0.28, β = 0, token-mean). PPO = the same
surrogate with per-token advantages given (GAE with a value model is computed upstream and out
of scope here) and the optional dual clip.

`LossConfig` picks one of the two (the `loss` section of harts train's and harts rl's configs);
`step_kl(step, logprobs_S)` is the mean k3 KL over a step's loss positions (their step records' `kl`).

Reference: hand-computed values in the tests, and equality of the loss and its gradients with
compact vs naive log-probs on random trees.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from harts.objective.targets import semantic_targets_from_step

AGGREGATIONS = ("token-mean", "seq-mean-token-mean")
LOSSES = ("grpo", "ppo")


def _check_aggregation(aggregation: str) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")


@dataclass(kw_only=True)
class GRPOConfig:
    """GRPO policy loss (DeepSeekMath/DAPO sense, per-token clipping)."""

    clip_ratio_low: float = 0.2
    """ε_low: the ratio is clipped below at 1 − ε_low."""
    clip_ratio_high: float = 0.2
    """ε_high: the ratio is clipped above at 1 + ε_high (DAPO's clip-higher uses 0.28)."""
    kl_coef: float = 0.0
    """β of the k3 KL penalty against the reference policy (0 = no penalty, no ref needed)."""
    aggregation: str = "token-mean"
    """"token-mean" or "seq-mean-token-mean" (module docstring)."""

    def __post_init__(self) -> None:
        _check_aggregation(self.aggregation)
        if not (0 <= self.clip_ratio_low < 1 and self.clip_ratio_high >= 0 and self.kl_coef >= 0):
            raise ValueError(
                f"GRPOConfig: need 0 <= clip_ratio_low < 1, clip_ratio_high >= 0, kl_coef >= 0, got {self}"
            )


@dataclass(kw_only=True)
class PPOConfig:
    """PPO clipped-surrogate policy loss with given per-token advantages."""

    clip_ratio_low: float = 0.2
    """ε_low: the ratio is clipped below at 1 − ε_low."""
    clip_ratio_high: float = 0.2
    """ε_high: the ratio is clipped above at 1 + ε_high."""
    dual_clip_ratio: float | None = None
    """c > 1: the loss of a negative-advantage token is at most −A·c (None = no dual clip)."""
    aggregation: str = "token-mean"
    """"token-mean" or "seq-mean-token-mean" (module docstring)."""

    def __post_init__(self) -> None:
        _check_aggregation(self.aggregation)
        if not (0 <= self.clip_ratio_low < 1 and self.clip_ratio_high >= 0):
            raise ValueError(f"PPOConfig: need 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, got {self}")
        if self.dual_clip_ratio is not None and self.dual_clip_ratio <= 1:
            raise ValueError(f"PPOConfig: dual_clip_ratio must be > 1, got {self.dual_clip_ratio}")


@dataclass(kw_only=True)
class LossConfig:
    """The policy loss: `name` picks which of the two sections is used."""

    name: str = "grpo"
    """"grpo" or "ppo"."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)

    def __post_init__(self) -> None:
        if self.name not in LOSSES:
            raise ValueError(f"loss.name must be one of {LOSSES}, got {self.name!r}")


@dataclass(frozen=True, eq=False)
class PolicyLoss:
    """A policy loss and its diagnostics (diagnostics detached, over masked positions)."""

    loss: torch.Tensor
    """Scalar, differentiable w.r.t. the log-probs."""
    per_token_loss: torch.Tensor
    """[S] ℓ_s before aggregation (differentiable); a masked-out position's is computed at ratio 1."""
    clip_fraction: torch.Tensor
    """Fraction of masked positions where the clipped term is the active one."""
    kl: torch.Tensor | None
    """Mean k3 KL estimate over masked positions, when reference log-probs were given."""


def aggregate(
    per_token_loss_S: torch.Tensor,
    loss_mask_S: torch.Tensor,
    *,
    aggregation: str,
    trajectory_index_S: torch.Tensor | None = None,
    normalizer: float | None = None,
) -> torch.Tensor:
    """Reduce per-position losses to a scalar ("token-mean" / "seq-mean-token-mean", see module)."""
    _check_aggregation(aggregation)
    masked = torch.where(loss_mask_S.bool(), per_token_loss_S, 0.0)
    if aggregation == "token-mean":
        count = float(loss_mask_S.sum()) if normalizer is None else float(normalizer)
        return masked.sum() / max(count, 1.0)
    if trajectory_index_S is None:
        raise ValueError("aggregation 'seq-mean-token-mean' needs trajectory_index_S")
    if trajectory_index_S.shape != per_token_loss_S.shape:
        raise ValueError(
            f"trajectory_index_S has shape {tuple(trajectory_index_S.shape)}, expected "
            f"{tuple(per_token_loss_S.shape)}"
        )
    num_ids = int(trajectory_index_S.max()) + 1 if trajectory_index_S.numel() else 0
    sums = masked.new_zeros(num_ids).index_add_(0, trajectory_index_S, masked)
    counts = masked.new_zeros(num_ids).index_add_(0, trajectory_index_S, loss_mask_S.to(masked.dtype))
    per_sequence = sums / counts.clamp(min=1.0)
    num_sequences = float((counts > 0).sum()) if normalizer is None else float(normalizer)
    return per_sequence.sum() / max(num_sequences, 1.0)


def _check_lengths(logprobs_S: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    if logprobs_S.dim() != 1:
        raise ValueError(f"logprobs_S must be 1-D, got shape {tuple(logprobs_S.shape)}")
    for name, tensor in tensors.items():
        if tensor is not None and tensor.shape != logprobs_S.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(logprobs_S.shape)}")


def _clipped_surrogate(
    logprobs_S: torch.Tensor,
    old_logprobs_S: torch.Tensor | None,
    advantages_S: torch.Tensor,
    loss_mask_S: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    old = logprobs_S.detach() if old_logprobs_S is None else old_logprobs_S.to(logprobs_S.dtype)
    # Masked-out positions get ratio 1: an infinite ratio there (padding log-probs) would turn
    # the zero gradient of the masked loss into 0·inf = NaN.
    ratio = torch.exp(torch.where(loss_mask_S.bool(), logprobs_S - old, 0.0))
    advantages = advantages_S.to(logprobs_S.dtype)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _masked_mean(values: torch.Tensor, loss_mask_S: torch.Tensor) -> torch.Tensor:
    mask = loss_mask_S.bool()
    total = torch.where(mask, values.detach().to(torch.float32), 0.0).sum()
    return total / mask.sum().clamp(min=1)


def k3_kl(logprobs_S: torch.Tensor, ref_logprobs_S: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π‖π_ref): exp(λ_ref − λ) − (λ_ref − λ) − 1 (≥ 0)."""
    delta = ref_logprobs_S.to(logprobs_S.dtype) - logprobs_S
    return torch.exp(delta) - delta - 1.0


def step_kl(step, logprobs_S: torch.Tensor | None) -> float | None:
    """Mean k3 KL(π‖π_ref) over the step's loss positions (None without reference log-probs or
    when it is not finite: a diagnostic of harts train and harts rl, the loss check covers a KL term
    that enters the loss)."""
    if step.ref_logprobs is None:
        return None
    targets = semantic_targets_from_step(step)
    mask = torch.from_numpy(targets.loss_mask)
    if not bool(mask.any()):
        return 0.0
    kl = float(k3_kl(logprobs_S[mask], torch.from_numpy(targets.ref_logprobs)[mask]).mean())
    return kl if math.isfinite(kl) else None


def grpo_loss(
    logprobs_S: torch.Tensor,
    *,
    advantages_S: torch.Tensor,
    loss_mask_S: torch.Tensor,
    config: GRPOConfig,
    old_logprobs_S: torch.Tensor | None = None,
    ref_logprobs_S: torch.Tensor | None = None,
    trajectory_index_S: torch.Tensor | None = None,
    normalizer: float | None = None,
) -> PolicyLoss:
    """GRPO loss of the current log-probs λ (grad) given ξ; all tensors [S], one order."""
    _check_lengths(
        logprobs_S, advantages_S=advantages_S, loss_mask_S=loss_mask_S, old_logprobs_S=old_logprobs_S,
        ref_logprobs_S=ref_logprobs_S,
    )
    if config.kl_coef > 0 and ref_logprobs_S is None:
        raise ValueError("grpo_loss: kl_coef > 0 needs ref_logprobs_S")
    per_token, is_clipped = _clipped_surrogate(
        logprobs_S, old_logprobs_S, advantages_S, loss_mask_S, config.clip_ratio_low, config.clip_ratio_high
    )
    kl = None
    if ref_logprobs_S is not None:
        ref = torch.where(loss_mask_S.bool(), ref_logprobs_S.to(logprobs_S.dtype), logprobs_S.detach())
        kl_S = k3_kl(logprobs_S, ref)
        if config.kl_coef > 0:
            per_token = per_token + config.kl_coef * kl_S
        kl = _masked_mean(kl_S, loss_mask_S)
    loss = aggregate(
        per_token, loss_mask_S, aggregation=config.aggregation, trajectory_index_S=trajectory_index_S,
        normalizer=normalizer,
    )
    return PolicyLoss(
        loss=loss, per_token_loss=per_token, clip_fraction=_masked_mean(is_clipped, loss_mask_S), kl=kl
    )


def ppo_loss(
    logprobs_S: torch.Tensor,
    *,
    advantages_S: torch.Tensor,
    loss_mask_S: torch.Tensor,
    config: PPOConfig,
    old_logprobs_S: torch.Tensor | None = None,
    trajectory_index_S: torch.Tensor | None = None,
    normalizer: float | None = None,
) -> PolicyLoss:
    """PPO clipped-surrogate loss (per-token advantages given, e.g. GAE computed upstream)."""
    _check_lengths(
        logprobs_S, advantages_S=advantages_S, loss_mask_S=loss_mask_S, old_logprobs_S=old_logprobs_S
    )
    per_token, is_clipped = _clipped_surrogate(
        logprobs_S, old_logprobs_S, advantages_S, loss_mask_S, config.clip_ratio_low, config.clip_ratio_high
    )
    if config.dual_clip_ratio is not None:
        advantages = advantages_S.to(per_token.dtype)
        per_token = torch.where(
            advantages < 0, torch.minimum(per_token, -advantages * config.dual_clip_ratio), per_token
        )
    loss = aggregate(
        per_token, loss_mask_S, aggregation=config.aggregation, trajectory_index_S=trajectory_index_S,
        normalizer=normalizer,
    )
    return PolicyLoss(
        loss=loss, per_token_loss=per_token, clip_fraction=_masked_mean(is_clipped, loss_mask_S), kl=None
    )
