"""TRL 1.16's loss metrics of a GRPO micro-batch computed from HARTS's log-probs, entropies and policy loss: what
`trl.GRPOTrainer._compute_loss` logs for each `loss_type`, with TRL's definitions and its reductions over the
processes (`harts.integrations.trl.HARTSGRPOTrainer` logs them).

The metrics (r: the importance ratio at `importance_sampling_level`, per token, or per sequence from its mean masked
log-ratio; A: the advantage; means over the masked tokens, or over the rows for a value per sequence):
- every loss type: `entropy`; with beta != 0, `kl`: k3's exp(λ_ref − λ) − (λ_ref − λ) − 1, times r under
  `use_bias_correction_kl`;
- the clip surrogates (dapo, grpo, dr_grpo, bnpo, luspo), r capped at `delta` when set: `clip_ratio/low_mean`,
  `clip_ratio/high_mean` and `clip_ratio/region_mean`, the means of low = (r < 1 − ε_low and A < 0), high =
  (r > 1 + ε_high and A > 0) and low or high; `clip_ratio/low_min` and `clip_ratio/high_max`, the least per-sequence
  mean of low and the largest of high over every process's sequences;
- cispo: `cispo_clip_ratio`, the mean of r > ε_high and A > 0 (where its weight is capped);
- vespo: `vespo/phi_seq_mean`, the mean over the rows of VESPO's weight φ(w) of each sequence's ratio w;
- sapo: none of its own;
- with the entropy bonus: `policy_loss` (the trainer's: the loss before the bonus), averaged over the processes.

Reductions, as TRL's: a mean (TRL's `global_masked_mean`) sums the values and counts of every process; a
per-sequence mean of a sequence without masked tokens is NaN and left out of the min and max (NaN when all are, as
TRL's `nanmin`/`nanmax` of its gathered per-sequence means: the min of the processes' minima is the same value); a
process mean leaves NaN out. One gather carries every metric's part (`reduce_over_processes`).

Shapes: B = rows of the micro-batch, T = completion columns, X = T or 1 (one value per sequence).
Reference: TRL's own `_compute_loss` on the same log-probs, in one and two processes
(tests/integrations/test_trl_metrics.py), and both trainers end to end (tests/integrations/test_trl*.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from harts.objective.losses import k3_kl, vespo_phi

CLIP_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
"""TRL loss types of the clipped surrogate, which log the clip_ratio/ metrics."""
REDUCTIONS = ("mean", "min", "max", "process_mean")
"""How a metric's part is reduced over the processes (module docstring)."""


@dataclass(frozen=True)
class Part:
    """This process's part of a metric."""

    reduction: str
    """One of REDUCTIONS."""
    values: torch.Tensor
    """"mean": [2] the sum and count of this process's values; otherwise [] this process's value (NaN: none)."""


def mean_part(values_BX: torch.Tensor, mask_BT: torch.Tensor) -> Part:
    """TRL's `global_masked_mean` of `values_BX` on this process: over the masked tokens, or over every row for a
    value per sequence (width 1)."""
    if values_BX.size(1) == 1:
        return Part("mean", torch.stack([values_BX.sum(), values_BX.new_tensor(float(values_BX.size(0)))]))
    total = torch.where(mask_BT.bool(), values_BX, 0.0).sum()
    return Part("mean", torch.stack([total, mask_BT.sum().to(total.dtype)]))


