import numpy as np
import torch

from tests.trees.helpers import make_step, random_sequences


def random_step(seed, num=12, max_len=40, vocab=3):
    rng = np.random.default_rng(seed)
    return make_step(random_sequences(rng, num, max_len, vocab))


def random_splits(step, members, seed):
    """Up to 3 attention splits inside each member (groups with ancestors in a baseline layout)."""
    rng = np.random.default_rng(seed)
    return [np.sort(rng.choice(np.arange(1, n), size=min(3, n - 1), replace=False)) if n > 1 else np.zeros(0)
            for n in step.lengths[members]]


def standin_flash4(monkeypatch, forward, backward=None):
    """Install `forward` and `backward` as FA4's `flash_attn.cute.interface._flash_attn_fwd` and `_flash_attn_bwd`
    (the kernels of `flash4_varlen`; default backward: `flash_backward_standin`) with an empty probe cache;
    returns the groups module."""
    import sys
    import types

    from harts.ops.attention import groups as groups_module

    module = types.ModuleType("flash_attn.cute.interface")
    module._flash_attn_fwd, module._flash_attn_bwd = forward, backward or flash_backward_standin
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", module)
    monkeypatch.setattr(groups_module, "_FLASH4_FAILURES", {})
    return groups_module


def _sequences(cu_seqlens_q, cu_seqlens_k):
    """(query rows, key rows) of each packed sequence."""
    bounds = list(zip(cu_seqlens_q.tolist(), cu_seqlens_k.tolist()))
    for (q0, k0), (q1, k1) in zip(bounds, bounds[1:]):
        yield slice(q0, q1), slice(k0, k1)


def varlen_standin(q, k, v, *, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, return_lse, **_):
    """FA4's varlen forward in plain PyTorch: per sequence, causal aligned bottom-right; (out, lse [H, Tq], ...)."""
    assert causal and return_lse
    outs, lses = [], []
    for rows_q, rows_k in _sequences(cu_seqlens_q, cu_seqlens_k):
        qs = q[rows_q].transpose(0, 1)
        ks, vs = (t[rows_k].transpose(0, 1) for t in (k, v))
        scores = softmax_scale * qs @ ks.transpose(1, 2)
        visible = bottom_right_mask(qs.shape[1], ks.shape[1])
        scores = scores.masked_fill(~visible, float("-inf"))
        lses.append(torch.logsumexp(scores, -1))
        outs.append((torch.softmax(scores, -1) @ vs).transpose(0, 1))
    return torch.cat(outs), torch.cat(lses, dim=1), None, None, None


def bottom_right_mask(num_q: int, num_k: int) -> torch.Tensor:
    return torch.arange(num_k).unsqueeze(0) <= torch.arange(num_q).unsqueeze(1) + (num_k - num_q)


def flash_backward_standin(q, k, v, out, dout, lse, scale, causal, softcap, *, cu_seqlens_q, cu_seqlens_k, **_):
    """FA4's varlen backward in plain PyTorch, from the forward's saved output and log-sum-exp as the kernel
    reads them: P = exp(scale·QKᵀ − lse), dV = Pᵀ·dO, dS = P ∘ (dO·Vᵀ − rowsum(dO ∘ O)), dQ = scale·dS·K,
    dK = scale·dSᵀ·Q."""
    assert causal and softcap == 0.0
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rows_q, rows_k in _sequences(cu_seqlens_q, cu_seqlens_k):
        qs, os_, dos = (t[rows_q].transpose(0, 1) for t in (q, out, dout))
        ks, vs = (t[rows_k].transpose(0, 1) for t in (k, v))
        visible = bottom_right_mask(qs.shape[1], ks.shape[1])
        p = torch.exp(scale * qs @ ks.transpose(1, 2) - lse[:, rows_q, None]).masked_fill(~visible, 0.0)
        ds = p * (dos @ vs.transpose(1, 2) - (dos * os_).sum(-1, keepdim=True))
        dq[rows_q] = (scale * ds @ ks).transpose(0, 1)
        dk[rows_k] = (scale * ds.transpose(1, 2) @ qs).transpose(0, 1)
        dv[rows_k] = (p.transpose(1, 2) @ dos).transpose(0, 1)
    return dq, dk, dv


TREES = {
    # (parents, segment lengths, trajectories ending inside): with tiles of 16 rows, compact rows in preorder
    "fork-inside": ([-1, 0, 0, 1, 1, -1], [20, 13, 5, 17, 1, 9], ()),  # forks mid-tile, a 1-row leaf, 2 trees
    "fork-at-boundary": ([-1, 0, 0, 1, 1], [16, 16, 32, 16, 16], ()),  # every segment starts a tile
    "one-row-segments": ([-1, 0, 0, 0, 1, 1, 2, 4, 0, 8, 9, 9], [1] * 8 + [19, 1, 1, 1], (4,)),
    "deep-chain": (list(range(-1, 9)) + list(range(10)),
                   [5, 7, 1, 3, 9, 2, 6, 1, 8, 4] + [1, 2, 1, 3, 1, 17, 1, 2, 5, 1], ()),
    "forest": ([-1, 0, 0, -1, 3, -1, 5, 5, 6], [10, 7, 12, 3, 30, 18, 2, 9, 1], ()),
}
"""Tiny trees for the tree-mask tiles and kernels: forks inside tiles and at tile boundaries, 1-row segments, a
deep chain (10 segments, each with a side leaf: groups whose ancestors span 1 to 10 segments), several trees."""


def named_layout(name: str):
    """The layout of a named case: a `TREES` tree (compact rows), or a random step's compact, baseline or
    baseline-split layout (`random-compact`, `random-baseline`, `random-split`)."""
    from harts.runtime.layout import baseline_layout, compact_layout, tree_layout
    from harts.trees.trie import PrefixIndex

    from ..kda.helpers import tree_from_shape

    if name in TREES:
        parent, lengths, ends = TREES[name]
        tree = tree_from_shape(parent, lengths, frozenset(ends))
        return tree_layout(tree, np.zeros(tree.num_compact_tokens, dtype=np.int64), conv_size=4, chunk_size=16)
    step = random_step(5, num=10, max_len=60, vocab=3)
    members = np.arange(step.num_trajectories)
    if name == "random-compact":
        return compact_layout(step, PrefixIndex.from_step(step), members, conv_size=4, chunk_size=16)
    splits = random_splits(step, members, 5) if name == "random-split" else None
    return baseline_layout(step, members, conv_size=4, chunk_size=16, attention_splits=splits)


LAYOUTS = (*TREES, "random-compact", "random-baseline", "random-split")
