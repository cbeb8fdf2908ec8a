"""The optimizer's and the schedule's config sections, shared by harts train (harts.training.config) and
harts rl (harts.rl.config): `OptimizerConfig` (AdamW and gradient clipping) and `ScheduleConfig` (warm-up,
then constant or cosine). Torch-free.

Defaults of the optimizer follow verl's actor (AdamW, lr 1e-6, betas 0.9/0.999, weight decay
0.01, gradient clipping at norm 1.0, constant schedule). Tested in tests/training/test_config.py and
tests/rl/test_config.py (through the configs that hold them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAYS = ("constant", "cosine")


@dataclass(kw_only=True)
class OptimizerConfig:
    """AdamW (torch.optim.AdamW) and gradient clipping."""

    lr: float = 1e-6
    """Peak learning rate (the schedule multiplies it)."""
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    """Decoupled weight decay of the matrices (parameters with two or more dimensions)."""
    weight_decay_vectors: bool = False
    """Also decay the vectors (norm scales, biases, KDA's A_log and dt_bias); off as in most LLM recipes."""
    max_grad_norm: float = 1.0
    """Clip the global 2-norm of all gradients to this; 0 = no clipping (the norm is still reported)."""

    def __post_init__(self) -> None:
        numbers = {"lr": self.lr, "eps": self.eps, "weight_decay": self.weight_decay,
                   "max_grad_norm": self.max_grad_norm}
        for name, value in numbers.items():
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"optimizer.{name} must be a finite number >= 0, got {value}")
        if self.eps == 0:
            raise ValueError("optimizer.eps must be > 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"optimizer.beta1 and beta2 must be in [0, 1), got {self.beta1}, {self.beta2}")


@dataclass(kw_only=True)
class ScheduleConfig:
    """Learning-rate factor per step t (0-based): linear warm-up, then constant or cosine decay."""

    warmup_steps: int = 0
    """Steps t < warmup_steps use (t + 1) / warmup_steps."""
    decay: str = "constant"
    """"constant" (1 after warm-up) or "cosine" (from 1 at t = warmup_steps to min_lr_ratio at t = num_steps)."""
    min_lr_ratio: float = 0.0
    """Cosine's floor as a fraction of the peak."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"schedule.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.decay not in DECAYS:
            raise ValueError(f"schedule.decay must be one of {DECAYS}, got {self.decay!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"schedule.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
