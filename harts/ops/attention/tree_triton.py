"""Tree attention over rows in place, in Triton: the `triton_tree` MLA backend's kernels.

`tree_attention(q, k, v, plan, scale)` computes softmax attention under the DFS tree mask (query row r sees key
row c iff c <= r < subtree_end[c]; harts.ops.attention.tree_blocks) reading K and V where they are, with no copy of
a group's ancestor rows: each query tile walks the key tiles of its list (`TreePlan`: the ancestors' tiles and its
own causal part), full tiles unmasked and partial ones masked by subtree_end, with an online softmax in fp32,
and writes O and the log-sum-exp. The backward is deterministic (no atomics): a preprocessing kernel forms
delta = rowsum(dO ∘ O), a dK/dV kernel walks each key tile's transposed list (the query tiles that see it) and a
dQ kernel the query tiles' lists again (FlashAttention-2's split of the backward, with P recomputed from lse).
The three kernels share their math through @triton.jit helpers, which Triton inlines: the scores over the two
head-dim parts (`_scores`, q·kᵀ or k·qᵀ times scale·log2 e), the tree mask (`_tree_mask`, either orientation), a
query tile against a key tile (`_key_tile_scores`, forward and dQ), P and dS (`_probs`, `_score_grads`), and the
loads, accumulations and stores of the head-dim parts. The forward and dQ kernels walk `TreePlan.by_query`, the
dK/dV kernel `by_key`; in each list the full tiles come first and run with MASKED off.
Inside an activation checkpoint with harts.ops.attention.keep's keeper (keep_attention), the recomputation
replays the forward's O and lse instead of running the forward kernel again, as the flash4 backend does.
Inputs bf16, fp16 or fp32 (one dtype), products accumulated in fp32 (fp32 inputs multiply in full fp32, not
TF32); P and dS are rounded to the inputs' dtype for their matmuls, as FlashAttention does. Head dims: any E for
q/k, split in two power-of-two parts for the tensor cores (MLA's 192 = 128 + 64, no padding; others pad the
second part), any F for v (padded to a power of two). K and V have q's heads (GQA repeats its KV heads first).
Tiles, warps and stages: `TILE_ROWS`, `tile_rows`, `KERNEL_LAUNCH` (timed on an H100).
Tested against `naive_group_attention` (output, lse, dq, dk, dv) under the Triton interpreter on the CPU
(tests/ops/attention/interpreter.py) and on CUDA (tests/ops/attention/test_tree_triton.py).
Legend: R rows, H heads, E query/key head dim, F value head dim; tiles of BLOCK_M query and BLOCK_N key rows.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from harts.ops.attention.keep import AttentionKernels, keepable_attention
from harts.ops.attention.query_groups import AttentionGroups
from harts.ops.attention.tree_blocks import TreePlan, tree_plan

TILE_ROWS = {torch.bfloat16: 64, torch.float16: 64, torch.float32: 32}
"""Rows of a query tile and of a key tile in all three kernels (one `TreePlan` serves them), by input dtype, at head
dims up to MLA's (q/k 192 = 128 + 64, v 128); wider heads take half (`tile_rows`). fp32's tiles at MLA's head dims
take 128 KB of shared memory at 32 rows and would take 263 KB (more than a Hopper SM's 227 KB) at 64 (compiled for
sm_90 in tests/ops/attention/test_tree_triton.py). On an H100 (triton 3.6, a 65,536-row paper-slice microbatch, bf16,
16 heads at MLA's dims: docs/benchmarks.md) 64 x 64 tiles ran the forward and backward in 170 ms, as fast as the varlen
backend on the baseline's rows, 32 x 64 in 222 ms; 128 x 64, 64 x 128 and 128 x 128 do not fit the shared memory."""
WIDE_HEADS = 320
"""Padded q/k plus v head dims above which 16-bit tiles are halved (MLA's 128 + 64 + 128 is the widest that fits
64 x 64 tiles; the gated GQA's 256 + 256 does not)."""
KERNEL_LAUNCH = {
    "forward": {"num_warps": 4, "num_stages": 2},
    "backward_kv": {"num_warps": 4, "num_stages": 3},
    "backward_q": {"num_warps": 4, "num_stages": 1},
}
"""Warps and software-pipeline stages of each kernel, timed on an H100 (triton 3.6, bf16, MLA's dims, 16 heads) over
the two compact microbatches of a `paper` tree (65,536 and 40,682 rows), each kernel alone, 4 and 8 warps by 1-4
stages: the forward 71 ms at 2 stages against 102 at Triton's default 3, dQ 105 ms at 1 against 113, dK/dV 156 ms
at 3 (216 at 2); 8 warps were slower in every kernel (forward 137-188 ms). Fewer stages never take more shared
memory, so every dtype's tiles still fit (tests/ops/attention/test_tree_triton.py compiles them for sm_90)."""
LOG2E = 1.0 / math.log(2.0)
LOG2E_C: tl.constexpr = tl.constexpr(LOG2E)
"""log2(e) in the kernels: they take exponents base 2, and the log-sum-exp is stored in natural units."""
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def head_parts(dim: int) -> tuple[int, int]:
    """(first, second) power-of-two parts, each >= 16 (tl.dot's least), covering a head dim: the largest power
    of two <= dim, then the rest rounded up (0: none)."""
    first = max(16, 1 << (dim.bit_length() - 1))
    rest = dim - first
    return first, (0 if rest <= 0 else max(16, 1 << (rest - 1).bit_length()))


def tile_rows(dtype: torch.dtype, qk_dim: int, v_dim: int) -> int:
    """Rows of the backend's query and key tiles for inputs of `dtype` and these head dims (`TILE_ROWS`)."""
    first, second = head_parts(qk_dim)
    rows = TILE_ROWS[dtype]
    return rows if first + second + triton.next_power_of_2(v_dim) <= WIDE_HEADS or rows <= 32 else rows // 2


@triton.jit
def _tile_rows(tile, BLOCK: tl.constexpr, num_rows):
    """The rows of tile `tile` (BLOCK rows each) and which of them are real (below R)."""
    rows = tile * BLOCK + tl.arange(0, BLOCK)
    return rows, rows < num_rows


@triton.jit
def _program_tile(ORDER, PTR, NUM_FULL, BLOCK: tl.constexpr, num_rows):
    """This program's head and tile (program ids: position in ORDER, the tiles by descending list length; head),
    the tile's rows, and the bounds of its list: TILES[start:split] its full partner tiles, TILES[split:stop] the
    partial ones."""
    tile = tl.load(ORDER + tl.program_id(0))
    head = tl.program_id(1).to(tl.int64)
    rows, row_ok = _tile_rows(tile, BLOCK, num_rows)
    start, stop = tl.load(PTR + tile), tl.load(PTR + tile + 1)
    return head, rows, row_ok, start, start + tl.load(NUM_FULL + tile), stop


@triton.jit
def _load_rows(base, rows, row_ok, stride_r, COL0: tl.constexpr, BLOCK: tl.constexpr, num_cols,
               TRANSPOSED: tl.constexpr):
    """x[rows, COL0:COL0 + BLOCK] ([rows, BLOCK], or with TRANSPOSED [BLOCK, rows]) of a [R, num_cols] matrix with
    row stride stride_r, zeros outside it."""
    cols = COL0 + tl.arange(0, BLOCK)
    offsets = rows.to(tl.int64) * stride_r
    if TRANSPOSED:
        x = tl.load(base + offsets[None, :] + cols[:, None], mask=row_ok[None, :] & (cols[:, None] < num_cols),
                    other=0.0)
    else:
        x = tl.load(base + offsets[:, None] + cols[None, :], mask=row_ok[:, None] & (cols[None, :] < num_cols),
                    other=0.0)
    return x


@triton.jit
def _store_rows(base, rows, row_ok, stride_r, x, COL0: tl.constexpr, BLOCK: tl.constexpr, num_cols):
    """x [rows, BLOCK] into columns COL0:COL0 + BLOCK of a [R, num_cols] matrix with row stride stride_r (what lies
    outside it is not stored)."""
    cols = COL0 + tl.arange(0, BLOCK)
    offsets = rows.to(tl.int64) * stride_r
    tl.store(base + offsets[:, None] + cols[None, :], x, mask=row_ok[:, None] & (cols[None, :] < num_cols))


@triton.jit
def _load_parts(base, rows, row_ok, stride_r, E: tl.constexpr, BLOCK_E0: tl.constexpr, BLOCK_E1: tl.constexpr,
                TRANSPOSED: tl.constexpr):
    """A q or k tile in its two head-dim parts, columns [0, BLOCK_E0) and [BLOCK_E0, BLOCK_E0 + BLOCK_E1) (as
    `_load_rows` lays them out); without a second part (BLOCK_E1 = 0) the first stands in for it, never read."""
    x0 = _load_rows(base, rows, row_ok, stride_r, 0, BLOCK_E0, E, TRANSPOSED)
    x1 = x0
    if BLOCK_E1 > 0:
        x1 = _load_rows(base, rows, row_ok, stride_r, BLOCK_E0, BLOCK_E1, E, TRANSPOSED)
    return x0, x1


@triton.jit
def _zero_parts(BLOCK: tl.constexpr, BLOCK_E0: tl.constexpr, BLOCK_E1: tl.constexpr):
    """fp32 zeros for a gradient's two head-dim parts ([BLOCK, BLOCK_E0], [BLOCK, BLOCK_E1])."""
    x0 = tl.zeros([BLOCK, BLOCK_E0], tl.float32)
    x1 = x0
    if BLOCK_E1 > 0:
        x1 = tl.zeros([BLOCK, BLOCK_E1], tl.float32)
    return x0, x1


@triton.jit
def _store_grad(X, head, rows, row_ok, x, COL0: tl.constexpr, BLOCK: tl.constexpr, num_cols):
    """x [rows, BLOCK] into columns COL0:COL0 + BLOCK of head `head` of X, a gradient written contiguous
    [R, H, num_cols] as torch's would be (what lies outside it is not stored)."""
    cols = COL0 + tl.arange(0, BLOCK)
    offsets = rows.to(tl.int64) * tl.num_programs(1) + head
    tl.store(X + offsets[:, None] * num_cols + cols[None, :], x, mask=row_ok[:, None] & (cols[None, :] < num_cols))


@triton.jit
def _store_parts(X, head, rows, row_ok, x0, x1, scale, E: tl.constexpr, BLOCK_E0: tl.constexpr,
                 BLOCK_E1: tl.constexpr):
    """scale · (x0, x1), the two head-dim parts of dQ or dK, into X (`_store_grad`)."""
    _store_grad(X, head, rows, row_ok, (x0 * scale).to(X.dtype.element_ty), 0, BLOCK_E0, E)
    if BLOCK_E1 > 0:
        _store_grad(X, head, rows, row_ok, (x1 * scale).to(X.dtype.element_ty), BLOCK_E0, BLOCK_E1, E)


@triton.jit
def _key_ends(ENDS, cols, col_ok):
    """subtree_end of the key rows; keys past R end at 0: no query sees them."""
    return tl.load(ENDS + cols, mask=col_ok, other=0)


@triton.jit
def _scores(a0, a1, b_base, b_rows, b_ok, stride_br, qk_scale, E: tl.constexpr, BLOCK_E0: tl.constexpr,
            BLOCK_E1: tl.constexpr, PRECISION: tl.constexpr):
    """Scores in log2 units (qk_scale = scale · log2(e)) of a tile a, q or k in its head-dim parts, against the
    rows b_rows of b, k or q [R, E] at b_base: qk_scale · a·bᵀ, [queries, keys] or transposed [keys, queries].
    b is read here part by part; its parts, transposed ([part, rows]), are returned for the gradients."""
    bt0 = _load_rows(b_base, b_rows, b_ok, stride_br, 0, BLOCK_E0, E, True)
    s = tl.dot(a0, bt0, input_precision=PRECISION)
    bt1 = bt0
    if BLOCK_E1 > 0:
        bt1 = _load_rows(b_base, b_rows, b_ok, stride_br, BLOCK_E0, BLOCK_E1, E, True)
        s = tl.dot(a1, bt1, s, input_precision=PRECISION)
    return s * qk_scale, bt0, bt1


@triton.jit
def _tree_mask(s, rows, cols, ends, TRANSPOSED: tl.constexpr):
    """The scores s [rows, cols] (or with TRANSPOSED [cols, rows]) with -inf where query row r does not see key row
    c under the tree mask c <= r < ends[c] (ends: `_key_ends` of cols)."""
    if TRANSPOSED:
        r, c, end = rows[None, :], cols[:, None], ends[:, None]
    else:
        r, c, end = rows[:, None], cols[None, :], ends[None, :]
    return tl.where((c <= r) & (r < end), s, float("-inf"))


@triton.jit
def _key_tile_scores(q0, q1, rows, k_base, ENDS, key_tile, num_rows, stride_kr, qk_scale, E: tl.constexpr,
                     BLOCK_E0: tl.constexpr, BLOCK_E1: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                     PRECISION: tl.constexpr):
    """A query tile's scores [BLOCK_M, BLOCK_N] against key tile `key_tile`, masked if MASKED; with the key rows
    (cols, col_ok) and kᵀ's parts, which the dQ kernel multiplies again."""
    cols, col_ok = _tile_rows(key_tile, BLOCK_N, num_rows)
    s, kt0, kt1 = _scores(q0, q1, k_base, cols, col_ok, stride_kr, qk_scale, E, BLOCK_E0, BLOCK_E1, PRECISION)
    if MASKED:
        s = _tree_mask(s, rows, cols, _key_ends(ENDS, cols, col_ok), False)
    return s, cols, col_ok, kt0, kt1


@triton.jit
def _row_lse(lse_base, rows, row_ok):
    """The forward's log-sum-exp of a head's rows in log2 units, as the scores; rows past R read +inf, so that
    their probabilities are 0."""
    return tl.load(lse_base + rows, mask=row_ok, other=float("inf")) * LOG2E_C


@triton.jit
def _row_delta(delta_base, rows, row_ok):
    return tl.load(delta_base + rows, mask=row_ok, other=0.0)


@triton.jit
def _probs(s, lse):
    """P recomputed from the scores and the rows' lse (broadcast along the keys)."""
    return tl.math.exp2(s - lse)


@triton.jit
def _score_grads(p, dp, delta, dtype: tl.constexpr):
    """dS = P ∘ (dP − delta), softmax's backward (with respect to the scaled scores; delta broadcast along the
    keys), rounded to `dtype` for its matmuls."""
    return (p * (dp - delta)).to(dtype)


@triton.jit
def _accumulate_parts(d0, d1, ds, xt0, xt1, BLOCK_E1: tl.constexpr, PRECISION: tl.constexpr):
    """d += ds · x over both head-dim parts, from x's parts loaded transposed (xt: [part, rows]): dQ += dS · K, and
    dK += dSᵀ · Q with ds = dSᵀ."""
    d0 = tl.dot(ds, tl.trans(xt0), d0, input_precision=PRECISION)
    if BLOCK_E1 > 0:
        d1 = tl.dot(ds, tl.trans(xt1), d1, input_precision=PRECISION)
    return d0, d1


@triton.jit
def _forward_tile(acc, l_i, m_i, q0, q1, rows, k_base, v_base, ENDS, key_tile, num_rows, stride_kr, stride_vr,
                  qk_scale, E: tl.constexpr, F: tl.constexpr, BLOCK_E0: tl.constexpr, BLOCK_E1: tl.constexpr,
                  BLOCK_F: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr):
    """The online softmax's step over one key tile: the running output, row sums and row maxima."""
    s, cols, col_ok, _, _ = _key_tile_scores(q0, q1, rows, k_base, ENDS, key_tile, num_rows, stride_kr, qk_scale, E,
                                             BLOCK_E0, BLOCK_E1, BLOCK_N, MASKED, PRECISION)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no key yet (all -inf) subtracts 0: its p and its rescale factor are then 0, not NaN.
    base = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - base[:, None])
    alpha = tl.math.exp2(m_i - base)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_rows(v_base, cols, col_ok, stride_vr, 0, BLOCK_F, F, False)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit
def _tree_forward(Q, K, V, O, LSE, ENDS, ORDER, PTR, NUM_FULL, TILES, stride_qr, stride_qh, stride_kr, stride_kh,
                  stride_vr, stride_vh, stride_or, stride_oh, num_rows, qk_scale, E: tl.constexpr, F: tl.constexpr,
                  BLOCK_E0: tl.constexpr, BLOCK_E1: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    head, rows, row_ok, start, split, stop = _program_tile(ORDER, PTR, NUM_FULL, BLOCK_M, num_rows)
    k_base, v_base = K + head * stride_kh, V + head * stride_vh
    q0, q1 = _load_parts(Q + head * stride_qh, rows, row_ok, stride_qr, E, BLOCK_E0, BLOCK_E1, False)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_F], tl.float32)
    for index in range(start, split):
        acc, l_i, m_i = _forward_tile(acc, l_i, m_i, q0, q1, rows, k_base, v_base, ENDS, tl.load(TILES + index),
                                      num_rows, stride_kr, stride_vr, qk_scale, E, F, BLOCK_E0, BLOCK_E1, BLOCK_F,
                                      BLOCK_N, False, PRECISION)
    for index in range(split, stop):
        acc, l_i, m_i = _forward_tile(acc, l_i, m_i, q0, q1, rows, k_base, v_base, ENDS, tl.load(TILES + index),
                                      num_rows, stride_kr, stride_vr, qk_scale, E, F, BLOCK_E0, BLOCK_E1, BLOCK_F,
                                      BLOCK_N, True, PRECISION)
    # Every real row sees itself (l >= 1); rows past R, never stored, divide by 1.
    l_i = tl.where(row_ok, l_i, 1.0)
    out = acc / l_i[:, None]
    _store_rows(O + head * stride_oh, rows, row_ok, stride_or, out.to(O.dtype.element_ty), 0, BLOCK_F, F)
    tl.store(LSE + head * num_rows + rows, (m_i + tl.math.log2(l_i)) / LOG2E_C, mask=row_ok)


