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
    (the kernels of `flash4_varlen`; default backward: autograd through `varlen_standin`) with an empty probe cache;
    returns the groups module."""
    import sys
    import types

    from harts.ops.attention import groups as groups_module

    def autograd_backward(q, k, v, out, dout, lse, scale, causal, softcap, **kwargs):
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() for t in (q, k, v)]
            out, _, *_ = varlen_standin(*inputs, softmax_scale=scale, causal=causal, return_lse=True,
                                 **{key: kwargs[key] for key in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                                                 "max_seqlen_k")})
            return torch.autograd.grad(out, inputs, dout)

    module = types.ModuleType("flash_attn.cute.interface")
    module._flash_attn_fwd, module._flash_attn_bwd = forward, backward or autograd_backward
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", module)
    monkeypatch.setattr(groups_module, "_FLASH4_FAILURES", {})
    return groups_module


def varlen_standin(q, k, v, *, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, return_lse, **_):
    """FA4's varlen forward in plain PyTorch: per sequence, causal aligned bottom-right; (out, lse [H, Tq], ...)."""
    assert causal and return_lse
    outs, lses = [], []
    for i in range(len(cu_seqlens_q) - 1):
        qs = q[cu_seqlens_q[i]:cu_seqlens_q[i + 1]].transpose(0, 1)
        ks, vs = (t[cu_seqlens_k[i]:cu_seqlens_k[i + 1]].transpose(0, 1) for t in (k, v))
        scores = softmax_scale * qs @ ks.transpose(1, 2)
        visible = bottom_right_mask(qs.shape[1], ks.shape[1])
        scores = scores.masked_fill(~visible, float("-inf"))
        lses.append(torch.logsumexp(scores, -1))
        outs.append((torch.softmax(scores, -1) @ vs).transpose(0, 1))
    return torch.cat(outs), torch.cat(lses, dim=1), None, None, None


def bottom_right_mask(num_q: int, num_k: int) -> torch.Tensor:
    return torch.arange(num_k).unsqueeze(0) <= torch.arange(num_q).unsqueeze(1) + (num_k - num_q)
