"""MoE expert selection: each row's top-k experts by selection score, optionally group-limited
(DeepSeek-V3's `noaux_tc`, BailingHybrid's n_group / topk_group), best first, ties to the lower index.

- `naive_select_experts`: stable sorts (naive.py), the reference.
- `fused_select_experts`: one Triton kernel (fused.py, CUDA; imported lazily), equal to the reference bit for bit.
- `select_experts`: the kernel on CUDA for fp32/bf16/fp16 scores, else the reference (fp64: the tests' exact mode).
"""

import torch

from harts.ops.routing.naive import naive_select_experts

__all__ = ["fused_select_experts", "naive_select_experts", "select_experts"]


def select_experts(selection_NE: torch.Tensor, top_k: int, num_groups: int = 1, topk_groups: int = 1) -> torch.Tensor:
    """int64 [N, top_k] (`naive_select_experts`): the fused kernel on CUDA for fp32/bf16/fp16 scores, else the
    reference."""
    if selection_NE.is_cuda and selection_NE.dtype in (torch.float32, torch.bfloat16, torch.float16):
        from harts.ops.routing.fused import fused_select_experts

        return fused_select_experts(selection_NE, top_k, num_groups, topk_groups)
    return naive_select_experts(selection_NE, top_k, num_groups, topk_groups)


def __getattr__(name: str):
    if name == "fused_select_experts":
        from harts.ops.routing import fused

        return fused.fused_select_experts
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
