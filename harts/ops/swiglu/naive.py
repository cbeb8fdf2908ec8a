"""SwiGLU's activation in PyTorch: silu(gate) ⊙ up, rounded after the SiLU and after the product
(the expression the model ran before the fused kernel, and still runs on CPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_swiglu(gate_up_RF2: torch.Tensor) -> torch.Tensor:
    """[R, F] = silu(gate) ⊙ up for rows [R, 2F] = [gate | up] (gate first)."""
    gate, up = gate_up_RF2.chunk(2, dim=-1)
    return F.silu(gate) * up
