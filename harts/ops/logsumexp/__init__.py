"""The LM head's per-row forward statistics (`harts.objective.logprobs`' forward): the log-sum-exp of each row of a
chunk of logits and, optionally, the entropy H = −Σ p·log p of its softmax.

- `naive_logsumexp_entropy`: PyTorch (`torch.logsumexp`, then the entropy from the log-probs z − lse, in place on
  the logits), what every CPU path runs (naive.py).
- `fused_logsumexp_entropy`: one Triton pass reading each fp32 logit once with an online maximum (fused.py, CUDA;
  imported lazily).
- `logsumexp_entropy`: the fused pass for contiguous fp32 logits on CUDA, the PyTorch form elsewhere.

Why: on an H100 (ea73e7a, ling3-tiny's 8-layer slice, a 65,429-row microbatch, vocabulary 157,184, 2,048-row fp32
chunks) the separate PyTorch passes over each chunk cost about 88 ms per microbatch. Tested against the PyTorch form
under the Triton interpreter on CPU and on CUDA (tests/ops/logsumexp/).
"""

import torch

from harts.ops.logsumexp.naive import naive_logsumexp_entropy

__all__ = ["fused_logsumexp_entropy", "logsumexp_entropy", "naive_logsumexp_entropy"]


def logsumexp_entropy(
    logits_nV: torch.Tensor, *, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(lse [n], H [n] or None) of logits [n, V]. With `entropy` the logits are scratch afterwards (the PyTorch
    form turns them into log-probs in place; the fused pass leaves them): read the targets' logits first."""
    if logits_nV.is_cuda and logits_nV.dtype == torch.float32 and logits_nV.is_contiguous():
        from harts.ops.logsumexp.fused import fused_logsumexp_entropy

        return fused_logsumexp_entropy(logits_nV, entropy=entropy)
    return naive_logsumexp_entropy(logits_nV, entropy=entropy)


def __getattr__(name: str):
    if name == "fused_logsumexp_entropy":
        from harts.ops.logsumexp.fused import fused_logsumexp_entropy

        return fused_logsumexp_entropy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
