"""The MoE combine as one batched product: out_ND = p_N1K @ y_NKD in p's precision (y cast up).

Legend: N rows, K experts per row (top-k), D hidden size.
"""

from __future__ import annotations

import torch


def naive_combine(probs_NK: torch.Tensor, y_NKD: torch.Tensor) -> torch.Tensor:
    """[N, D] = Σ_k probs[:, k] · y[:, k] computed in probs' dtype."""
    return torch.bmm(probs_NK.unsqueeze(1), y_NKD.to(probs_NK.dtype)).squeeze(1)


def naive_gather_combine(probs_NK: torch.Tensor | None, y_RD: torch.Tensor, rows_NK: torch.Tensor,
                         add_ND: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[N, D] = Σ_k probs[:, k] · y[rows[:, k]] in probs' dtype (`naive_combine` of the gathered rows), plus
    `add_ND` cast to that dtype, rounded to `out_dtype` (default probs' dtype); without weights the plain sum
    over k in y's dtype (no addend, no output dtype)."""
    check_addend(probs_NK, add_ND, out_dtype, (rows_NK.shape[0], y_RD.shape[1]), "naive_gather_combine")
    y_NKD = y_RD.index_select(0, rows_NK.reshape(-1)).view(*rows_NK.shape, y_RD.shape[1])
    if probs_NK is None:
        return y_NKD.sum(dim=1)
    total = naive_combine(probs_NK, y_NKD)
    if add_ND is not None:
        total = total + add_ND.to(total.dtype)
    return total if out_dtype is None else total.to(out_dtype)


def check_addend(probs_NK: torch.Tensor | None, add_ND: torch.Tensor | None, out_dtype: torch.dtype | None,
                 shape: tuple[int, int], name: str) -> None:
    """ValueError unless the addend and output dtype come with weights and the addend is [N, D]."""
    if probs_NK is None and (add_ND is not None or out_dtype is not None):
        raise ValueError(f"{name}: an addend and an output dtype need weights (the plain sum takes neither)")
    if add_ND is not None and tuple(add_ND.shape) != tuple(shape):
        raise ValueError(f"{name}: the addend has shape {tuple(add_ND.shape)}, expected {tuple(shape)}")
