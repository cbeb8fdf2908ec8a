"""Operators of the compact execution: KDA linear attention (`harts.ops.kda`), Gated DeltaNet on its machinery
(`harts.ops.gdn`) and attention groups
(`harts.ops.attention`), the fused per-row kernels of both executions (`harts.ops.conv`,
`harts.ops.swiglu`, `harts.ops.combine`, `harts.ops.norm_gate`), the MoE's expert selection
(`harts.ops.routing`) and the LM head's forward log-sum-exp and
entropy (`harts.ops.logsumexp`) and logit gradient (`harts.ops.logit_grad`). Each has a plain reference next to its
fast path."""

import torch


def uses_fp32_kernels(x: torch.Tensor) -> bool:
    """Whether rows x take the fused Triton kernels that compute in fp32 (conv + SiLU, SwiGLU): on CUDA,
    but not for fp64 rows (the tests' exact mode), which keep their PyTorch references."""
    return x.is_cuda and x.dtype != torch.float64