def sequence_means(values_BX: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """[B] each row's mean over its masked tokens (NaN without any), or its value per sequence (width 1)."""
    if values_BX.size(1) == 1:
        return values_BX[:, 0]
    total_B = torch.where(mask_BT.bool(), values_BX, 0.0).sum(-1)
    return total_B / mask_BT.sum(-1).to(total_B.dtype)


def nan_extreme(values: torch.Tensor, largest: bool) -> torch.Tensor:
    """The largest (or least) value that is not NaN; NaN when none is."""
    kept = values[~values.isnan()]
    if kept.numel() == 0:
        return values.new_tensor(math.nan)
    return kept.max() if largest else kept.min()


def masked_log_ratio(log_probs_BT: torch.Tensor, old_log_probs_BT: torch.Tensor | None,
                     mask_BT: torch.Tensor) -> torch.Tensor:
    """[B, T] λ − λ_old on the masked tokens (0 on-policy, when TRL has no old log-probs), 0 elsewhere."""
    if old_log_probs_BT is None:
        return torch.zeros_like(log_probs_BT)
    return torch.where(mask_BT.bool(), log_probs_BT - old_log_probs_BT, 0.0)


def importance_ratio(log_ratio_BT: torch.Tensor, mask_BT: torch.Tensor, level: str) -> torch.Tensor:
    """[B, X] r per token, or per sequence (X = 1) from the mean masked log-ratio."""
    if level == "sequence":
        log_ratio_BT = log_ratio_BT.sum(-1, keepdim=True) / mask_BT.sum(-1, keepdim=True).clamp(min=1)
    return torch.exp(log_ratio_BT)


def gamma_weights(log_ratio_BT: torch.Tensor, mask_BT: torch.Tensor, advantages_BX: torch.Tensor,
                  args: Any) -> torch.Tensor:
    """[B, X] VESPO's φ(w) of each sequence's w = exp(Σ clamp(ρ, ±20)) (`harts.objective.losses.vespo_phi`: TRL's
    `get_gamma_weights` without vLLM's correction)."""
    summed = torch.where(mask_BT.bool(), log_ratio_BT.clamp(-20.0, 20.0), 0.0).sum(-1, keepdim=True)
    return vespo_phi(summed, advantages_BX, args)


def loss_metrics(
    args: Any,
    *,
    log_probs_BT: torch.Tensor,
    old_log_probs_BT: torch.Tensor | None,
    ref_log_probs_BT: torch.Tensor | None,
    entropy_BT: torch.Tensor,
    advantages: torch.Tensor,
    mask_BT: torch.Tensor,
    policy_loss: torch.Tensor | None = None,
) -> dict[str, Part]:
    """This process's part of each metric that TRL logs from `_compute_loss` for `args` (a `trl.GRPOConfig`), but
    `entropy_coef` (the trainer's): module docstring. `advantages` is [B] or [B, T], `mask_BT` TRL's loss mask
    (completion and tool masks), `policy_loss` [] given with the entropy bonus."""
    log_probs_BT = log_probs_BT.detach()
    advantages_BX = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    log_ratio_BT = masked_log_ratio(log_probs_BT, old_log_probs_BT, mask_BT)
    ratio_BX = importance_ratio(log_ratio_BT, mask_BT, args.importance_sampling_level)
    parts = {"entropy": mean_part(entropy_BT.detach(), mask_BT)}
    if policy_loss is not None:
        parts["policy_loss"] = Part("process_mean", policy_loss.detach())
    if args.beta != 0.0:
        kl_BX = k3_kl(log_probs_BT, ref_log_probs_BT)
        parts["kl"] = mean_part(kl_BX * ratio_BX if args.use_bias_correction_kl else kl_BX, mask_BT)
    epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    if args.loss_type in CLIP_LOSS_TYPES:
        capped_BX = ratio_BX if args.delta is None else ratio_BX.clamp(max=args.delta)
        low = ((capped_BX < 1 - args.epsilon) & (advantages_BX < 0)).float()
        high = ((capped_BX > 1 + epsilon_high) & (advantages_BX > 0)).float()
        parts["clip_ratio/low_mean"] = mean_part(low, mask_BT)
        parts["clip_ratio/high_mean"] = mean_part(high, mask_BT)
        parts["clip_ratio/region_mean"] = mean_part(torch.maximum(low, high), mask_BT)
        parts["clip_ratio/low_min"] = Part("min", nan_extreme(sequence_means(low, mask_BT), largest=False))
        parts["clip_ratio/high_max"] = Part("max", nan_extreme(sequence_means(high, mask_BT), largest=True))
    elif args.loss_type == "cispo":
        capped = ((ratio_BX > epsilon_high) & (advantages_BX > 0)).float()
        parts["cispo_clip_ratio"] = mean_part(capped, mask_BT)
    elif args.loss_type == "vespo":
        parts["vespo/phi_seq_mean"] = mean_part(gamma_weights(log_ratio_BT, mask_BT, advantages_BX, args), mask_BT)
    return parts


def reduce_over_processes(parts: dict[str, Part], gather: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
    """Each metric's value over the processes from every process's parts, in one `gather` (accelerate's:
    every process's 1-D tensor concatenated, in process order)."""
    local = torch.cat([part.values.reshape(-1).float() for part in parts.values()])
    every_PN = gather(local).view(-1, local.numel())
    values, start = [], 0
    for part in parts.values():
        width = part.values.numel()
        column_PW = every_PN[:, start:start + width]
        start += width
        if part.reduction == "mean":
            total, count = column_PW.sum(0)
            values.append(total / count.clamp(min=1.0))
        elif part.reduction in ("min", "max"):
            values.append(nan_extreme(column_PW[:, 0], largest=part.reduction == "max"))
        else:
            assert part.reduction == "process_mean", part.reduction
            values.append(column_PW[:, 0].nanmean())
    return dict(zip(parts, torch.stack(values).tolist(), strict=True))
