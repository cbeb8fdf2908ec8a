"""Models shared by several test folders."""

import torch

from harts.model.config import ModelConfig
from harts.model.model import HybridModel


def sharp_router_model(config: ModelConfig, seed: int, scale: float = 40.0) -> HybridModel:
    """`config`'s model initialised with `seed`, every MoE router's weights scaled by `scale`: routing far from
    uniform, so that a pooled load-balancing loss differs from a per-layer mean and has sizeable gradients."""
    model = HybridModel(config)
    model.init_weights(seed=seed)
    with torch.no_grad():
        for block in model.blocks:
            if block.is_moe:
                block.mlp.router_weight.mul_(scale)
    return model
