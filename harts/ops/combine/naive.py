"""The MoE combine as one batched product: out_ND = p_N1K @ y_NKD in p's precision (y cast up).

Legend: N rows, K experts per row (top-k), D hidden size.
"""

from __future__ import annotations

import torch


def naive_combine(probs_NK: torch.Tensor, y_NKD: torch.Tensor) -> torch.Tensor:
    """[N, D] = Σ_k probs[:, k] · y[:, k] computed in probs' dtype."""
    return torch.bmm(probs_NK.unsqueeze(1), y_NKD.to(probs_NK.dtype)).squeeze(1)


def naive_gather_combine(probs_NK: torch.Tensor | None, y_RD: torch.Tensor, rows_NK: torch.Tensor) -> torch.Tensor:
    """[N, D] = Σ_k probs[:, k] · y[rows[:, k]] in probs' dtype (`naive_combine` of the gathered rows); without
    weights the plain sum over k in y's dtype."""
    y_NKD = y_RD.index_select(0, rows_NK.reshape(-1)).view(*rows_NK.shape, y_RD.shape[1])
    if probs_NK is None:
        return y_NKD.sum(dim=1)
    return naive_combine(probs_NK, y_NKD)
