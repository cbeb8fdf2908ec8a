"""AdamW with fp32 master weights, the learning-rate schedule and global-norm gradient clipping.

`MasterWeightAdamW(named_parameters, config)` runs torch.optim.AdamW (weight decay on matrices
only, unless `weight_decay_vectors`) over
- an fp32 parameter itself (no copy);
- for a lower-precision (bf16) parameter, an fp32 master copy. A post-accumulate-grad hook adds
  every backward's bf16 gradient into the master's fp32 `.grad` and frees the bf16 one, so the
  microbatch gradients of a step sum in fp32 (megatron's main_grad). Clipping and AdamW (moments
  in fp32) work on the masters; `step()` writes them back to the parameters rounded to nearest,
  so an update smaller than half a bf16 ulp of its weight accumulates in the master instead of
  vanishing.

Interaction with autocast (the step's dtype "bf16"): autocast casts the inputs of matmul-like ops
to bf16, which for bf16 parameters is no copy at all (fp32 parameters would be cast at every
forward), while the ops autocast runs in fp32 (softmax, log-softmax, norms) still upcast, and the
model's own fp32 islands stay fp32 (router logits; the expert-bias buffer keeps fp32 under module
casts). Autocast covers the forward only: gradients arrive in the parameters' dtype (bf16), and
clipping and the optimizer step run outside it, in fp32, on the masters.

`lr_factor(t, schedule, num_steps)` is the learning-rate multiplier of step t (0-based): linear
warm-up (t + 1) / warmup_steps, then 1 ("constant") or a cosine from 1 at t = warmup_steps to
`min_lr_ratio` at t = num_steps; `make_scheduler` wraps it in torch's LambdaLR (whose state, the
step count, goes into checkpoints). `clip_grad_norm` returns the global 2-norm before clipping.

Tested in tests/optim/test_adamw.py: against torch.optim.AdamW on a plain fp32 model
(bitwise), bf16 masters against an fp32 AdamW fed the same gradients (bitwise), fp32
accumulation of bf16 microbatch gradients, the schedule at known steps, clipping by hand.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from harts.optim.config import OptimizerConfig, ScheduleConfig


class MasterWeightAdamW:
    """AdamW over fp32 masters of the given (name, parameter) pairs; see the module docstring."""

    def __init__(self, named_parameters: Iterable[tuple[str, nn.Parameter]], config: OptimizerConfig) -> None:
        self.names: list[str] = []
        self.params: list[nn.Parameter] = []
        self.masters: list[torch.Tensor] = []
        self._hooks = []
        for name, param in named_parameters:
            if not param.requires_grad:
                continue
            self.names.append(name)
            self.params.append(param)
            if param.dtype == torch.float32:
                self.masters.append(param)
            else:
                master = param.detach().to(torch.float32).clone()
                self.masters.append(master)
                self._hooks.append(param.register_post_accumulate_grad_hook(_accumulate_into(master)))
        decay = [m for p, m in zip(self.params, self.masters) if p.dim() >= 2 or config.weight_decay_vectors]
        plain = [m for p, m in zip(self.params, self.masters) if not (p.dim() >= 2 or config.weight_decay_vectors)]
        groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": plain, "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(
            [group for group in groups if group["params"]], lr=config.lr, betas=(config.beta1, config.beta2),
            eps=config.eps,
        )

    @property
    def copies(self) -> dict[str, torch.Tensor]:
        """The fp32 masters that are copies (of non-fp32 parameters), by parameter name."""
        return {n: m for n, p, m in zip(self.names, self.params, self.masters) if m is not p}

    def pending_state_bytes(self) -> int:
        """Bytes of AdamW state not yet allocated: each master's first and second moments (its dtype and size),
        which torch's AdamW allocates at the master's first step; so a step before the first optimizer step peaks
        lower than the steps after it."""
        allocated = {id(master) for master, state in self.optimizer.state.items() if state}
        return sum(2 * master.numel() * master.element_size() for master in self.masters if id(master) not in allocated)

    def zero_grad(self) -> None:
        for param, master in zip(self.params, self.masters):
            param.grad = None
            master.grad = None

    def clip_grad_norm(self, max_norm: float) -> float:
        """The global 2-norm of the master gradients; if max_norm > 0, scale them to at most max_norm."""
        grads = [m.grad for m in self.masters if m.grad is not None]
        if not grads:
            return 0.0
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(self.masters, max_norm, norm)
        return float(norm)

    @torch.no_grad()
    def step(self) -> None:
        self.optimizer.step()
        for param, master in zip(self.params, self.masters):
            if master is not param:
                param.copy_(master)

    @torch.no_grad()
    def load_copies(self, tensors: dict[str, torch.Tensor], where: str) -> None:
        """Set the master copies from `tensors` (a checkpoint's), which must name exactly them."""
        copies = self.copies
        if set(tensors) != set(copies):
            extra, missing = sorted(set(tensors) - set(copies)), sorted(set(copies) - set(tensors))
            raise ValueError(f"{where}: master weights do not match the model "
                             f"({'unexpected ' + extra[0] if extra else 'missing ' + missing[0]})")
        for name, master in copies.items():
            if tensors[name].shape != master.shape or tensors[name].dtype != master.dtype:
                raise ValueError(f"{where}: master weight {name!r} is {tensors[name].dtype} {tuple(tensors[name].shape)}, "
                                 f"the run's {master.dtype} {tuple(master.shape)}")
            master.copy_(tensors[name])

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


class Fp32Gradients:
    """megatron's main_grad without an optimizer (benchmarks of forward + backward): after every
    backward each lower-precision parameter's gradient is added into an fp32 buffer (`grads[name]`,
    allocated at the first backward and kept) and the bf16 one is freed; fp32 parameters keep
    their own `.grad`. The same hook as `MasterWeightAdamW`'s."""

    def __init__(self, named_parameters: Iterable[tuple[str, nn.Parameter]]) -> None:
        self._slots: dict[str, _GradSlot] = {}
        self._hooks = []
        for name, param in named_parameters:
            if param.requires_grad and param.dtype != torch.float32:
                slot = self._slots[name] = _GradSlot()
                self._hooks.append(param.register_post_accumulate_grad_hook(_accumulate_into(slot)))

    @property
    def grads(self) -> dict[str, torch.Tensor | None]:
        return {name: slot.grad for name, slot in self._slots.items()}

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


class _GradSlot:
    grad: torch.Tensor | None = None


def _accumulate_into(master):
    def hook(param: nn.Parameter) -> None:
        if master.grad is None:
            master.grad = param.grad.to(torch.float32)
        else:
            master.grad.add_(param.grad)
        param.grad = None

    return hook


def lr_factor(step: int, schedule: ScheduleConfig, num_steps: int) -> float:
    """The learning-rate multiplier of step `step` (0-based); see the module docstring."""
    if step < schedule.warmup_steps:
        return (step + 1) / schedule.warmup_steps
    if schedule.decay == "constant":
        return 1.0
    progress = min((step - schedule.warmup_steps) / max(num_steps - schedule.warmup_steps, 1), 1.0)
    return schedule.min_lr_ratio + (1 - schedule.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_scheduler(optimizer: MasterWeightAdamW, schedule: ScheduleConfig,
                   num_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR giving step t the learning rate lr · lr_factor(t); call its step() after each optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer.optimizer, lambda step: lr_factor(step, schedule, num_steps)
    )
