"""Group attention as dense per-group pieces merged by log-sum-exp (the `cudnn` backend).

cuDNN's fused attention is the fastest kernel on Hopper for the MLA shapes (head dim 192 for
queries and keys, 128 for values, no padding of v), but its causal mask is aligned top-left and its
ragged (packed) mode is slower than one dense call per sequence. A group of `AttentionGroups` needs
the bottom-right causal mask over [h ancestors | l own rows]. So each group runs as dense pieces:
- own: the l queries against the group's own l keys, causal (square, so top-left = bottom-right);
- far (h > 0): the l queries against the ancestor keys, no mask, in chunks of a fixed number of
  keys (one batched call for a group with few queries).
The outputs are merged exactly by their log-sum-exps, o = Σ_p exp(lse_p − lse)·o_p with
lse = log Σ_p exp(lse_p). The backward runs each piece's attention backward with the *merged*
output and log-sum-exp (the flash/ring-attention identity: dS = P ∘ (dP − rowsum(dO ∘ O)) with the
global O and lse gives each piece's share of the gradient), so no gradient flows through lse.
Shapes are bucketed (`Buckets`, `_Group`) so that cuDNN builds a bounded set of execution plans
while lengths change from step to step.

A `PieceKernel` computes one dense piece and its backward on [B, H, L, D] tensors. `CUDNN` calls
torch's cuDNN attention ops; `NAIVE` is the same contract in plain matmuls (fp32 or fp64), the
reference on any device: `split_group_attention(..., kernel=NAIVE)` is tested against
`naive_group_attention`, forward and gradients, and the cuDNN kernel against the naive one on CUDA.
Legend: R rows, H heads, E query/key head dim, F value head dim, B batch, L queries, K keys of a piece.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from harts.ops.attention.query_groups import AttentionGroups


@dataclass(frozen=True)
class PieceKernel:
    name: str
    forward: Callable
    """(q_BHLE, k_BHKE, v_BHKF, causal, scale) -> (out_BHLF, lse_BHL1 float32)"""
    backward: Callable
    """(dout_BHLF, q, k, v, out_BHLF, lse_BHL1, causal, scale) -> (dq, dk, dv)"""


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
    if q.device not in _NO_DROPOUT:
        _NO_DROPOUT[q.device] = torch.zeros((), dtype=torch.int64, device=q.device)
    unused = _NO_DROPOUT[q.device]
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, unused, unused, None, None, None, q.shape[-2], k.shape[-2], 0.0, causal,
        scale=scale,
    )


CUDNN = PieceKernel("cudnn", _cudnn_forward, _cudnn_backward)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _count(rows) -> int:
    return rows.stop - rows.start if isinstance(rows, slice) else len(rows)


def _take(x_RHD: torch.Tensor, rows) -> torch.Tensor:
    return x_RHD[rows] if isinstance(rows, slice) else x_RHD.index_select(0, rows)


def _padded(x_RHD: torch.Tensor, rows, num_rows: int, offset: int = 0) -> torch.Tensor:
    """[num_rows, H, D]: x's `rows` at positions offset.., zeros elsewhere."""
    count = _count(rows)
    if offset == 0 and count == num_rows:
        return _take(x_RHD, rows)
    out = x_RHD.new_zeros(num_rows, *x_RHD.shape[1:])
    target = out[offset : offset + count]
    if isinstance(rows, slice):
        target.copy_(x_RHD[rows])
    else:
        torch.index_select(x_RHD, 0, rows, out=target)
    return out


def _scatter(target_RHD: torch.Tensor, rows, value_LHD: torch.Tensor, add: bool) -> None:
    if isinstance(rows, slice):
        if add:
            target_RHD[rows] += value_LHD
        else:
            target_RHD[rows] = value_LHD
    elif add:
        target_RHD.index_add_(0, rows, value_LHD)
    else:
        target_RHD.index_copy_(0, rows, value_LHD)


