"""The LM head's logit gradient from recomputed logits, in PyTorch: what every CPU path runs.

For one chunk of rows with logits z (fp32), their log-sum-exp, the per-row sum of the log-probs'
upstream gradients Σg and (with entropy) the per-row entropy H and sum of its upstream gradients Σh:
    ∂L/∂z = −p ⊙ (Σg + Σh·(log p + H)),  p = exp(z − lse)
(without the one-hot terms Σ g_s·onehot(y_s), which the caller adds at the targets).
"""

from __future__ import annotations

import torch


def naive_logit_grad(
    logits_nV: torch.Tensor, lse_n: torch.Tensor, grad_sum_n: torch.Tensor,
    entropy_n: torch.Tensor | None = None, grad_entropy_n: torch.Tensor | None = None,
    *, out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """∂L/∂z without the one-hot terms. `out_dtype` None: in place on `logits_nV` (returned); else a
    new tensor, computed in the logits' dtype and rounded once to `out_dtype` (the logits kept)."""
    grad_nV = logits_nV if out_dtype is None else logits_nV.clone()
    grad_nV.sub_(lse_n[:, None])
    if grad_entropy_n is None:
        grad_nV.exp_().mul_(-grad_sum_n[:, None])
    else:
        p_nV = grad_nV.exp()
        grad_nV.add_(entropy_n[:, None]).mul_(grad_entropy_n[:, None])
        grad_nV.add_(grad_sum_n[:, None]).mul_(p_nV).neg_()
    return grad_nV if out_dtype is None else grad_nV.to(out_dtype)
