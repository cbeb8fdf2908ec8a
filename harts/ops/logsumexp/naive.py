"""The LM head's per-row forward statistics in PyTorch, what every CPU path runs: for one chunk of logits z (fp32 or
fp64) the log-sum-exp lse = log Σ exp(z) (`torch.logsumexp`) and, optionally, the entropy
H = −Σ p·log p with log p = z − lse, as `harts.objective.logprobs` has always computed them (the same ops, so CPU
results are unchanged bit for bit).
"""

from __future__ import annotations

import torch


def naive_logsumexp_entropy(
    logits_nV: torch.Tensor, *, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(lse [n], H [n] or None) of logits [n, V]. With `entropy` the logits are scratch: they are turned into the
    log-probs z − lse in place (one n×V buffer fewer), so read what you need from them first."""
    lse_n = torch.logsumexp(logits_nV, dim=-1)
    if not entropy:
        return lse_n, None
    log_p_nV = logits_nV.sub_(lse_n[:, None])
    return lse_n, -(log_p_nV.exp().mul_(log_p_nV).sum(dim=-1))
