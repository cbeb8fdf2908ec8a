"""`flash4_tree_attention` (FlashAttention-4's kernels with the tree mask as block sparsity and a mask_mod) with a
stand-in FA4 module on the CPU: the stand-in's forward reads the block sparsity by query tile and its backward by
key tile, as FA4's kernels do (unlisted tiles skipped, full tiles unmasked, partial tiles masked by the mask_mod,
which reads the aux tensors), so the plan's two forms, the aux tensor and the shapes handed over are checked against
the naive attention (output, lse and the three gradients); a recomputation that keeps the attention runs the
forward kernel once and gives the same gradients bit for bit. The CuTe mask_mod itself (the stand-in gets the same
predicate in PyTorch) and the real kernels are tested on the GPU in test_groups.py (`test_gpu_backends_match_naive`)."""

import sys
import types
from typing import NamedTuple

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from harts.model.model import keep_attention_context
from harts.ops.attention import flash4_tree
from harts.ops.attention.flash4_tree import flash4_tree_attention, flash4_tree_plan
from harts.ops.attention.groups import naive_group_attention, visibility_mask
from tests.ops.attention.helpers import LAYOUTS, named_layout

BLOCKS = [(16, 16), (16, 8), (8, 32)]


class _BlockSparseTensorsTorch(NamedTuple):
    mask_block_cnt: torch.Tensor
    mask_block_idx: torch.Tensor
    full_block_cnt: torch.Tensor | None = None
    full_block_idx: torch.Tensor | None = None
    block_size: tuple[int, int] | None = None


def _tree_mask(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
    return (kv_idx <= q_idx) & (q_idx < aux_tensors[0][kv_idx])


def _dense_mask(sparsity, mask_mod, aux_tensors, num_rows: int, by_query: bool) -> torch.Tensor:
    """[R, R] (query, key) of what FA4's kernels compute under `sparsity`: per major tile (query tiles when
    `by_query`, else key tiles), its listed full tiles all True and its partial tiles the mask_mod's values."""
    block_q, block_k = sparsity.block_size
    major_rows, minor_rows = (block_q, block_k) if by_query else (block_k, block_q)
    mask = torch.zeros(num_rows, num_rows, dtype=torch.bool)
    parts = ((sparsity.full_block_cnt, sparsity.full_block_idx, True),
             (sparsity.mask_block_cnt, sparsity.mask_block_idx, False))
    for counts, indices, full in parts:
        assert counts.shape[:2] == indices.shape[:2] == (1, 1)
        for major, (count, listed) in enumerate(zip(counts[0, 0].tolist(), indices[0, 0])):
            for minor in listed[:count].tolist():
                rows = torch.arange(major * major_rows, min((major + 1) * major_rows, num_rows))
                cols = torch.arange(minor * minor_rows, min((minor + 1) * minor_rows, num_rows))
                q_idx, kv_idx = (rows, cols) if by_query else (cols, rows)
                values = (torch.ones(len(q_idx), len(kv_idx), dtype=torch.bool) if full else
                          mask_mod(0, 0, q_idx[:, None], kv_idx[None, :], None, aux_tensors))
                mask[q_idx[:, None], kv_idx[None, :]] |= values
    return mask


def _scores(q, k, scale, mask):
    """[H, R, R] masked scores of [R, H, E] q and k."""
    return (scale * q.transpose(0, 1) @ k.transpose(0, 1).transpose(1, 2)).masked_fill(~mask, float("-inf"))


def _standin(calls: list[str]):
    def forward(q, k, v, *, softmax_scale, mask_mod, block_sparse_tensors, aux_tensors, return_lse, **rest):
        assert return_lse and not rest and q.shape[0] == 1
        calls.append("forward")
        q, k, v = q[0], k[0], v[0]
        mask = _dense_mask(block_sparse_tensors, mask_mod, aux_tensors, q.shape[0], by_query=True)
        scores = _scores(q, k, softmax_scale, mask)
        out = (torch.softmax(scores, -1) @ v.transpose(0, 1)).transpose(0, 1)
        return out[None], torch.logsumexp(scores, -1)[None], None, None, None

    def backward(q, k, v, out, dout, lse, *, softmax_scale, mask_mod, aux_tensors, block_sparse_tensors,
                 deterministic, **rest):
        """P = exp(S − lse) from the forward's lse, dV = Pᵀ·dO, dS = P ∘ (dO·Vᵀ − rowsum(dO ∘ O)), dQ = scale·dS·K,
        dK = scale·dSᵀ·Q: as FA4's kernel computes them."""
        assert not deterministic and not rest
        calls.append("backward")
        q, k, v, out, dout, lse = q[0], k[0], v[0], out[0], dout[0], lse[0]
        mask = _dense_mask(block_sparse_tensors, mask_mod, aux_tensors, q.shape[0], by_query=False)
        p = torch.exp(_scores(q, k, softmax_scale, mask) - lse[:, :, None])
        do_h, o_h = dout.transpose(0, 1), out.transpose(0, 1)
        ds = p * (do_h @ v.transpose(0, 1).transpose(1, 2) - (do_h * o_h).sum(-1, keepdim=True))
        dq = softmax_scale * ds @ k.transpose(0, 1)
        dk = softmax_scale * ds.transpose(1, 2) @ q.transpose(0, 1)
        dv = p.transpose(1, 2) @ do_h
        return tuple(t.transpose(0, 1)[None] for t in (dq, dk, dv))

    return forward, backward


@pytest.fixture
def calls(monkeypatch) -> list[str]:
    """The stand-in FA4 installed; the kernel calls it records."""
    recorded: list[str] = []
    interface = types.ModuleType("flash_attn.cute.interface")
    interface._flash_attn_fwd, interface._flash_attn_bwd = _standin(recorded)
    block_sparsity = types.ModuleType("flash_attn.cute.block_sparsity")
    block_sparsity.BlockSparseTensorsTorch = _BlockSparseTensorsTorch
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.block_sparsity", block_sparsity)
    monkeypatch.setattr(flash4_tree, "_cute_tree_mask", lambda: _tree_mask)
    return recorded


def _inputs(num_rows: int, seed: int, heads=2, qk_dim=6, v_dim=4):
    generator = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(num_rows, heads, qk_dim, generator=generator, dtype=torch.float64) for _ in range(2))
    v, grad = (torch.randn(num_rows, heads, v_dim, generator=generator, dtype=torch.float64) for _ in range(2))
    return q, k, v, grad


