"""The multi-token-prediction (MTP) loss of a step, in either execution (harts.model.mtp, harts.runtime.mtp).

Depth k's semantic positions are (x, i) for i >= k (trajectory x's MTP position t = i - k). Each predicts x_{i+1}
with that token's loss mask: it carries the target and mask of the main semantic position (x, i)
(harts.objective.targets), which are megatron-core's labels and loss mask rolled k times. The loss is

    L_MTP = (f / D) · Σ_{k=1..D} [ −Σ_{s of depth k} mask_s · log p^k_s(y_s) ] / N_k

with f = the loss scaling factor (`mtp_scaling_factor`), D = the model's MTP depths and N_k = Σ mask_s over depth k's
positions of the whole step (`mtp_normalizers`; at least 1), so that the microbatches' losses add up to the step's
whatever the microbatching. With one microbatch this is megatron-core's (GPTModel._postprocess: each depth's masked
cross entropy over its rolled mask's count, times mtp_loss_scaling_factor / mtp_num_layers; tests/objective/
test_mtp.py drives it). The log-probs come from the compact LM head (`compact_logprobs`) at temperature 1: under a
tree a row with several children carries one label per child, each position's term formed on its own, so the cross
entropy needs no q weight (q is the row's number of positions); the MTP blocks' MoE losses are q-weighted with the
MTP rows' multiplicities, like the main blocks'.

Reference: `reference_mtp_loss`, megatron-core's computation on one trajectory written plainly: the whole sequence's
input ids, labels and loss mask rolled left with a 0 fill at every depth (the k trailing rows included), each depth's
layer over all L rows, dense L × V logits and `cross_entropy`. tests/objective/test_mtp.py compares the per-trajectory
loss with it and the compact loss and every gradient with the per-trajectory ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from harts.objective.logprobs import compact_logprobs
from harts.objective.targets import SemanticTargets
from harts.runtime.layout import packed_layout
from harts.runtime.mtp import MTPLayout
from harts.trees.step import Step


@dataclass
class MTPLoss:
    """A microbatch's MTP loss."""

    loss: torch.Tensor
    """Scalar, differentiable: (f / D) · Σ_k of the depths' terms."""
    depth_losses: list[float]
    """Each depth's term Σ mask · (−log p) / N_k of this microbatch (detached; 0 for a depth it has no row of)."""


def mtp_scaling_factor(model_config, override: float | None) -> float:
    """f: `override` (a StepConfig's `mtp_loss_scaling_factor`) when given, else the model's
    `MTPConfig.loss_scaling_factor`; 0 for a model without MTP layers (ValueError if `override` asks for more)."""
    if model_config.mtp is None:
        if override:
            raise ValueError(f"mtp_loss_scaling_factor is {override}, but model {model_config.name!r} has no MTP "
                             "layers (its config's mtp is not set)")
        return 0.0
    return model_config.mtp.loss_scaling_factor if override is None else float(override)


def mtp_normalizers(step: Step, targets: SemanticTargets, num_depths: int) -> list[float]:
    """N_k for k = 1 .. num_depths: the step's masked positions (x, i >= k), at least 1 (a depth without any
    contributes 0)."""
    token_index = np.arange(step.num_semantic_tokens) - np.repeat(step.offsets[:-1], step.lengths)
    return [float(max(int(targets.loss_mask[token_index >= depth].sum()), 1)) for depth in range(1, num_depths + 1)]


def microbatch_mtp_loss(
    hidden: list[torch.Tensor], layouts: list[MTPLayout], lm_head_weight: torch.Tensor, targets: SemanticTargets,
    sem_index: np.ndarray, normalizers: list[float], scaling_factor: float, *, chunk_rows: int,
    grad_precision: str = "fp32",
) -> MTPLoss:
    """The MTP loss of one microbatch from its depths' final hidden states `hidden` (the model's, one per layout of
    `layouts`), the LM head and the step's `targets`; `sem_index` maps the microbatch's semantic positions to the
    step's, `normalizers` are the step's N_k (`mtp_normalizers`, one per MTP layer of the model)."""
    assert len(hidden) == len(layouts) <= len(normalizers), (len(hidden), len(layouts), len(normalizers))
    device = lm_head_weight.device
    total = lm_head_weight.new_zeros((), dtype=torch.float32)
    depth_losses = [0.0] * len(normalizers)
    for hidden_RD, mtp_layout in zip(hidden, layouts):
        positions = sem_index[mtp_layout.semantic_positions]
        masked = targets.loss_mask[positions]
        rows = mtp_layout.layout.semantic_rows[torch.from_numpy(np.flatnonzero(masked)).to(device)]
        labels = torch.from_numpy(targets.targets[positions[masked]]).to(device)
        logprobs = compact_logprobs(hidden_RD, lm_head_weight, rows, labels, chunk_rows=chunk_rows,
                                    grad_precision=grad_precision)
        term = -logprobs.sum() / normalizers[mtp_layout.depth - 1]
        depth_losses[mtp_layout.depth - 1] = float(term.detach())
        total = total + term
    return MTPLoss(loss=total * (scaling_factor / len(normalizers)), depth_losses=depth_losses)


def _roll_left(x: torch.Tensor) -> torch.Tensor:
    """x shifted one place towards the start, 0 in the freed last place (megatron-core's `roll_tensor`)."""
    return torch.cat([x[1:], x.new_zeros(1)])


def reference_mtp_loss(model, tokens: np.ndarray, loss_mask: np.ndarray, *, scaling_factor: float | None = None,
                       normalizers: list[float] | None = None) -> torch.Tensor:
    """The MTP loss of one trajectory (`tokens`, its target-indexed `loss_mask`) as megatron-core computes it, plain:
    labels[t] = x_{t+1} and mask[t] = loss_mask[t+1] (0 at the end), then at every depth the input ids, labels and
    mask rolled left once more, the depth's layer over all L rows (the main model's final hidden states for depth
    1), dense logits and the masked cross entropy over `normalizers[k - 1]` (default: the depth's rolled mask count,
    at least 1). fp32, on the model's device."""
    config = model.config
    device = next(model.parameters()).device
    scaling_factor = config.mtp.loss_scaling_factor if scaling_factor is None else scaling_factor
    ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64), device=device)
    layout = packed_layout(ids.cpu().numpy(), np.array([len(ids)]), np.zeros(1, dtype=np.int64),
                           conv_size=config.linear_attention.conv_size,
                           chunk_size=config.linear_attention.chunk_size).to(device)
    hidden, _ = model(ids, layout)
    labels = _roll_left(ids)
    mask = _roll_left(torch.as_tensor(np.asarray(loss_mask, dtype=np.float32), device=device))
    total = hidden.new_zeros((), dtype=torch.float32)
    for depth, layer in enumerate(model.mtp.layers, start=1):
        ids, labels, mask = _roll_left(ids), _roll_left(labels), _roll_left(mask)
        hidden, _ = layer(model.embed(ids), hidden, layout)
        logits = hidden.float() @ model.lm_head.weight.float().T
        cross_entropy = F.cross_entropy(logits, labels, reduction="none")
        count = max(float(mask.sum()), 1.0) if normalizers is None else normalizers[depth - 1]
        total = total + (mask * cross_entropy).sum() / count
    return total * (scaling_factor / len(model.mtp.layers))