@triton.jit
def _tree_delta(O, DO, DELTA, stride_or, stride_oh, stride_dr, stride_dh, num_rows, F: tl.constexpr,
                BLOCK_F: tl.constexpr, BLOCK_M: tl.constexpr):
    rows, row_ok = _tile_rows(tl.program_id(0), BLOCK_M, num_rows)
    head = tl.program_id(1).to(tl.int64)
    out = _load_rows(O + head * stride_oh, rows, row_ok, stride_or, 0, BLOCK_F, F, False).to(tl.float32)
    dout = _load_rows(DO + head * stride_dh, rows, row_ok, stride_dr, 0, BLOCK_F, F, False).to(tl.float32)
    tl.store(DELTA + head * num_rows + rows, tl.sum(out * dout, 1), mask=row_ok)


@triton.jit
def _backward_kv_tile(dk0, dk1, dv, k0, k1, v, ends, cols, q_base, do_base, lse_base, delta_base, query_tile,
                      num_rows, stride_qr, stride_dr, qk_scale, E: tl.constexpr, F: tl.constexpr,
                      BLOCK_E0: tl.constexpr, BLOCK_E1: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_M: tl.constexpr,
                      MASKED: tl.constexpr, PRECISION: tl.constexpr):
    """One query tile's share of a key tile's dK and dV, transposed ([keys, queries]) so the key tile stays."""
    rows, row_ok = _tile_rows(query_tile, BLOCK_M, num_rows)
    st, qt0, qt1 = _scores(k0, k1, q_base, rows, row_ok, stride_qr, qk_scale, E, BLOCK_E0, BLOCK_E1, PRECISION)
    if MASKED:
        st = _tree_mask(st, rows, cols, ends, True)
    pt = _probs(st, _row_lse(lse_base, rows, row_ok)[None, :])
    dout = _load_rows(do_base, rows, row_ok, stride_dr, 0, BLOCK_F, F, False)
    dv = tl.dot(pt.to(dout.dtype), dout, dv, input_precision=PRECISION)
    dpt = tl.dot(v, tl.trans(dout), input_precision=PRECISION)
    dst = _score_grads(pt, dpt, _row_delta(delta_base, rows, row_ok)[None, :], qt0.dtype)
    dk0, dk1 = _accumulate_parts(dk0, dk1, dst, qt0, qt1, BLOCK_E1, PRECISION)
    return dk0, dk1, dv