@pytest.mark.parametrize("blocks", BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
@pytest.mark.parametrize("name", LAYOUTS)
def test_forward_and_gradients_match_the_naive_attention(calls, name, blocks):
    groups = named_layout(name).groups
    num_rows = len(groups.row_subtree_end)
    plan = flash4_tree_plan(groups, *blocks, "cpu")
    assert flash4_tree_plan(groups, *blocks, "cpu").by_key[1] is plan.by_key[1]  # the layout's block mask, once
    q, k, v, grad = _inputs(num_rows, seed=len(name))
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash4_tree_attention(*inputs, plan, 0.4)
    reference = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = naive_group_attention(*reference, groups, 0.4)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    for letter, got, want in zip("qkv", torch.autograd.grad(out, inputs, grad),
                                 torch.autograd.grad(expected, reference, grad)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=letter)
    assert calls == ["forward", "backward"]


def test_the_forward_hands_over_the_log_sum_exp(calls):
    groups = named_layout("fork-inside").groups
    q, k, v, _ = _inputs(len(groups.row_subtree_end), seed=0)
    out, lse = flash4_tree.flash4_tree_forward(q, k, v, flash4_tree_plan(groups, 16, 16, "cpu"), 0.4)
    mask = visibility_mask(groups, len(q))
    assert out.shape == (len(q), 2, 4) and lse.shape == (2, len(q))
    torch.testing.assert_close(lse, torch.logsumexp(_scores(q, k, 0.4, mask), -1), rtol=1e-12, atol=1e-12)


def _block(plan, weight):
    """Two tree attention calls with projections around them (the second's inputs depend on the first's output,
    so a replay in the wrong order changes the gradients)."""

    def block(q, k, v):
        first = flash4_tree_attention(q @ weight, k @ weight, v, plan, 0.3)
        second = flash4_tree_attention(q * 0.5, k, first.flip(0), plan, 0.3)
        return (first * second).tanh()

    return block


def test_a_kept_recomputation_runs_the_forward_kernel_once(calls):
    groups = named_layout("deep-chain").groups
    plan = flash4_tree_plan(groups, 16, 8, "cpu")
    q, k, v, grad = _inputs(len(groups.row_subtree_end), seed=3)
    block = _block(plan, torch.randn(6, 6, generator=torch.Generator().manual_seed(4), dtype=torch.float64))
    grads, counts = {}, {}
    for kept in (False, True):
        calls.clear()
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        context = {"context_fn": keep_attention_context("flash4_tree")} if kept else {}
        out = checkpoint(block, *inputs, use_reentrant=False, **context)
        grads[kept] = torch.autograd.grad(out, inputs, grad)
        counts[kept] = (calls.count("forward"), calls.count("backward"))
    assert counts == {False: (4, 2), True: (2, 2)}
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))


def test_deterministic_algorithms_are_refused(calls):
    groups = named_layout("fork-inside").groups
    q, k, v, _ = _inputs(len(groups.row_subtree_end), seed=1)
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(ValueError, match="no deterministic backward"):
            flash4_tree_attention(q, k, v, flash4_tree_plan(groups, 16, 16, "cpu"), 0.4)
    finally:
        torch.use_deterministic_algorithms(False)
