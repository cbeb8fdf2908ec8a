"""The MoE combine as one batched product: out_ND = p_N1K @ y_NKD in p's precision (y cast up).

Legend: N rows, K experts per row (top-k), D hidden size.
"""

from __future__ import annotations

import torch


def naive_combine(probs_NK: torch.Tensor, y_NKD: torch.Tensor) -> torch.Tensor:
    """[N, D] = Σ_k probs[:, k] · y[:, k] computed in probs' dtype."""
    return torch.bmm(probs_NK.unsqueeze(1), y_NKD.to(probs_NK.dtype)).squeeze(1)
