"""One optimizer update after a step's backward, the same in harts train (harts.training.loop) and harts rl
(harts.rl.loop): clip to the global norm, AdamW step, schedule step, then the aux-loss-free expert-bias update
of every MoE layer that has an expert bias, from the step's q-weighted routed counts.

Tested in tests/optim/test_update.py (a non-finite gradient norm changes nothing) and tests/training/test_loop.py
(the expert-bias update with the step's counts).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from harts.model.model import HybridModel


@torch.no_grad()
def apply_update(model: HybridModel, optimizer, scheduler, max_grad_norm: float,
                 tokens_per_expert: list[torch.Tensor], where: str) -> float:
    """One optimizer update after a step's backward (`harts train` and `harts rl`): clip to the global norm
    (a ValueError naming `where` if it is not finite), AdamW step, schedule step, expert-bias update; the
    norm before clipping."""
    grad_norm = optimizer.clip_grad_norm(max_grad_norm)
    if not math.isfinite(grad_norm):
        raise ValueError(f"{where}: the gradient norm is {grad_norm}")
    optimizer.step()
    scheduler.step()
    update_expert_biases(model, tokens_per_expert)
    return grad_norm


def update_expert_biases(model: HybridModel, tokens_per_expert: list[torch.Tensor]) -> None:
    """The aux-loss-free update of each MoE layer with an expert bias, from its q-weighted counts of the step (the
    decoder's layers, then the MTP layers'). Counts of the decoder's layers alone (a step that ran no MTP layer, as
    the log-prob paths of harts.api and the trainers' integrations) leave the MTP layers' biases as they are, which
    is what their zero counts would do."""
    layers = [block.mlp for block in model.blocks if block.is_moe]
    if model.mtp is not None and len(tokens_per_expert) != len(layers):
        layers += [layer.block.mlp for layer in model.mtp.layers]
    assert len(layers) == len(tokens_per_expert), (len(layers), len(tokens_per_expert))
    for layer, counts in zip(layers, tokens_per_expert):
        if layer.expert_bias is not None:
            layer.update_expert_bias(counts)
