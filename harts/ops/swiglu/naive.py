"""SwiGLU's activation in PyTorch: silu(gate) ⊙ up, rounded after the SiLU and after the product
(the expression the model ran before the fused kernel, and still runs on CPU); and the closed-form
backward of the weighted activation weight_R · swiglu(gate_up) (the lean MoE experts' backward).

With a clipping limit L (BailingHybrid's per-layer `swiglu_limits`, clipped after the activation as
transformers' `limit_after_act`): min(silu(gate), L) ⊙ clamp(up, −L, L); the gradient passes where the
clipped value is inside its bound (bounds included), as autograd of `clamp` lets it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_swiglu(gate_up_RF2: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """[R, F] = silu(gate) ⊙ up for rows [R, 2F] = [gate | up] (gate first), each factor clipped to `limit`
    when one is given."""
    gate, up = gate_up_RF2.chunk(2, dim=-1)
    if limit is None:
        return F.silu(gate) * up
    return F.silu(gate).clamp(max=limit) * up.clamp(min=-limit, max=limit)


def naive_weighted_swiglu_backward(
    gate_up_RF2: torch.Tensor, weight_R: torch.Tensor, grad_RF: torch.Tensor, limit: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of out = weight[:, None] · swiglu(gate_up, limit) from grad = d out, by the closed form the fused
    kernel evaluates, in fp32 (fp64 for fp64 rows): (d gate_up in its dtype, d weight in the weight's dtype,
    and the forward value weight · swiglu(gate_up, limit) in gate_up's dtype, which the caller's weight gradient
    needs)."""
    dtype = torch.promote_types(gate_up_RF2.dtype, torch.float32)
    gate, up = gate_up_RF2.to(dtype).chunk(2, dim=-1)
    grad = grad_RF.to(dtype)
    weight = weight_R.to(dtype)[:, None]
    sig = torch.sigmoid(gate)
    scaled = grad * weight
    if limit is None:
        act = gate * sig * up
        d_gate = scaled * up * sig * (1 + gate * (1 - sig))
        d_up = scaled * gate * sig
    else:
        silu = gate * sig
        inside_gate, inside_up = silu <= limit, (up >= -limit) & (up <= limit)
        silu, up = silu.clamp(max=limit), up.clamp(min=-limit, max=limit)
        act = silu * up
        d_gate = scaled * up * sig * (1 + gate * (1 - sig)) * inside_gate
        d_up = scaled * silu * inside_up
    return (
        torch.cat([d_gate, d_up], dim=-1).to(gate_up_RF2.dtype),
        (act * grad).sum(dim=-1).to(weight_R.dtype),
        (act * weight).to(gate_up_RF2.dtype),
    )
