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
