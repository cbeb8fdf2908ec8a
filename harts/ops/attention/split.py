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


class _Group:
    """Row indices of one group: its queries, its ancestor keys, its own keys (= its queries)."""

    def __init__(self, groups: AttentionGroups, g: int, q_ptr: list[int], kv_ptr: list[int]):
        q_lo, q_hi, kv_lo, kv_hi = q_ptr[g], q_ptr[g + 1], kv_ptr[g], kv_ptr[g + 1]
        self.num_ancestors = (kv_hi - kv_lo) - (q_hi - q_lo)
        assert self.num_ancestors >= 0
        self.in_place = groups.q_in_order and groups.kv_in_order
        if self.in_place:
            # The baseline: rows of a trajectory are consecutive and every key is a query of its group.
            assert self.num_ancestors == 0 and q_lo == kv_lo
            self.rows = slice(q_lo, q_hi)
            self.ancestors = None
        else:
            self.rows = groups.q_index[q_lo:q_hi]
            self.ancestors = groups.kv_index[kv_lo : kv_lo + self.num_ancestors] if self.num_ancestors else None

    def take(self, x_RHD: torch.Tensor) -> torch.Tensor:
        return x_RHD[self.rows] if self.in_place else x_RHD.index_select(0, self.rows)

    def take_ancestors(self, x_RHD: torch.Tensor) -> torch.Tensor:
        return x_RHD.index_select(0, self.ancestors)

    def put(self, target_RHD: torch.Tensor, value_LHD: torch.Tensor) -> None:
        if self.in_place:
            target_RHD[self.rows] = value_LHD
        else:
            target_RHD.index_copy_(0, self.rows, value_LHD)

    def add(self, target_RHD: torch.Tensor, value_LHD: torch.Tensor, ancestors: bool = False) -> None:
        if ancestors:
            target_RHD.index_add_(0, self.ancestors, value_LHD)
        elif self.in_place:
            target_RHD[self.rows] += value_LHD
        else:
            target_RHD.index_add_(0, self.rows, value_LHD)


def _split_groups(groups: AttentionGroups) -> list[_Group]:
    q_ptr, kv_ptr = groups.q_ptr.tolist(), groups.kv_ptr.tolist()
    return [_Group(groups, g, q_ptr, kv_ptr) for g in range(groups.num_groups)]


class _SplitGroupAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_RHE, k_RHE, v_RHF, groups: AttentionGroups, scale: float, kernel: PieceKernel):
        parts = _split_groups(groups)
        num_rows, num_heads = q_RHE.shape[:2]
        out_RHF = q_RHE.new_empty(num_rows, num_heads, v_RHF.shape[-1])
        lse_RH = q_RHE.new_empty(num_rows, num_heads, dtype=torch.float64 if q_RHE.dtype == torch.float64 else torch.float32)
        for part in parts:
            q = _heads_first(part.take(q_RHE))
            out, lse = kernel.forward(q, _heads_first(part.take(k_RHE)), _heads_first(part.take(v_RHF)), True, scale)
            if part.ancestors is not None:
                out_a, lse_a = kernel.forward(q, _heads_first(part.take_ancestors(k_RHE)),
                                              _heads_first(part.take_ancestors(v_RHF)), False, scale)
                merged = torch.logaddexp(lse, lse_a)
                out = (torch.exp(lse - merged) * out.to(merged.dtype)
                       + torch.exp(lse_a - merged) * out_a.to(merged.dtype)).to(out_RHF.dtype)
                lse = merged
            part.put(out_RHF, out[0].transpose(0, 1))
            part.put(lse_RH, lse[0, :, :, 0].transpose(0, 1))
        ctx.save_for_backward(q_RHE, k_RHE, v_RHF, out_RHF, lse_RH)
        ctx.parts, ctx.scale, ctx.kernel = parts, scale, kernel
        return out_RHF

    @staticmethod
    def backward(ctx, dout_RHF):
        q_RHE, k_RHE, v_RHF, out_RHF, lse_RH = ctx.saved_tensors
        dout_RHF = dout_RHF.contiguous()
        dq_RHE, dk_RHE, dv_RHF = torch.zeros_like(q_RHE), torch.zeros_like(k_RHE), torch.zeros_like(v_RHF)
        kernel, scale = ctx.kernel, ctx.scale
        for part in ctx.parts:
            q, dout, out = (_heads_first(part.take(x)) for x in (q_RHE, dout_RHF, out_RHF))
            lse = part.take(lse_RH).transpose(0, 1)[None, :, :, None].contiguous()
            dq, dk, dv = kernel.backward(dout, q, _heads_first(part.take(k_RHE)), _heads_first(part.take(v_RHF)),
                                         out, lse, True, scale)
            if part.ancestors is not None:
                dq_a, dk_a, dv_a = kernel.backward(dout, q, _heads_first(part.take_ancestors(k_RHE)),
                                                   _heads_first(part.take_ancestors(v_RHF)), out, lse, False, scale)
                dq = dq + dq_a
                part.add(dk_RHE, dk_a[0].transpose(0, 1), ancestors=True)
                part.add(dv_RHF, dv_a[0].transpose(0, 1), ancestors=True)
            part.add(dq_RHE, dq[0].transpose(0, 1))
            part.add(dk_RHE, dk[0].transpose(0, 1))
            part.add(dv_RHF, dv[0].transpose(0, 1))
        return dq_RHE, dk_RHE, dv_RHF, None, None, None


def split_group_attention(q_RHE, k_RHE, v_RHF, groups: AttentionGroups, scale: float,
                          kernel: PieceKernel = NAIVE) -> torch.Tensor:
    return _SplitGroupAttention.apply(q_RHE, k_RHE, v_RHF, groups, scale, kernel)


def cudnn_group_attention(q_RHE, k_RHE, v_RHF, groups: AttentionGroups, scale: float) -> torch.Tensor:
    if q_RHE.device.type != "cuda" or q_RHE.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"attention backend 'cudnn' needs bf16 or fp16 tensors on CUDA "
                         f"(got {q_RHE.dtype} on {q_RHE.device.type})")
    return split_group_attention(q_RHE, k_RHE, v_RHF, groups, scale, CUDNN)
