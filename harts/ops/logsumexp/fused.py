"""The LM head's per-row log-sum-exp (and entropy) as one Triton pass over each fp32 chunk of logits.

`torch.logsumexp` reads the n×V chunk about four times (max, subtract, exp, sum; the subtraction writes a
full-size temporary) and the entropy after it four more (subtract lse, exp, multiply, sum). Here one program walks
one row in tiles of BV columns, reading each logit once, and keeps an online maximum m with per-lane running sums
rescaled whenever m grows: s = Σ exp(z − m) and t = Σ exp(z − m)·(z − m), so lse = m + log s and H = log s − t/s
(t taken relative to m: no cancellation between two numbers of lse's size; README.md beside this file derives it).
fp32 throughout. −inf logits are masked entries: they add nothing (where the reference's entropy has
0·(−inf) = NaN, here its limit 0); a row of −inf only gives lse = −inf and H = NaN, as the reference does; a +inf
or NaN logit gives NaN. Tested against `naive_logsumexp_entropy` under the Triton interpreter on CPU and on CUDA
(tests/ops/logsumexp/test_logsumexp.py).

Legend: n rows of the chunk, V vocabulary, BV the tile's columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_COLUMNS = 4096
NUM_WARPS = 8


@triton.jit
def _logsumexp_entropy_kernel(z, lse, entropy, V, WITH_ENTROPY: tl.constexpr, BV: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = z + row * V
    cols = tl.arange(0, BV)
    m = tl.full([], float("-inf"), tl.float32)
    s_BV = tl.zeros([BV], dtype=tl.float32)
    t_BV = tl.zeros([BV], dtype=tl.float32)
    for start in range(0, V, BV):
        z_BV = tl.load(z_row + start + cols, mask=start + cols < V, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(z_BV, axis=0))
        # While every logit so far is −inf any shift will do; 0 keeps exp(−inf − shift) = 0 instead of NaN.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - shift)
        d_BV = z_BV - shift
        e_BV = tl.exp(d_BV)
        if WITH_ENTROPY:
            # Σ e·(z − m) rebased to the new maximum: alpha·(t + (m − m_new)·s); both are 0 while m is −inf.
            t_BV = alpha * (t_BV + tl.where(m == float("-inf"), 0.0, m - shift) * s_BV)
            t_BV += tl.where(z_BV == float("-inf"), 0.0, e_BV * d_BV)
        s_BV = s_BV * alpha + e_BV
        m = m_new
    s = tl.sum(s_BV, axis=0)
    log_s = tl.log(s)
    tl.store(lse + row, tl.where(m == float("-inf"), 0.0, m) + log_s)
    if WITH_ENTROPY:
        tl.store(entropy + row, log_s - tl.sum(t_BV, axis=0) / s)


def fused_logsumexp_entropy(
    logits_nV: torch.Tensor, *, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`naive_logsumexp_entropy` in one pass: fp32 logits [n, V] (contiguous, left unchanged) → (lse [n], H [n] or
    None) in fp32."""
    if logits_nV.dtype != torch.float32 or logits_nV.dim() != 2 or not logits_nV.is_contiguous():
        raise ValueError(f"fused_logsumexp_entropy: expected contiguous fp32 logits [n, V], got {logits_nV.dtype} "
                         f"{tuple(logits_nV.shape)}")
    num_rows, vocab = logits_nV.shape
    if vocab == 0:
        raise ValueError("fused_logsumexp_entropy: the vocabulary is empty")
    lse_n = torch.empty(num_rows, dtype=torch.float32, device=logits_nV.device)
    entropy_n = torch.empty_like(lse_n) if entropy else None
    if num_rows:
        _logsumexp_entropy_kernel[(num_rows,)](
            logits_nV, lse_n, entropy_n if entropy else lse_n, vocab,
            WITH_ENTROPY=entropy, BV=BLOCK_COLUMNS, num_warps=NUM_WARPS,
        )
    return lse_n, entropy_n