@dataclass(frozen=True, eq=False)
class _Piece:
    """One dense call: `batch` elements, each the rows `q_rows` (padded to num_q) against its own
    num_k keys (element b: keys `k_rows[b·num_k:(b+1)·num_k]`, zeros past the end of k_rows). The
    group's real queries sit at positions real_offset.. of the queries."""

    q_rows: slice | torch.Tensor
    num_q: int
    real_offset: int
    k_rows: slice | torch.Tensor
    num_k: int
    batch: int
    causal: bool

    @property
    def query_layout(self) -> tuple:
        """Pieces with one query layout (a group's far pieces) share their query-side tensors."""
        return id(self.q_rows), self.num_q, self.real_offset

    def queries(self, x_RHD: torch.Tensor) -> torch.Tensor:
        """[num_q, H, D]: the query rows, zeros past them."""
        return _padded(x_RHD, self.q_rows, self.num_q)

    def per_query(self, x_RHD: torch.Tensor, real_rows, fill: float = 0.0) -> torch.Tensor:
        """[num_q, H, D]: x of the real queries in their positions (output gradients, outputs, lse),
        `fill` elsewhere."""
        x = _padded(x_RHD, real_rows, self.num_q, self.real_offset)
        if fill and self.num_q != _count(real_rows):
            x[: self.real_offset] = fill
            x[self.real_offset + _count(real_rows) :] = fill
        return x

    def keys(self, x_RHD: torch.Tensor) -> torch.Tensor:
        x = _padded(x_RHD, self.k_rows, self.batch * self.num_k)
        return x.view(self.batch, self.num_k, *x.shape[1:]).transpose(1, 2)

    def repeat(self, x_LHD: torch.Tensor) -> torch.Tensor:
        """[num_q, H, D] → [batch, H, num_q, D], one copy per batch element."""
        x = x_LHD.transpose(0, 1).unsqueeze(0)
        return x if self.batch == 1 else x.expand(self.batch, -1, -1, -1).contiguous()

    def real(self, x_BHLD: torch.Tensor, num_real: int) -> torch.Tensor:
        """[batch, l, H, D]: the rows of the real queries."""
        return x_BHLD[:, :, self.real_offset : self.real_offset + num_real].transpose(1, 2)

    def key_rows(self, x_BHKD: torch.Tensor) -> torch.Tensor:
        """[count(k_rows), H, D]: a key-side result (dk, dv) of the real key rows."""
        x = x_BHKD.transpose(1, 2).reshape(-1, *x_BHKD.shape[1:2], x_BHKD.shape[-1])
        return x[: _count(self.k_rows)]


@dataclass(frozen=True)
class Buckets:
    """Padded shapes of the pieces (cuDNN builds an execution plan per new shape, ~0.1 s on an H200)."""

    query: int = 64
    """Query rows of a piece: at least this many (cuDNN's query tile, so no extra tiles)."""
    powers_below: int = 4096
    """Up to this many, query rows round up to a power of two (small pieces use a fraction of the GPU,
    so their padding costs little time and they take few shapes) ..."""
    step_above: int = 256
    """... above it, to a multiple of this (large causal pieces: little padding)."""
    key: int = 256
    """Ancestor keys of a far piece: a multiple of this; the leftover nearest ones join the own piece."""
    key_chunk: int = 4096
    """Far keys are split into chunks of this many (and one last piece of the rest, a multiple of
    `key`), merged like the pieces: the far shapes stay in a bounded set however long the paths."""
    batch_below: int = 1024
    """A group with at most this many (padded) queries runs its chunks as one batched call (a few
    query tiles alone would leave most of the GPU idle); larger groups run one call per chunk (no
    copies of their queries)."""

    def rows(self, n: int) -> int:
        """The padded number of query rows for n real ones."""
        if n <= self.powers_below:
            return max(self.query, 1 << max(n - 1, 0).bit_length())
        return _round_up(n, self.step_above)


class _Group:
    """One group's pieces in bucketed shapes.

    Trajectory and group lengths change every step, so every piece is padded to bucketed shapes
    (`Buckets`): the own piece to `Buckets.rows` rows, a far piece to `Buckets.rows` queries and
    `key_chunk` keys (the last one: the rest, a multiple of `key`). The ancestors left over (h mod
    `key`, the r nearest ones) move into the own piece, in front of the own rows, as extra queries
    and keys: under the causal (top-left) mask the l real queries, now at positions r.., see those
    r ancestors and their own earlier rows, exactly the bottom-right mask. Padding rows are zeros at
    the end (invisible to the real queries under the causal mask; far pieces pad only queries).
    Outputs of the extra queries are dropped and their output gradients are zero, so they add nothing
    to any gradient."""

    def __init__(self, groups: AttentionGroups, g: int, q_ptr: list[int], kv_ptr: list[int], buckets: Buckets):
        q_lo, q_hi, kv_lo, kv_hi = q_ptr[g], q_ptr[g + 1], kv_ptr[g], kv_ptr[g + 1]
        self.num_queries = q_hi - q_lo
        num_ancestors = (kv_hi - kv_lo) - self.num_queries
        assert num_ancestors >= 0
        num_front = num_ancestors % buckets.key
        num_far = num_ancestors - num_front
        if groups.q_in_order and groups.kv_in_order:
            # The baseline: a trajectory's rows are consecutive and it has no ancestors.
            assert num_ancestors == 0 and q_lo == kv_lo
            self.queries = own = slice(q_lo, q_hi)
        else:
            self.queries = groups.q_index[q_lo:q_hi]
            own = groups.kv_index[kv_lo + num_far : kv_hi]
        num_own = buckets.rows(num_front + self.num_queries)
        self.pieces = [_Piece(own, num_own, num_front, own, num_own, 1, True)]
        if num_far:
            far = groups.kv_index[kv_lo : kv_lo + num_far]
            num_q = buckets.rows(self.num_queries)
            chunk = buckets.key_chunk
            chunks = num_far // chunk
            if chunks and num_q <= buckets.batch_below:
                self.pieces.append(_Piece(self.queries, num_q, 0, far[: chunks * chunk], chunk, chunks, False))
            else:
                self.pieces += [_Piece(self.queries, num_q, 0, far[c * chunk : (c + 1) * chunk], chunk, 1, False)
                                for c in range(chunks)]
            if num_far > chunks * chunk:
                rest = far[chunks * chunk :]
                self.pieces.append(_Piece(self.queries, num_q, 0, rest, len(rest), 1, False))


