"""Reference expert selection: stable sorts, so that ties go to the lower index (the fused kernel's rule)."""

from __future__ import annotations

import torch


def check_selection(selection_NE: torch.Tensor, top_k: int, num_groups: int, topk_groups: int) -> None:
    """ValueError for a selection no row can make."""
    if selection_NE.dim() != 2:
        raise ValueError(f"select_experts: expected selection scores [N, E], got shape {tuple(selection_NE.shape)}")
    num_experts = selection_NE.shape[1]
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"select_experts: num_groups {num_groups} must divide the {num_experts} experts")
    group_size = num_experts // num_groups
    if num_groups > 1 and group_size < 2:
        raise ValueError(f"select_experts: groups of {group_size} expert; a group scores its two best")
    if not 1 <= topk_groups <= num_groups:
        raise ValueError(f"select_experts: need 1 <= topk_groups <= num_groups, got {topk_groups} and {num_groups}")
    allowed = num_experts if num_groups == 1 else topk_groups * group_size
    if not 1 <= top_k <= allowed:
        raise ValueError(f"select_experts: top_k {top_k} must lie in 1..{allowed}, the experts a row may pick")


def _top_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest along the last dimension, largest first, ties to the lower index."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def naive_select_experts(
    selection_NE: torch.Tensor, top_k: int, num_groups: int = 1, topk_groups: int = 1
) -> torch.Tensor:
    """int64 [N, top_k]: each row's top_k experts by selection score, best first, ties to the lower index; with
    `num_groups` > 1 only among the experts of its `topk_groups` best groups (E/num_groups consecutive experts), a
    group scoring the sum of its two best scores rounded to the scores' dtype (ties to the lower group). NaN of
    either sign ranks above +inf and −0 ties with +0 (the CPU sort's order)."""
    check_selection(selection_NE, top_k, num_groups, topk_groups)
    rows, num_experts = selection_NE.shape
    if num_groups > 1:
        grouped = selection_NE.view(rows, num_groups, num_experts // num_groups)
        best_two = torch.sort(grouped, dim=-1, descending=True, stable=True).values
        group_scores = best_two[..., 0] + best_two[..., 1]
        allowed = torch.zeros(rows, num_groups, dtype=torch.bool, device=selection_NE.device)
        allowed.scatter_(1, _top_indices(group_scores, topk_groups), True)
        # The allowed experts first, each part in score order (two stable sorts): a masked expert ranks below
        # every allowed one, −inf included, where a fill with −inf would tie with a −inf score.
        by_score = _top_indices(selection_NE, num_experts)
        allowed_by_score = allowed.repeat_interleave(num_experts // num_groups, dim=1).gather(1, by_score)
        return by_score.gather(1, _top_indices(allowed_by_score.to(torch.int8), top_k))
    return _top_indices(selection_NE, top_k)
