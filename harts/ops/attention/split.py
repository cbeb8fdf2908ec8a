"""Group attention as dense per-group pieces merged by log-sum-exp (the `cudnn` backend).

cuDNN's fused attention is the fastest kernel on Hopper for the MLA shapes (head dim 192 for
queries and keys, 128 for values, no padding of v), but its causal mask is aligned top-left and its
ragged (packed) mode is slower than one dense call per sequence. A group of `AttentionGroups` needs
the bottom-right causal mask over [h ancestors | l own rows]. So each group runs as at most two
dense pieces:
- own: the l queries against the group's own l keys, causal (square, so top-left = bottom-right);
- ancestors (h > 0): the l queries against the h ancestor keys, no mask.
The outputs are merged exactly by their log-sum-exps, o = Σ_p exp(lse_p − lse)·o_p with
lse = log Σ_p exp(lse_p). The backward runs each piece's attention backward with the *merged*
output and log-sum-exp (the flash/ring-attention identity: dS = P ∘ (dP − rowsum(dO ∘ O)) with the
global O and lse gives each piece's share of the gradient), so no gradient flows through lse.

A `PieceKernel` computes one dense piece and its backward on [1, H, L, D] tensors. `CUDNN` calls
torch's cuDNN attention ops; `NAIVE` is the same contract in plain matmuls (fp32 or fp64), the
reference on any device: `split_group_attention(..., kernel=NAIVE)` is tested against
`naive_group_attention`, forward and gradients, and the cuDNN kernel against the naive one on CUDA.
Legend: R rows, H heads, E query/key head dim, F value head dim, L queries, S keys of a piece.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from harts.ops.attention.groups import AttentionGroups


@dataclass(frozen=True)
class PieceKernel:
    name: str
    forward: Callable
    """(q_1HLE, k_1HSE, v_1HSF, causal, scale) -> (out_1HLF, lse_1HL1 float32)"""
    backward: Callable
    """(dout_1HLF, q, k, v, out_1HLF, lse_1HL1, causal, scale) -> (dq, dk, dv)"""


def _naive_scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = torch.matmul(q.to(compute), k.to(compute).transpose(-1, -2)) * scale
    if causal:
        assert q.shape[-2] == k.shape[-2], "causal pieces are square"
        future = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def _naive_forward(q, k, v, causal: bool, scale: float):
    scores = _naive_scores(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    out = torch.matmul(torch.exp(scores - lse), v.to(scores.dtype))
    return out.to(q.dtype), lse.float() if q.dtype != torch.float64 else lse


def _naive_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    scores = _naive_scores(q, k, causal, scale)
    compute = scores.dtype
    probs = torch.exp(scores - lse.to(compute))
    dout_c = dout.to(compute)
    dv = torch.matmul(probs.transpose(-1, -2), dout_c)
    delta = (dout_c * out.to(compute)).sum(-1, keepdim=True)
    dscores = probs * (torch.matmul(dout_c, v.to(compute).transpose(-1, -2)) - delta) * scale
    dq = torch.matmul(dscores, k.to(compute))
    dk = torch.matmul(dscores.transpose(-1, -2), q.to(compute))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


NAIVE = PieceKernel("naive", _naive_forward, _naive_backward)


def _cudnn_forward(q, k, v, causal: bool, scale: float):
    result = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return result[0], result[1]


_NO_DROPOUT: dict[torch.device, torch.Tensor] = {}


def _cudnn_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    # Dropout is off: the philox seed and offset are read by nothing; one zero tensor serves both.
    unused = _NO_DROPOUT.setdefault(q.device, torch.zeros((), dtype=torch.int64, device=q.device))
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, unused, unused, None, None, None, q.shape[-2], k.shape[-2], 0.0, causal,
        scale=scale,
    )


CUDNN = PieceKernel("cudnn", _cudnn_forward, _cudnn_backward)


def _heads_first(x_LHD: torch.Tensor) -> torch.Tensor:
    """[L, H, D] rows → a [1, H, L, D] view (no copy; cuDNN reads the strided layout)."""
    return x_LHD.transpose(0, 1).unsqueeze(0)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class _Group:
    """One group's two pieces, in bucketed shapes.

    cuDNN builds an execution plan per new (queries, keys) shape (~0.1 s each on an H200), and
    trajectory and group lengths change every step, so every piece is padded to a multiple of a
    bucket: the own piece to `query_bucket` rows, the ancestor piece to `query_bucket` queries and
    a multiple of `key_bucket` keys. The ancestors left over (h mod key_bucket, the r nearest ones)
    move into the own piece, in front of the own rows, as extra queries and keys: with the causal
    (top-left) mask the l real queries, now at positions r.., see those r ancestors and their own
    earlier rows, exactly the bottom-right mask. Padding rows are zeros at the end (invisible to the
    real queries under the causal mask; in the ancestor piece only queries are padded). The extra
    queries' outputs are dropped and their output gradients are zero, so they add nothing to any
    gradient."""

    def __init__(self, groups: AttentionGroups, g: int, q_ptr: list[int], kv_ptr: list[int],
                 query_bucket: int, key_bucket: int):
        q_lo, q_hi, kv_lo, kv_hi = q_ptr[g], q_ptr[g + 1], kv_ptr[g], kv_ptr[g + 1]
        self.num_queries = q_hi - q_lo
        num_ancestors = (kv_hi - kv_lo) - self.num_queries
        assert num_ancestors >= 0
        self.num_front = num_ancestors % key_bucket
        self.num_far = num_ancestors - self.num_front
        if groups.q_in_order and groups.kv_in_order:
            # The baseline: a trajectory's rows are consecutive and it has no ancestors.
            assert num_ancestors == 0 and q_lo == kv_lo
            self.queries = self.own = slice(q_lo, q_hi)
        else:
            self.queries = groups.q_index[q_lo:q_hi]
            self.own = groups.kv_index[kv_lo + self.num_far : kv_hi]
        self.far = groups.kv_index[kv_lo : kv_lo + self.num_far] if self.num_far else None
        self.own_rows = _round_up(self.num_front + self.num_queries, query_bucket)
        self.far_rows = _round_up(self.num_queries, query_bucket)

    def gather(self, x_RHD: torch.Tensor, rows, num_rows: int, offset: int = 0) -> torch.Tensor:
        """[1, H, num_rows, D]: x's `rows` at positions offset.., zeros elsewhere."""
        count = rows.stop - rows.start if isinstance(rows, slice) else len(rows)
        if offset == 0 and count == num_rows:
            return _heads_first(x_RHD[rows] if isinstance(rows, slice) else x_RHD.index_select(0, rows))
        out = x_RHD.new_zeros(num_rows, *x_RHD.shape[1:])
        target = out[offset : offset + count]
        if isinstance(rows, slice):
            target.copy_(x_RHD[rows])
        else:
            torch.index_select(x_RHD, 0, rows, out=target)
        return _heads_first(out)

    def real(self, piece_1HLD: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """[l, H, D]: the real queries' rows of a piece's output."""
        return piece_1HLD[0, :, offset : offset + self.num_queries].transpose(0, 1)

    def scatter(self, target_RHD: torch.Tensor, rows, value_LHD: torch.Tensor, add: bool) -> None:
        if isinstance(rows, slice):
            if add:
                target_RHD[rows] += value_LHD
            else:
                target_RHD[rows] = value_LHD
        elif add:
            target_RHD.index_add_(0, rows, value_LHD)
        else:
            target_RHD.index_copy_(0, rows, value_LHD)


def _split_groups(groups: AttentionGroups, query_bucket: int, key_bucket: int) -> list[_Group]:
    q_ptr, kv_ptr = groups.q_ptr.tolist(), groups.kv_ptr.tolist()
    return [_Group(groups, g, q_ptr, kv_ptr, query_bucket, key_bucket) for g in range(groups.num_groups)]


class _SplitGroupAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_RHE, k_RHE, v_RHF, groups: AttentionGroups, scale: float, kernel: PieceKernel,
                query_bucket: int, key_bucket: int):
        parts = _split_groups(groups, query_bucket, key_bucket)
        num_rows, num_heads = q_RHE.shape[:2]
        out_RHF = q_RHE.new_empty(num_rows, num_heads, v_RHF.shape[-1])
        lse_RH = q_RHE.new_empty(num_rows, num_heads, dtype=torch.float64 if q_RHE.dtype == torch.float64 else torch.float32)
        for p in parts:
            own = [p.gather(x, p.own, p.own_rows) for x in (q_RHE, k_RHE, v_RHF)]
            out, lse = kernel.forward(*own, True, scale)
            out, lse = p.real(out, p.num_front), p.real(lse, p.num_front)
            if p.far is not None:
                far_out, far_lse = kernel.forward(p.gather(q_RHE, p.queries, p.far_rows), p.gather(k_RHE, p.far, p.num_far),
                                                  p.gather(v_RHF, p.far, p.num_far), False, scale)
                far_out, far_lse = p.real(far_out), p.real(far_lse)
                merged = torch.logaddexp(lse, far_lse)
                out = (torch.exp(lse - merged) * out.to(merged.dtype)
                       + torch.exp(far_lse - merged) * far_out.to(merged.dtype)).to(out_RHF.dtype)
                lse = merged
            p.scatter(out_RHF, p.queries, out, add=False)
            p.scatter(lse_RH, p.queries, lse[..., 0], add=False)
        ctx.save_for_backward(q_RHE, k_RHE, v_RHF, out_RHF, lse_RH)
        ctx.parts, ctx.scale, ctx.kernel = parts, scale, kernel
        return out_RHF

    @staticmethod
    def backward(ctx, dout_RHF):
        q_RHE, k_RHE, v_RHF, out_RHF, lse_RH = ctx.saved_tensors
        dq_RHE, dk_RHE, dv_RHF = torch.zeros_like(q_RHE), torch.zeros_like(k_RHE), torch.zeros_like(v_RHF)
        kernel, scale = ctx.kernel, ctx.scale
        # Rows that are not a real query get lse = +inf: their probabilities exp(s − lse) are 0.
        lse_RH1 = lse_RH.unsqueeze(-1)
        for p in ctx.parts:
            for far in (False, True):
                if far and p.far is None:
                    continue
                num_rows, offset = (p.far_rows, 0) if far else (p.own_rows, p.num_front)
                keys = p.far if far else p.own
                num_keys = p.num_far if far else p.own_rows
                dout, out = (p.gather(x, p.queries, num_rows, offset) for x in (dout_RHF, out_RHF))
                lse = p.gather(lse_RH1, p.queries, num_rows, offset).contiguous()
                if num_rows != p.num_queries:
                    lse[0, :, :offset] = float("inf")
                    lse[0, :, offset + p.num_queries :] = float("inf")
                q = p.gather(q_RHE, p.queries, num_rows, offset) if far else p.gather(q_RHE, p.own, num_rows)
                dq, dk, dv = kernel.backward(dout, q, p.gather(k_RHE, keys, num_keys), p.gather(v_RHF, keys, num_keys),
                                             out, lse, not far, scale)
                p.scatter(dq_RHE, p.queries, p.real(dq, offset), add=True)
                num_real_keys = p.num_far if far else p.num_front + p.num_queries
                p.scatter(dk_RHE, keys, dk[0, :, :num_real_keys].transpose(0, 1), add=True)
                p.scatter(dv_RHF, keys, dv[0, :, :num_real_keys].transpose(0, 1), add=True)
        return dq_RHE, dk_RHE, dv_RHF, None, None, None, None, None


QUERY_BUCKET = 64
"""Query rows of a piece are padded to a multiple of this (cuDNN's query tile: no extra tiles)."""
KEY_BUCKET = 256
"""Ancestor keys of a piece are a multiple of this; the rest join the own piece."""


def split_group_attention(q_RHE, k_RHE, v_RHF, groups: AttentionGroups, scale: float, kernel: PieceKernel = NAIVE,
                          query_bucket: int = QUERY_BUCKET, key_bucket: int = KEY_BUCKET) -> torch.Tensor:
    return _SplitGroupAttention.apply(q_RHE, k_RHE, v_RHF, groups, scale, kernel, query_bucket, key_bucket)


def cudnn_group_attention(q_RHE, k_RHE, v_RHF, groups: AttentionGroups, scale: float) -> torch.Tensor:
    if q_RHE.device.type != "cuda" or q_RHE.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"attention backend 'cudnn' needs bf16 or fp16 tensors on CUDA "
                         f"(got {q_RHE.dtype} on {q_RHE.device.type})")
    return split_group_attention(q_RHE, k_RHE, v_RHF, groups, scale, CUDNN)