def _split_groups(groups: AttentionGroups, buckets: Buckets) -> list[_Group]:
    q_ptr, kv_ptr = groups.q_ptr.tolist(), groups.kv_ptr.tolist()
    return [_Group(groups, g, q_ptr, kv_ptr, buckets) for g in range(groups.num_groups)]


class _SplitGroupAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_RHE, k_RHE, v_RHF, groups: AttentionGroups, scale: float, kernel: PieceKernel,
                buckets: Buckets):
        parts = _split_groups(groups, buckets)
        num_rows, num_heads = q_RHE.shape[:2]
        out_RHF = q_RHE.new_empty(num_rows, num_heads, v_RHF.shape[-1])
        lse_RH1 = q_RHE.new_empty(num_rows, num_heads, 1, dtype=torch.float64 if q_RHE.dtype == torch.float64 else torch.float32)
        for part in parts:
            outs, lses, queries = [], [], {}
            for piece in part.pieces:
                if piece.query_layout not in queries:
                    queries[piece.query_layout] = piece.queries(q_RHE)
                q = piece.repeat(queries[piece.query_layout])
                out, lse = kernel.forward(q, piece.keys(k_RHE), piece.keys(v_RHF), piece.causal, scale)
                outs.append(piece.real(out, part.num_queries))
                lses.append(piece.real(lse, part.num_queries))
            out, lse = torch.cat(outs), torch.cat(lses)
            if len(out) > 1:
                merged = torch.logsumexp(lse, dim=0)
                out = (torch.exp(lse - merged) * out.to(merged.dtype)).sum(0).to(out_RHF.dtype)
                lse = merged
            else:
                out, lse = out[0], lse[0]
            _scatter(out_RHF, part.queries, out, add=False)
            _scatter(lse_RH1, part.queries, lse, add=False)
        ctx.save_for_backward(q_RHE, k_RHE, v_RHF, out_RHF, lse_RH1)
        ctx.parts, ctx.scale, ctx.kernel = parts, scale, kernel
        return out_RHF

    @staticmethod
    def backward(ctx, dout_RHF):
        q_RHE, k_RHE, v_RHF, out_RHF, lse_RH1 = ctx.saved_tensors
        dq_RHE, dk_RHE, dv_RHF = torch.zeros_like(q_RHE), torch.zeros_like(k_RHE), torch.zeros_like(v_RHF)
        for part in ctx.parts:
            query_sides = {}
            for piece in part.pieces:
                if piece.query_layout not in query_sides:
                    # Rows that are not a real query get lse = +inf: their probabilities exp(s − lse) are 0.
                    query_sides[piece.query_layout] = (
                        piece.per_query(dout_RHF, part.queries), piece.queries(q_RHE),
                        piece.per_query(out_RHF, part.queries), piece.per_query(lse_RH1, part.queries, float("inf")),
                    )
                dout, q, out, lse = (piece.repeat(x) for x in query_sides[piece.query_layout])
                dq, dk, dv = ctx.kernel.backward(dout, q, piece.keys(k_RHE), piece.keys(v_RHF), out, lse.contiguous(),
                                                 piece.causal, ctx.scale)
                _scatter(dq_RHE, part.queries, piece.real(dq, part.num_queries).sum(0), add=True)
                _scatter(dk_RHE, piece.k_rows, piece.key_rows(dk), add=True)
                _scatter(dv_RHF, piece.k_rows, piece.key_rows(dv), add=True)
        return dq_RHE, dk_RHE, dv_RHF, None, None, None, None


def split_group_attention(q_RHE, k_RHE, v_RHF, groups: AttentionGroups, scale: float, kernel: PieceKernel = NAIVE,
                          buckets: Buckets = Buckets()) -> torch.Tensor:
    return _SplitGroupAttention.apply(q_RHE, k_RHE, v_RHF, groups, scale, kernel, buckets)


def cudnn_group_attention(q_RHE, k_RHE, v_RHF, groups: AttentionGroups, scale: float) -> torch.Tensor:
    if q_RHE.device.type != "cuda" or q_RHE.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"attention backend 'cudnn' needs bf16 or fp16 tensors on CUDA "
                         f"(got {q_RHE.dtype} on {q_RHE.device.type})")
    return split_group_attention(q_RHE, k_RHE, v_RHF, groups, scale, CUDNN)