@triton.jit
def _tree_backward_kv(Q, K, V, DO, LSE, DELTA, DK, DV, ENDS, ORDER, PTR, NUM_FULL, TILES, stride_qr, stride_qh,
                      stride_kr, stride_kh, stride_vr, stride_vh, stride_dr, stride_dh, num_rows, qk_scale, scale,
                      E: tl.constexpr, F: tl.constexpr, BLOCK_E0: tl.constexpr, BLOCK_E1: tl.constexpr,
                      BLOCK_F: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    head, cols, col_ok, start, split, stop = _program_tile(ORDER, PTR, NUM_FULL, BLOCK_N, num_rows)
    k0, k1 = _load_parts(K + head * stride_kh, cols, col_ok, stride_kr, E, BLOCK_E0, BLOCK_E1, False)
    v = _load_rows(V + head * stride_vh, cols, col_ok, stride_vr, 0, BLOCK_F, F, False)
    ends = _key_ends(ENDS, cols, col_ok)
    dk0, dk1 = _zero_parts(BLOCK_N, BLOCK_E0, BLOCK_E1)
    dv = tl.zeros([BLOCK_N, BLOCK_F], tl.float32)
    q_base, do_base = Q + head * stride_qh, DO + head * stride_dh
    lse_base, delta_base = LSE + head * num_rows, DELTA + head * num_rows
    for index in range(start, split):
        dk0, dk1, dv = _backward_kv_tile(dk0, dk1, dv, k0, k1, v, ends, cols, q_base, do_base, lse_base, delta_base,
                                         tl.load(TILES + index), num_rows, stride_qr, stride_dr, qk_scale, E, F,
                                         BLOCK_E0, BLOCK_E1, BLOCK_F, BLOCK_M, False, PRECISION)
    for index in range(split, stop):
        dk0, dk1, dv = _backward_kv_tile(dk0, dk1, dv, k0, k1, v, ends, cols, q_base, do_base, lse_base, delta_base,
                                         tl.load(TILES + index), num_rows, stride_qr, stride_dr, qk_scale, E, F,
                                         BLOCK_E0, BLOCK_E1, BLOCK_F, BLOCK_M, True, PRECISION)
    _store_parts(DK, head, cols, col_ok, dk0, dk1, scale, E, BLOCK_E0, BLOCK_E1)
    _store_grad(DV, head, cols, col_ok, dv.to(DV.dtype.element_ty), 0, BLOCK_F, F)


@triton.jit
def _backward_q_tile(dq0, dq1, q0, q1, dout, lse, delta, rows, k_base, v_base, ENDS, key_tile, num_rows,
                     stride_kr, stride_vr, qk_scale, E: tl.constexpr, F: tl.constexpr, BLOCK_E0: tl.constexpr,
                     BLOCK_E1: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                     PRECISION: tl.constexpr):
    """One key tile's share of a query tile's dQ."""
    s, cols, col_ok, kt0, kt1 = _key_tile_scores(q0, q1, rows, k_base, ENDS, key_tile, num_rows, stride_kr, qk_scale,
                                                 E, BLOCK_E0, BLOCK_E1, BLOCK_N, MASKED, PRECISION)
    p = _probs(s, lse[:, None])
    vt = _load_rows(v_base, cols, col_ok, stride_vr, 0, BLOCK_F, F, True)
    dp = tl.dot(dout, vt, input_precision=PRECISION)
    ds = _score_grads(p, dp, delta[:, None], kt0.dtype)
    return _accumulate_parts(dq0, dq1, ds, kt0, kt1, BLOCK_E1, PRECISION)


@triton.jit
def _tree_backward_q(Q, K, V, DO, LSE, DELTA, DQ, ENDS, ORDER, PTR, NUM_FULL, TILES, stride_qr, stride_qh, stride_kr,
                     stride_kh, stride_vr, stride_vh, stride_dr, stride_dh, num_rows, qk_scale, scale,
                     E: tl.constexpr, F: tl.constexpr, BLOCK_E0: tl.constexpr, BLOCK_E1: tl.constexpr,
                     BLOCK_F: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    head, rows, row_ok, start, split, stop = _program_tile(ORDER, PTR, NUM_FULL, BLOCK_M, num_rows)
    q0, q1 = _load_parts(Q + head * stride_qh, rows, row_ok, stride_qr, E, BLOCK_E0, BLOCK_E1, False)
    dout = _load_rows(DO + head * stride_dh, rows, row_ok, stride_dr, 0, BLOCK_F, F, False)
    lse_base, delta_base = LSE + head * num_rows, DELTA + head * num_rows
    lse, delta = _row_lse(lse_base, rows, row_ok), _row_delta(delta_base, rows, row_ok)
    dq0, dq1 = _zero_parts(BLOCK_M, BLOCK_E0, BLOCK_E1)
    k_base, v_base = K + head * stride_kh, V + head * stride_vh
    for index in range(start, split):
        dq0, dq1 = _backward_q_tile(dq0, dq1, q0, q1, dout, lse, delta, rows, k_base, v_base, ENDS,
                                    tl.load(TILES + index), num_rows, stride_kr, stride_vr, qk_scale, E, F, BLOCK_E0,
                                    BLOCK_E1, BLOCK_F, BLOCK_N, False, PRECISION)
    for index in range(split, stop):
        dq0, dq1 = _backward_q_tile(dq0, dq1, q0, q1, dout, lse, delta, rows, k_base, v_base, ENDS,
                                    tl.load(TILES + index), num_rows, stride_kr, stride_vr, qk_scale, E, F, BLOCK_E0,
                                    BLOCK_E1, BLOCK_F, BLOCK_N, True, PRECISION)
    _store_parts(DQ, head, rows, row_ok, dq0, dq1, scale, E, BLOCK_E0, BLOCK_E1)


def _shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict:
    """The kernels' head-dim and precision constants for q [R, H, E], k [R, H, E], v [R, H, F]."""
    num_rows, num_heads, qk_dim = q.shape
    assert k.shape == q.shape and v.shape[:2] == (num_rows, num_heads), (q.shape, k.shape, v.shape)
    assert q.dtype == k.dtype == v.dtype and q.dtype in DTYPES, (q.dtype, k.dtype, v.dtype)
    first, second = head_parts(qk_dim)
    value_dim = v.shape[2]
    return dict(E=qk_dim, F=value_dim, BLOCK_E0=first, BLOCK_E1=second,
                BLOCK_F=max(16, triton.next_power_of_2(value_dim)),
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32")


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _prepared(q, k, v, plan: TreePlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """q, k and v with a contiguous last dim, and the forward's and the gradient kernels' compile-time arguments for
    them and the plan's tiles (`_shapes`, tile rows, warps)."""
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    shapes = _shapes(q, k, v)
    lists = plan.lists
    assert plan.num_rows == q.shape[0], (plan.num_rows, q.shape[0])
    for rows in (lists.block_q, lists.block_k):
        assert rows >= 16 and rows & (rows - 1) == 0, f"tiles of {rows} rows: tl.dot takes powers of two >= 16"
    return q, k, v, dict(shapes, BLOCK_M=lists.block_q, BLOCK_N=lists.block_k)


def _row_head_strides(*tensors: torch.Tensor) -> list[int]:
    """The row and head strides of [R, H, ·] tensors, in the kernels' argument order."""
    return [stride for x in tensors for stride in x.stride()[:2]]


def tree_attention_forward(q, k, v, plan: TreePlan, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [R, H, F] in q's dtype, lse fp32 [H, R]) of the tree attention."""
    q, k, v, constants = _prepared(q, k, v, plan)
    num_rows, num_heads = q.shape[:2]
    out = torch.empty(num_rows, num_heads, v.shape[2], dtype=q.dtype, device=q.device)
    lse = torch.empty(num_heads, num_rows, dtype=torch.float32, device=q.device)
    _tree_forward[(plan.lists.num_q_tiles, num_heads)](
        q, k, v, out, lse, plan.subtree_end, *plan.by_query, *_row_head_strides(q, k, v, out), num_rows,
        scale * LOG2E, **constants, **KERNEL_LAUNCH["forward"],
    )
    return out, lse


def tree_attention_backward(dout, q, k, v, out, lse, plan: TreePlan, scale: float):
    """(dq, dk, dv), contiguous in the inputs' dtype, from the forward's out and lse."""
    q, k, v, constants = _prepared(q, k, v, plan)
    dout = _last_dim_contiguous(dout.to(q.dtype))
    num_rows, num_heads = q.shape[:2]
    query_grid, key_grid = (plan.lists.num_q_tiles, num_heads), (plan.lists.num_k_tiles, num_heads)
    delta = torch.empty(num_heads, num_rows, dtype=torch.float32, device=q.device)
    _tree_delta[query_grid](out, dout, delta, *_row_head_strides(out, dout), num_rows, F=constants["F"],
                            BLOCK_F=constants["BLOCK_F"], BLOCK_M=constants["BLOCK_M"])
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    scalars = (*_row_head_strides(q, k, v, dout), num_rows, scale * LOG2E, scale)
    _tree_backward_kv[key_grid](q, k, v, dout, lse, delta, dk, dv, plan.subtree_end, *plan.by_key, *scalars,
                                **constants, **KERNEL_LAUNCH["backward_kv"])
    _tree_backward_q[query_grid](q, k, v, dout, lse, delta, dq, plan.subtree_end, *plan.by_query, *scalars,
                                 **constants, **KERNEL_LAUNCH["backward_q"])
    return dq, dk, dv


def tree_attention(q_RHE: torch.Tensor, k_RHE: torch.Tensor, v_RHF: torch.Tensor, plan: TreePlan,
                   scale: float) -> torch.Tensor:
    """Softmax attention of rows in DFS preorder under the tree mask of `plan` (`tree_plan`), differentiable in q,
    k and v: out [R, H, F], with query row r attending to the key rows c <= r with r < subtree_end[c].

    Args:
        q_RHE, k_RHE: [R, H, E] queries and keys; v_RHF: [R, H, F] values; one dtype of bf16, fp16, fp32, on CUDA
            (or on the CPU under TRITON_INTERPRET=1). Any strides with a contiguous last dim.
        plan: the layout's tile lists on q's device, from `tree_plan(groups, rows, rows, device)` with rows
            `tile_rows(q.dtype, E, F)` (or other tiles of powers of two >= 16 rows).
        scale: the softmax scale (the scores are scale · q·k).

    Example:
        >>> plan = tree_plan(layout.groups, 64, 64, "cuda")  # a compact or baseline layout's groups
        >>> out = tree_attention(q, k, v, plan, q.shape[-1] ** -0.5)
    """
    kernels = AttentionKernels(lambda q, k, v: tree_attention_forward(q, k, v, plan, scale),
                               lambda dout, q, k, v, out, lse: tree_attention_backward(dout, q, k, v, out, lse, plan,
                                                                                       scale))
    return keepable_attention(q_RHE, k_RHE, v_RHF, kernels)


def triton_tree_attention(q_RHE, k_RHE, v_RHF, groups: AttentionGroups, scale: float,
                          tiles: tuple[int, int] | None = None) -> torch.Tensor:
    """The `triton_tree` backend: `tree_attention` with the groups' tile lists (built once per groups object and
    tile shape), of `tiles` (query rows, key rows; default `tile_rows` both)."""
    rows = tile_rows(q_RHE.dtype, q_RHE.shape[-1], v_RHF.shape[-1])
    plan = tree_plan(groups, *(tiles or (rows, rows)), q_RHE.device)
    return tree_attention(q_RHE, k_RHE, v_RHF, plan, scale)
