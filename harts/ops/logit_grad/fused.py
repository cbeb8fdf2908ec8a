"""The LM head's logit gradient as one Triton pass over the recomputed fp32 logits.

PyTorch's in-place form (naive.py) reads and writes the n×V fp32 chunk three times (subtract lse,
exp, scale; five with entropy); here each element is read once and its gradient written once,
fp32 inside, rounded once to the output's dtype: in place (fp32) or into a bf16/fp16 tensor for the
half-precision gradient matmuls. Tested against `naive_logit_grad` under the Triton interpreter on
CPU and on CUDA (tests/ops/logit_grad/test_logit_grad.py).

Legend: n rows of the chunk, V vocabulary, BV the tile's columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_COLUMNS = 2048


@triton.jit
def _logit_grad_kernel(z, lse, grad_sum, entropy, grad_entropy, out, V,
                       WITH_ENTROPY: tl.constexpr, BV: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    mask = cols < V
    log_p = tl.load(z + row * V + cols, mask=mask, other=0.0) - tl.load(lse + row)
    scale = tl.load(grad_sum + row)
    if WITH_ENTROPY:
        scale = scale + tl.load(grad_entropy + row) * (log_p + tl.load(entropy + row))
    tl.store(out + row * V + cols, (-tl.exp(log_p) * scale).to(out.dtype.element_ty), mask=mask)


def fused_logit_grad(
    logits_nV: torch.Tensor, lse_n: torch.Tensor, grad_sum_n: torch.Tensor,
    entropy_n: torch.Tensor | None = None, grad_entropy_n: torch.Tensor | None = None,
    *, out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`naive_logit_grad` in one pass: fp32 logits [n, V] (contiguous), fp32 per-row vectors [n]."""
    if logits_nV.dtype != torch.float32 or logits_nV.dim() != 2 or not logits_nV.is_contiguous():
        raise ValueError(f"fused_logit_grad: expected contiguous fp32 logits [n, V], got {logits_nV.dtype} "
                         f"{tuple(logits_nV.shape)}")
    num_rows, vocab = logits_nV.shape
    out = logits_nV if out_dtype is None else torch.empty_like(logits_nV, dtype=out_dtype)
    with_entropy = grad_entropy_n is not None
    if num_rows and vocab:
        _logit_grad_kernel[(num_rows, triton.cdiv(vocab, BLOCK_COLUMNS))](
            logits_nV, lse_n.contiguous(), grad_sum_n.contiguous(),
            entropy_n.contiguous() if with_entropy else lse_n, grad_entropy_n.contiguous() if with_entropy else lse_n,
            out, vocab, WITH_ENTROPY=with_entropy, BV=BLOCK_COLUMNS,
        )
    return out
