import numpy as np
import pytest
import torch

from harts.ops.attention.groups import naive_group_attention
from harts.ops.attention.split import (
    CUDNN,
    NAIVE,
    Buckets,
    _split_groups,
    cudnn_group_attention,
    split_group_attention,
)
from harts.runtime.layout import baseline_layout, compact_layout
from harts.trees.trie import PrefixIndex
from tests.ops.attention.helpers import random_splits, random_step


def _layout(execution, seed):
    step = random_step(seed)
    members = np.arange(step.num_trajectories)
    if execution == "compact":
        return compact_layout(step, PrefixIndex.from_step(step), members, conv_size=4, chunk_size=4)
    # baseline-split: groups with ancestors, keys and queries read in place
    splits = random_splits(step, members, seed) if execution == "baseline-split" else None
    return baseline_layout(step, members, conv_size=4, chunk_size=8, attention_splits=splits)


def _inputs(rows, generator, dtype=torch.float64, device="cpu", heads=2, qk_dim=8, v_dim=6):
    def make(dim):
        return torch.randn(rows, heads, dim, generator=generator, device=device, dtype=torch.float64).to(dtype)

    return make(qk_dim).requires_grad_(), make(qk_dim).requires_grad_(), make(v_dim).requires_grad_(), make(v_dim)


BUCKETS = {
    "exact": Buckets(query=1, powers_below=0, step_above=1, key=1, key_chunk=10**9),
    "small-buckets": Buckets(query=4, powers_below=16, step_above=4, key=4, key_chunk=12, batch_below=1024),
    "small-buckets-looped": Buckets(query=4, powers_below=16, step_above=4, key=4, key_chunk=12, batch_below=0),
    "default-buckets": Buckets(),
}


@pytest.mark.parametrize("buckets", BUCKETS.values(), ids=BUCKETS.keys())
@pytest.mark.parametrize("execution", ["baseline", "baseline-split", "compact"])
@pytest.mark.parametrize("seed", range(3))
def test_split_pieces_equal_the_dense_mask(execution, seed, buckets):
    """Own (causal) and ancestor (full) pieces merged by log-sum-exp, each piece's backward taking the
    merged output and lse, in padded (bucketed) shapes with the leftover ancestors in the own piece:
    the same function and gradients as the one dense masked softmax."""
    layout = _layout(execution, seed)
    if execution != "baseline":
        assert layout.groups.num_kv_rows > layout.num_rows  # some group has ancestors
    q, k, v, grad = _inputs(layout.num_rows, torch.Generator().manual_seed(seed))
    results = []
    for fn in (naive_group_attention, lambda *a: split_group_attention(*a, kernel=NAIVE, buckets=buckets)):
        out = fn(q, k, v, layout.groups, 0.3)
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_cudnn_backend_needs_cuda_half_precision():
    layout = _layout("baseline", 0)
    q, k, v, _ = _inputs(layout.num_rows, torch.Generator().manual_seed(0), dtype=torch.float32)
    with pytest.raises(ValueError, match="attention backend 'cudnn' needs bf16 or fp16 tensors on CUDA"):
        cudnn_group_attention(q, k, v, layout.groups, 0.3)


PIECES = [(1, 64, 64, True), (1, 192, 192, True), (1, 64, 256, False), (1, 320, 1024, False), (3, 64, 512, False)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("piece", PIECES, ids=lambda p: f"{p[0]}x{p[1]}x{p[2]}-{'causal' if p[3] else 'full'}")
def test_cudnn_piece_matches_naive(piece):
    """One dense cuDNN piece (forward: output and lse; backward given an output and lse) against the
    plain-matmul piece in fp32 on the same bf16 inputs, with MLA's head dims (192 / 128), in the
    bucketed shapes the split produces (a batch: far keys split into chunks)."""
    batch, num_q, num_k, causal = piece
    generator = torch.Generator(device="cuda").manual_seed(num_q)
    q = torch.randn(batch, 4, num_q, 192, generator=generator, device="cuda").bfloat16()
    k = torch.randn(batch, 4, num_k, 192, generator=generator, device="cuda").bfloat16()
    v = torch.randn(batch, 4, num_k, 128, generator=generator, device="cuda").bfloat16()
    dout = torch.randn(batch, 4, num_q, 128, generator=generator, device="cuda").bfloat16()
    out, lse = CUDNN.forward(q, k, v, causal, 192 ** -0.5)
    want_out, want_lse = NAIVE.forward(q, k, v, causal, 192 ** -0.5)
    assert lse.shape == want_lse.shape and lse.dtype == torch.float32
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-2)
    grads = CUDNN.backward(dout, q, k, v, want_out, want_lse, causal, 192 ** -0.5)
    want_grads = NAIVE.backward(dout, q, k, v, want_out, want_lse, causal, 192 ** -0.5)
    for got, want in zip((out, *grads), (want_out, *want_grads)):
        error = (got.double() - want.double()).norm() / want.double().norm()
        assert error < 1e-2, error


def test_padding_rows_add_nothing_at_large_logits():
    """Scores far above exp's range: the padding and leftover-ancestor query rows must contribute
    exactly nothing (their lse is +inf in the backward, not a stale value that overflows)."""
    layout = _layout("compact", 5)
    q, k, v, grad = _inputs(layout.num_rows, torch.Generator().manual_seed(5), dtype=torch.float32)
    q, k = (x.detach().mul(12.0).requires_grad_() for x in (q, k))
    got = split_group_attention(q, k, v, layout.groups, 1.0, kernel=NAIVE, buckets=BUCKETS["small-buckets"])
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = naive_group_attention(*ref, layout.groups, 1.0)
    want_grads = torch.autograd.grad(want, ref, grad.double())
    for a, b in zip((got, *got_grads), (want, *want_grads)):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.double(), b.detach(), rtol=1e-3, atol=1e-3 * float(b.detach().abs().max()))


@pytest.mark.parametrize("n, rows", [(1, 64), (64, 64), (65, 128), (1000, 1024), (4096, 4096), (4097, 4352),
                                     (33_000, 33_024)])
def test_default_query_rows(n, rows):
    """Powers of two up to 4,096 (at least cuDNN's 64-row tile), then multiples of 256."""
    assert Buckets().rows(n) == rows
    assert BUCKETS["exact"].rows(n) == n


def test_small_buckets_cover_every_kind_of_piece():
    """The small-bucket cases above exercise leftover ancestors in the own piece, padding, far
    keys in chunks (batched, or one call each), and a last far piece of the rest."""
    for name, batched in (("small-buckets", True), ("small-buckets-looped", False)):
        parts = _split_groups(_layout("compact", 0).groups, BUCKETS[name])
        own = [p.pieces[0] for p in parts]
        far = [piece for p in parts for piece in p.pieces[1:]]
        assert any(piece.real_offset > 0 for piece in own)
        assert any(piece.num_q > piece.real_offset + p.num_queries for piece, p in zip(own, parts))
        chunk_pieces = [sum(piece.num_k == 12 for piece in p.pieces[1:]) for p in parts]
        if batched:
            assert any(piece.batch > 1 for piece in far) and max(chunk_pieces) == 1
        else:
            assert all(piece.batch == 1 for piece in far) and max(chunk_pieces) > 1
        assert any(piece.num_k != 12 for piece in far)  # the rest
