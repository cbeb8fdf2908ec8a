"""GRPO and PPO policy losses as functions L = F(λ, ξ) over semantic positions (DESIGN §5), with the
readings of verl's and TRL's losses (docs/losses.md maps their config keys to these fields).

Inputs are per-semantic-position tensors of equal length S in one order (the original batch
order, or any subset of it): λ = `logprobs_S` (current policy, with grad, e.g. from
`compact_logprobs`) and ξ = advantages, loss mask, old/ref log-probs, trajectory ids and, for an
entropy bonus, the per-position entropies (see `harts.objective.targets` for moving target-indexed
step data onto these positions). Nothing here knows about compact rows: with compact log-probs the
loss and its gradient w.r.t. λ are exactly those of the per-trajectory computation, because F only
sees λ (and the entropies, functions of the same rows).

Importance ratio r = exp(ρ), ρ = λ − λ_old (λ_old = old log-probs, or λ detached when on-policy so
that r = 1 and ∂r/∂λ = 1), 0 where the mask is 0; `log_ratio_clamp` c clamps ρ to [−c, c] first
(verl clamps at 20). `importance_sampling_level` "sequence" (GSPO, TRL's reading) replaces ρ by its
mean over the trajectory's masked tokens, so that every token of a trajectory has its ratio and
the gradient flows to all of them. Per token, by `surrogate`:
- "clip" (default): ℓ = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high)), with r in the first term
  capped at δ = `ratio_cap` when set (TRL's `delta`, INTELLECT-2's two-sided clip), and the dual
  clip (Ye et al. 2020; verl's `clip_ratio_c`) ℓ = min(ℓ, −A·c) where A < 0, c = `dual_clip_ratio`.
- "cispo" (MiniMax-M1): ℓ = −sg(clip(r, 1 − ε_low, 1 + ε_high))·A·λ (ε_low = 1: no lower bound).
- "sapo": ℓ = −A·(4/τ)·σ(τ·(r − 1)), τ = τ_pos where A > 0 else τ_neg.
- "vespo": ℓ = −sg(φ)·A·λ, φ = exp(κ + k·log w − κ·w) of the trajectory's ratio w = exp(Σ_t ρ_t)
  (ρ_t clamped to ±20, log w to [log 1e-8, 20]); (k, κ) = the pos pair where A ≥ 0, else the neg
  pair (TRL's `get_gamma_weights`).
The KL penalty β·k(λ, λ_ref) uses `kl_estimator` (J. Schulman, "Approximating KL divergence"),
with δ = λ_ref − λ: "k1" −δ, "abs" |δ|, "k2" δ²/2, "k3" e^δ − δ − 1 (DeepSeekMath eq. 4; no clamp,
TRL's), "low_var_kl" the same with δ clamped to ±20 and the value to ±10 (verl's "k3"); a "+"
suffix keeps the value and takes the gradient of k2 (verl's straight-through); with
`kl_importance_weighted` the estimate is multiplied by r (TRL's `use_bias_correction_kl`).

Aggregation over positions with mask = 1, a sum divided by N (`normalizer`; default counted from
the given positions, right when the call sees the whole step; N = 0 gives 0 attached to the graph):
- "token-mean" (default): Σ ℓ / N, N = masked tokens (DAPO's token-level loss; TRL's dapo, bnpo).
- "token-sum": Σ ℓ / N, N = 1.
- "seq-mean-token-mean": Σ_trajectories (mean of its masked tokens' ℓ) / N, N = trajectories with
  at least one masked token (DeepSeekMath's 1/G Σ_i 1/|o_i| Σ_t; TRL's grpo, sapo).
- "seq-mean-token-sum": Σ_trajectories (Σ of its masked tokens' ℓ) / N, N as above (TRL's luspo).
- "seq-mean-token-sum-norm": the same divided by `loss_scale_factor` (Dr. GRPO: TRL's dr_grpo
  with max_completion_length; verl's default is the response tensor's width).
The sequence modes need `trajectory_index_S` and whole trajectories per call. Since every
normaliser is a step constant, microbatch losses with the step's N add up to the step's loss.
The entropy bonus subtracts `entropy_coef` times the entropies aggregated by
`entropy_aggregation` (default: `aggregation`, as verl; TRL uses "token-mean") from the loss.

GRPO = any of these with group-normalised advantages (`harts.trees.step.grpo_advantages`); PPO =
the clip surrogate with per-token advantages given (GAE with a value model is computed upstream and
out of scope here), the dual clip, the aggregations and the entropy bonus, without KL term.

`LossConfig` picks one of the two and holds the MoE loss's pooled load-balancing coefficient (the `loss` section of
harts train's and harts rl's configs);
`step_kl(step, logprobs_S)` is the mean k3 KL over a step's loss positions (their step records' `kl`).

Reference: hand-computed values in the tests, equality of the loss and its gradients with compact
vs naive log-probs on random trees, and, for each verl 0.9.1 and TRL 1.16.0 reading, equality
with the library's own loss function and with a transcription of its formula
(tests/objective/test_losses_readings.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from harts.objective.targets import semantic_targets_from_step

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm")
SURROGATES = ("clip", "cispo", "sapo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
KL_ESTIMATORS = tuple(f"{name}{suffix}" for suffix in ("", "+") for name in ("k1", "abs", "k2", "k3", "low_var_kl"))
SEQUENCE_AGGREGATIONS = ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
"""The aggregations that need trajectory ids."""
LOSSES = ("grpo", "ppo")


def _check_aggregation(aggregation: str) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")


def _finite(value: float | None) -> bool:
    return value is None or (not isinstance(value, bool) and math.isfinite(value))


@dataclass(kw_only=True)
class _PolicyLossConfig:
    """The fields GRPO and PPO share (module docstring)."""

    clip_ratio_low: float = 0.2
    """ε_low: the ratio is clipped below at 1 − ε_low."""
    clip_ratio_high: float = 0.2
    """ε_high: the ratio is clipped above at 1 + ε_high (DAPO's clip-higher uses 0.28)."""
    aggregation: str = "token-mean"
    """One of AGGREGATIONS (module docstring)."""
    dual_clip_ratio: float | None = None
    """c > 1: the loss of a negative-advantage token is at most −A·c (None = no dual clip; verl: 3)."""
    log_ratio_clamp: float | None = None
    """c > 0: λ − λ_old is clamped to [−c, c] before the exponential (None = no clamp; verl: 20)."""
    loss_scale_factor: float | None = None
    """The constant divisor of "seq-mean-token-sum-norm" (needed there, refused elsewhere)."""
    entropy_coef: float = 0.0
    """Coefficient of the entropy bonus (0 = none, no entropies needed)."""
    entropy_aggregation: str | None = None
    """How the entropy bonus is aggregated (one of AGGREGATIONS); None = `aggregation`."""

    def _check_shared(self) -> None:
        name = type(self).__name__
        _check_aggregation(self.aggregation)
        if self.entropy_aggregation is not None and self.entropy_aggregation not in AGGREGATIONS:
            raise ValueError(f"{name}: entropy_aggregation must be None or one of {AGGREGATIONS}, "
                             f"got {self.entropy_aggregation!r}")
        if self.dual_clip_ratio is not None and not (_finite(self.dual_clip_ratio) and self.dual_clip_ratio > 1):
            raise ValueError(f"{name}: dual_clip_ratio must be > 1, got {self.dual_clip_ratio}")
        if self.log_ratio_clamp is not None and not (_finite(self.log_ratio_clamp) and self.log_ratio_clamp > 0):
            raise ValueError(f"{name}: log_ratio_clamp must be None or a finite number > 0, got {self.log_ratio_clamp}")
        if not (_finite(self.entropy_coef) and self.entropy_coef >= 0):
            raise ValueError(f"{name}: entropy_coef must be a finite number >= 0, got {self.entropy_coef}")
        norm = "seq-mean-token-sum-norm"
        uses_norm = norm in (self.aggregation, self.entropy_aggregation)
        if uses_norm and not (self.loss_scale_factor is not None and _finite(self.loss_scale_factor)
                              and self.loss_scale_factor > 0):
            raise ValueError(f"{name}: aggregation {norm!r} needs loss_scale_factor > 0 (verl: the response length; "
                             f"TRL's dr_grpo: max_completion_length), got {self.loss_scale_factor}")
        if not uses_norm and self.loss_scale_factor is not None:
            raise ValueError(f"{name}: loss_scale_factor applies to aggregation {norm!r} only, got aggregation "
                             f"{self.aggregation!r}")

    @property
    def aggregation_of_entropy(self) -> str:
        return self.aggregation if self.entropy_aggregation is None else self.entropy_aggregation


@dataclass(kw_only=True)
class GRPOConfig(_PolicyLossConfig):
    """GRPO policy loss (DeepSeekMath/DAPO sense, per-token clipping), and verl's and TRL's readings of it."""

    kl_coef: float = 0.0
    """β of the KL penalty against the reference policy (0 = no penalty, no ref needed)."""
    kl_estimator: str = "k3"
    """One of KL_ESTIMATORS (module docstring); verl's default is "low_var_kl", TRL's "k3"."""
    kl_importance_weighted: bool = False
    """Multiply the KL estimate by the importance ratio r (TRL's `use_bias_correction_kl`, default there)."""
    surrogate: str = "clip"
    """One of SURROGATES (module docstring)."""
    ratio_cap: float | None = None
    """δ > 0 (clip surrogate): the unclipped term's ratio is capped at δ (TRL's `delta`; None = no cap)."""
    importance_sampling_level: str = "token"
    """"token" or "sequence" (GSPO: the trajectory's mean log-ratio for each of its tokens)."""
    sapo_tau_pos: float = 1.0
    """SAPO's temperature τ where A > 0."""
    sapo_tau_neg: float = 1.05
    """SAPO's temperature τ where A ≤ 0."""
    vespo_k_pos: float = 2.0
    """VESPO's exponent k where A ≥ 0."""
    vespo_lambda_pos: float = 3.0
    """VESPO's decay κ where A ≥ 0."""
    vespo_k_neg: float = 3.0
    """VESPO's exponent k where A < 0."""
    vespo_lambda_neg: float = 2.0
    """VESPO's decay κ where A < 0."""

    def __post_init__(self) -> None:
        _check_aggregation(self.aggregation)
        # cispo's lower bound 1 − ε_low may be 0 (TRL's cispo has none); the clip surrogate's may not.
        low_ok = 0 <= self.clip_ratio_low < 1 or (self.surrogate == "cispo" and self.clip_ratio_low == 1)
        if not low_ok:
            raise ValueError(f"GRPOConfig: need 0 <= clip_ratio_low < 1 (<= 1 with surrogate 'cispo'), "
                             f"got clip_ratio_low {self.clip_ratio_low}")
        for name in ("clip_ratio_high", "kl_coef"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"GRPOConfig: need {name} >= 0, got {getattr(self, name)}")
        self._check_shared()
        if self.surrogate not in SURROGATES:
            raise ValueError(f"GRPOConfig: surrogate must be one of {SURROGATES}, got {self.surrogate!r}")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(f"GRPOConfig: importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, "
                             f"got {self.importance_sampling_level!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"GRPOConfig: kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if not isinstance(self.kl_importance_weighted, bool):
            raise ValueError(f"GRPOConfig: kl_importance_weighted must be true or false, "
                             f"got {self.kl_importance_weighted!r}")
        if self.ratio_cap is not None and not (_finite(self.ratio_cap) and self.ratio_cap > 0):
            raise ValueError(f"GRPOConfig: ratio_cap must be None or a finite number > 0, got {self.ratio_cap}")
        for option in ("dual_clip_ratio", "ratio_cap"):
            if getattr(self, option) is not None and self.surrogate != "clip":
                raise ValueError(f"GRPOConfig: {option} applies to surrogate 'clip', not {self.surrogate!r}")
        if not (_finite(self.sapo_tau_pos) and _finite(self.sapo_tau_neg) and self.sapo_tau_pos > 0
                and self.sapo_tau_neg > 0):
            raise ValueError(f"GRPOConfig: sapo_tau_pos and sapo_tau_neg must be finite numbers > 0, got "
                             f"{self.sapo_tau_pos}, {self.sapo_tau_neg}")
        ks, lambdas = (self.vespo_k_pos, self.vespo_k_neg), (self.vespo_lambda_pos, self.vespo_lambda_neg)
        if not (all(_finite(k) and k >= 0 for k in ks) and all(_finite(x) and x >= 1e-4 for x in lambdas)):
            raise ValueError(f"GRPOConfig: vespo_k_* must be finite numbers >= 0 and vespo_lambda_* >= 1e-4 (TRL "
                             f"clamps below it), got k {ks}, lambda {lambdas}")


@dataclass(kw_only=True)
class PPOConfig(_PolicyLossConfig):
    """PPO clipped-surrogate policy loss with given per-token advantages."""

    def __post_init__(self) -> None:
        _check_aggregation(self.aggregation)
        if not 0 <= self.clip_ratio_low < 1:
            raise ValueError(f"PPOConfig: need 0 <= clip_ratio_low < 1, got clip_ratio_low {self.clip_ratio_low}")
        if not self.clip_ratio_high >= 0:
            raise ValueError(f"PPOConfig: need clip_ratio_high >= 0, got {self.clip_ratio_high}")
        self._check_shared()


def check_pooled_balance_coeff(coeff, name: str) -> None:
    """ValueError naming `name` unless `coeff` is a finite number >= 0 (a bool is not a number here)."""
    if isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or not (math.isfinite(coeff) and coeff >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {coeff!r}")


@dataclass(kw_only=True)
class LossConfig:
    """The step's loss: the policy loss (`name` picks which of the two sections is used) and the terms added to
    the MoE losses. Every field is the StepConfig field of the same name (`name`: `loss`; harts.objective.step.
    step_config copies them)."""

    name: str = "grpo"
    """"grpo" or "ppo"."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    pooled_balance_coeff: float = 0.0
    """Coefficient of transformers' pooled load-balancing loss of each microbatch, added ÷ the step's microbatches
    (TRL's router_aux_loss_coef; `StepConfig.pooled_balance_coeff`). 0: none."""

    def __post_init__(self) -> None:
        if self.name not in LOSSES:
            raise ValueError(f"loss.name must be one of {LOSSES}, got {self.name!r}")
        check_pooled_balance_coeff(self.pooled_balance_coeff, "loss.pooled_balance_coeff")


@dataclass(frozen=True, eq=False)
class PolicyLoss:
    """A policy loss and its diagnostics (diagnostics detached, over masked positions)."""

    loss: torch.Tensor
    """Scalar, differentiable w.r.t. the log-probs (and the entropies, with an entropy bonus)."""
    per_token_loss: torch.Tensor
    """[S] ℓ_s before aggregation (differentiable; without the entropy bonus); a masked-out position's is
    computed at ratio 1."""
    clip_fraction: torch.Tensor
    """Fraction of masked positions where the clipped term is the active one (cispo: where r is clipped)."""
    kl: torch.Tensor | None
    """Mean KL estimate (`kl_estimator`, unweighted) over masked positions, when reference log-probs were given."""
    entropy: torch.Tensor | None = None
    """Mean entropy over masked positions, when entropies were given."""


def aggregate(
    per_token_loss_S: torch.Tensor,
    loss_mask_S: torch.Tensor,
    *,
    aggregation: str,
    trajectory_index_S: torch.Tensor | None = None,
    normalizer: float | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce per-position losses to a scalar (one of AGGREGATIONS, see module)."""
    _check_aggregation(aggregation)
    masked = torch.where(loss_mask_S.bool(), per_token_loss_S, 0.0)
    if aggregation == "token-mean":
        count = float(loss_mask_S.sum()) if normalizer is None else float(normalizer)
        return masked.sum() / max(count, 1.0)
    if aggregation == "token-sum":
        return masked.sum() / max(1.0 if normalizer is None else float(normalizer), 1.0)
    if trajectory_index_S is None:
        raise ValueError(f"aggregation {aggregation!r} needs trajectory_index_S")
    if trajectory_index_S.shape != per_token_loss_S.shape:
        raise ValueError(
            f"trajectory_index_S has shape {tuple(trajectory_index_S.shape)}, expected "
            f"{tuple(per_token_loss_S.shape)}"
        )
    num_ids = int(trajectory_index_S.max()) + 1 if trajectory_index_S.numel() else 0
    sums = masked.new_zeros(num_ids).index_add_(0, trajectory_index_S, masked)
    counts = masked.new_zeros(num_ids).index_add_(0, trajectory_index_S, loss_mask_S.to(masked.dtype))
    per_sequence = sums / counts.clamp(min=1.0) if aggregation == "seq-mean-token-mean" else sums
    num_sequences = float((counts > 0).sum()) if normalizer is None else float(normalizer)
    loss = per_sequence.sum() / max(num_sequences, 1.0)
    if aggregation == "seq-mean-token-sum-norm":
        if loss_scale_factor is None:
            raise ValueError("aggregation 'seq-mean-token-sum-norm' needs loss_scale_factor")
        loss = loss / float(loss_scale_factor)
    return loss


def _check_lengths(logprobs_S: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    if logprobs_S.dim() != 1:
        raise ValueError(f"logprobs_S must be 1-D, got shape {tuple(logprobs_S.shape)}")
    for name, tensor in tensors.items():
        if tensor is not None and tensor.shape != logprobs_S.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(logprobs_S.shape)}")


def _log_ratio(
    logprobs_S: torch.Tensor, old_logprobs_S: torch.Tensor | None, loss_mask_S: torch.Tensor, clamp: float | None
) -> torch.Tensor:
    """ρ = λ − λ_old where the mask is 1, else 0, clamped to ±`clamp` when given."""
    old = logprobs_S.detach() if old_logprobs_S is None else old_logprobs_S.to(logprobs_S.dtype)
    # Masked-out positions get ratio 1: an infinite ratio there (padding log-probs) would turn
    # the zero gradient of the masked loss into 0·inf = NaN.
    log_ratio = torch.where(loss_mask_S.bool(), logprobs_S - old, 0.0)
    return log_ratio if clamp is None else log_ratio.clamp(-clamp, clamp)


def _per_sequence(values_S: torch.Tensor, loss_mask_S: torch.Tensor, trajectory_index_S: torch.Tensor,
                  mean: bool) -> torch.Tensor:
    """The sum (or mean) of each trajectory's masked values, at each of its positions."""
    num_ids = int(trajectory_index_S.max()) + 1 if trajectory_index_S.numel() else 0
    masked = torch.where(loss_mask_S.bool(), values_S, 0.0)
    sums = masked.new_zeros(num_ids).index_add_(0, trajectory_index_S, masked)
    if mean:
        counts = masked.new_zeros(num_ids).index_add_(0, trajectory_index_S, loss_mask_S.to(masked.dtype))
        sums = sums / counts.clamp(min=1.0)
    return sums[trajectory_index_S]


def _clip(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_ratio_low: float, clip_ratio_high: float,
    ratio_cap: float | None = None, dual_clip_ratio: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipped surrogate ℓ (capped and dual-clipped when asked) and where its clipped term is active."""
    unclipped = -advantages * (ratio if ratio_cap is None else ratio.clamp(max=ratio_cap))
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    if dual_clip_ratio is not None:
        per_token = torch.where(advantages < 0, torch.minimum(per_token, -advantages * dual_clip_ratio), per_token)
    return per_token, clipped > unclipped


def vespo_phi(log_w: torch.Tensor, advantages: torch.Tensor, config) -> torch.Tensor:
    """VESPO's φ(w) = exp(κ + k·log w − κ·w) of a sequence's log w = Σ_t clamp(ρ_t, ±20), clamped to
    [log 1e-8, 20]; (k, κ) the pos pair where A ≥ 0, else the neg (κ at least 1e-4, as TRL's
    `get_gamma_weights`). `config` holds vespo_k_pos/neg and vespo_lambda_pos/neg: a GRPOConfig or TRL's."""
    log_w = log_w.clamp(math.log(1e-8), 20.0)
    nonnegative = advantages >= 0
    k = torch.where(nonnegative, advantages.new_tensor(config.vespo_k_pos), advantages.new_tensor(config.vespo_k_neg))
    decay = torch.where(nonnegative, advantages.new_tensor(config.vespo_lambda_pos),
                        advantages.new_tensor(config.vespo_lambda_neg)).clamp(min=1e-4)
    phi = torch.exp(decay + k * log_w - decay * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _vespo_weights(
    log_ratio_S: torch.Tensor, advantages: torch.Tensor, loss_mask_S: torch.Tensor,
    trajectory_index_S: torch.Tensor, config: GRPOConfig,
) -> torch.Tensor:
    """VESPO's φ(w) (detached) at each position: w of its trajectory, (k, κ) of its advantage's sign."""
    log_w = _per_sequence(log_ratio_S.detach().clamp(-20.0, 20.0), loss_mask_S, trajectory_index_S, mean=False)
    return vespo_phi(log_w, advantages, config)


def _masked_mean(values: torch.Tensor, loss_mask_S: torch.Tensor) -> torch.Tensor:
    mask = loss_mask_S.bool()
    total = torch.where(mask, values.detach().to(torch.float32), 0.0).sum()
    return total / mask.sum().clamp(min=1)


def k3_kl(logprobs_S: torch.Tensor, ref_logprobs_S: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π‖π_ref): exp(λ_ref − λ) − (λ_ref − λ) − 1 (≥ 0)."""
    delta = ref_logprobs_S.to(logprobs_S.dtype) - logprobs_S
    return torch.exp(delta) - delta - 1.0


def kl_estimate(logprobs_S: torch.Tensor, ref_logprobs_S: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(π‖π_ref) by `estimator` (one of KL_ESTIMATORS, module docstring)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    base = estimator.removesuffix("+")
    ref = ref_logprobs_S.to(logprobs_S.dtype)
    if base == "k3":
        value = k3_kl(logprobs_S, ref)
    elif base == "k1":
        value = logprobs_S - ref
    elif base == "abs":
        value = (logprobs_S - ref).abs()
    elif base == "k2":
        value = 0.5 * (logprobs_S - ref).square()
    else:
        # verl's low_var_kl: k3 with the log-ratio and the value clamped for stability.
        delta = (ref - logprobs_S).clamp(-20.0, 20.0)
        value = (torch.exp(delta) - delta - 1.0).clamp(-10.0, 10.0)
    if base == estimator or base == "k2":
        return value
    # Straight-through: the value of the estimator, the gradient of k2 (unbiased for KL's gradient).
    k2 = 0.5 * (logprobs_S - ref).square()
    return k2 - k2.detach() + value.detach()


def _entropy_bonus(
    config: _PolicyLossConfig, loss_mask_S: torch.Tensor, entropy_S: torch.Tensor | None,
    trajectory_index_S: torch.Tensor | None, normalizer: float | None, entropy_normalizer: float | None,
    caller: str,
) -> torch.Tensor | None:
    """`entropy_coef` × the aggregated entropies, or None without a bonus."""
    if config.entropy_coef == 0:
        return None
    if entropy_S is None:
        raise ValueError(f"{caller}: entropy_coef > 0 needs entropy_S")
    if entropy_normalizer is None and config.entropy_aggregation in (None, config.aggregation):
        entropy_normalizer = normalizer
    return config.entropy_coef * aggregate(
        entropy_S, loss_mask_S, aggregation=config.aggregation_of_entropy, trajectory_index_S=trajectory_index_S,
        normalizer=entropy_normalizer, loss_scale_factor=config.loss_scale_factor,
    )


def _needs_trajectories(config: _PolicyLossConfig, trajectory_index_S: torch.Tensor | None, caller: str) -> None:
    needs = [f"aggregation {a!r}" for a in {config.aggregation, config.aggregation_of_entropy}
             if a in SEQUENCE_AGGREGATIONS]
    if isinstance(config, GRPOConfig):
        if config.importance_sampling_level == "sequence":
            needs.append("importance_sampling_level 'sequence'")
        if config.surrogate == "vespo":
            needs.append("surrogate 'vespo'")
    if needs and trajectory_index_S is None:
        raise ValueError(f"{caller}: {needs[0]} needs trajectory_index_S")


def _result(
    config: _PolicyLossConfig, per_token: torch.Tensor, is_clipped: torch.Tensor, kl: torch.Tensor | None,
    loss_mask_S: torch.Tensor, entropy_S: torch.Tensor | None, trajectory_index_S: torch.Tensor | None,
    normalizer: float | None, entropy_normalizer: float | None, caller: str,
) -> PolicyLoss:
    loss = aggregate(
        per_token, loss_mask_S, aggregation=config.aggregation, trajectory_index_S=trajectory_index_S,
        normalizer=normalizer, loss_scale_factor=config.loss_scale_factor,
    )
    bonus = _entropy_bonus(config, loss_mask_S, entropy_S, trajectory_index_S, normalizer, entropy_normalizer, caller)
    if bonus is not None:
        loss = loss - bonus
    return PolicyLoss(
        loss=loss, per_token_loss=per_token, clip_fraction=_masked_mean(is_clipped, loss_mask_S), kl=kl,
        entropy=None if entropy_S is None else _masked_mean(entropy_S, loss_mask_S),
    )


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
    entropy_S: torch.Tensor | None = None,
    entropy_normalizer: float | None = None,
) -> PolicyLoss:
    """GRPO loss of the current log-probs λ (grad) given ξ; all tensors [S], one order. `entropy_S` (grad)
    feeds the entropy bonus; `entropy_normalizer` is its aggregation's N when that is not the loss's
    (default: counted from the given positions)."""
    _check_lengths(
        logprobs_S, advantages_S=advantages_S, loss_mask_S=loss_mask_S, old_logprobs_S=old_logprobs_S,
        ref_logprobs_S=ref_logprobs_S, trajectory_index_S=trajectory_index_S, entropy_S=entropy_S,
    )
    if config.kl_coef > 0 and ref_logprobs_S is None:
        raise ValueError("grpo_loss: kl_coef > 0 needs ref_logprobs_S")
    _needs_trajectories(config, trajectory_index_S, "grpo_loss")
    log_ratio = _log_ratio(logprobs_S, old_logprobs_S, loss_mask_S, config.log_ratio_clamp)
    if config.importance_sampling_level == "sequence":
        log_ratio = _per_sequence(log_ratio, loss_mask_S, trajectory_index_S, mean=True)
    ratio = torch.exp(log_ratio)
    advantages = advantages_S.to(logprobs_S.dtype)
    if config.surrogate == "clip":
        per_token, is_clipped = _clip(ratio, advantages, config.clip_ratio_low, config.clip_ratio_high,
                                      config.ratio_cap, config.dual_clip_ratio)
    elif config.surrogate == "cispo":
        weight = torch.clamp(ratio, 1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high).detach()
        per_token, is_clipped = -weight * advantages * logprobs_S, weight != ratio.detach()
    elif config.surrogate == "sapo":
        tau = torch.where(advantages > 0, advantages.new_tensor(config.sapo_tau_pos),
                          advantages.new_tensor(config.sapo_tau_neg))
        per_token = -(torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau) * advantages
        is_clipped = torch.zeros_like(loss_mask_S, dtype=torch.bool)
    else:
        phi = _vespo_weights(
            _log_ratio(logprobs_S, old_logprobs_S, loss_mask_S, None), advantages, loss_mask_S, trajectory_index_S,
            config,
        )
        per_token, is_clipped = -phi * advantages * logprobs_S, torch.zeros_like(loss_mask_S, dtype=torch.bool)
    kl = None
    if ref_logprobs_S is not None:
        ref = torch.where(loss_mask_S.bool(), ref_logprobs_S.to(logprobs_S.dtype), logprobs_S.detach())
        kl_S = kl_estimate(logprobs_S, ref, config.kl_estimator)
        if config.kl_coef > 0:
            per_token = per_token + config.kl_coef * (kl_S * ratio if config.kl_importance_weighted else kl_S)
        kl = _masked_mean(kl_S, loss_mask_S)
    return _result(config, per_token, is_clipped, kl, loss_mask_S, entropy_S, trajectory_index_S, normalizer,
                   entropy_normalizer, "grpo_loss")


def ppo_loss(
    logprobs_S: torch.Tensor,
    *,
    advantages_S: torch.Tensor,
    loss_mask_S: torch.Tensor,
    config: PPOConfig,
    old_logprobs_S: torch.Tensor | None = None,
    trajectory_index_S: torch.Tensor | None = None,
    normalizer: float | None = None,
    entropy_S: torch.Tensor | None = None,
    entropy_normalizer: float | None = None,
) -> PolicyLoss:
    """PPO clipped-surrogate loss (per-token advantages given, e.g. GAE computed upstream); `entropy_S` and
    `entropy_normalizer` as for `grpo_loss`."""
    _check_lengths(
        logprobs_S, advantages_S=advantages_S, loss_mask_S=loss_mask_S, old_logprobs_S=old_logprobs_S,
        trajectory_index_S=trajectory_index_S, entropy_S=entropy_S,
    )
    _needs_trajectories(config, trajectory_index_S, "ppo_loss")
    ratio = torch.exp(_log_ratio(logprobs_S, old_logprobs_S, loss_mask_S, config.log_ratio_clamp))
    per_token, is_clipped = _clip(ratio, advantages_S.to(logprobs_S.dtype), config.clip_ratio_low,
                                  config.clip_ratio_high, dual_clip_ratio=config.dual_clip_ratio)
    return _result(config, per_token, is_clipped, None, loss_mask_S, entropy_S, trajectory_index_S, normalizer,
                   entropy_normalizer, "ppo_loss")
