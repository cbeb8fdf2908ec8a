"""The LM head's logit gradient from recomputed logits (`harts.objective.logprobs`' backward):
∂L/∂z = −p ⊙ (Σg + Σh·(log p + H)) per row, without the one-hot terms.

- `naive_logit_grad`: PyTorch, in place on the fp32 chunk (naive.py), what every CPU path runs.
- `fused_logit_grad`: one Triton pass, fp32 inside, one rounding to the output dtype (fused.py, CUDA;
  imported lazily).
- `logit_grad`: the fused pass for fp32 logits on CUDA, the PyTorch form elsewhere.
"""

import torch

from harts.ops.logit_grad.naive import naive_logit_grad

__all__ = ["fused_logit_grad", "logit_grad", "naive_logit_grad"]


def logit_grad(
    logits_nV: torch.Tensor, lse_n: torch.Tensor, grad_sum_n: torch.Tensor,
    entropy_n: torch.Tensor | None = None, grad_entropy_n: torch.Tensor | None = None,
    *, out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """∂L/∂z without the one-hot terms: in place on the logits (`out_dtype` None) or rounded once into a
    new tensor of `out_dtype` (the logits kept)."""
    if logits_nV.is_cuda and logits_nV.dtype == torch.float32 and logits_nV.is_contiguous():
        from harts.ops.logit_grad.fused import fused_logit_grad

        return fused_logit_grad(logits_nV, lse_n, grad_sum_n, entropy_n, grad_entropy_n, out_dtype=out_dtype)
    return naive_logit_grad(logits_nV, lse_n, grad_sum_n, entropy_n, grad_entropy_n, out_dtype=out_dtype)


def __getattr__(name: str):
    if name == "fused_logit_grad":
        from harts.ops.logit_grad.fused import fused_logit_grad

        return fused_logit_grad
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
