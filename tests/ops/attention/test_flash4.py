"""`flash4_varlen` (FlashAttention-4's varlen kernels as an operator) with a stand-in FA4 module on the CPU (a
forward, and a backward that reads the saved output and log-sum-exp as FA4's does): its autograd formula hands
FA4's kernels the arguments `flash_attn_varlen_func` gives them and the forward's saved tensors, and returns dq,
dk, dv in place (against autograd through the stand-in forward), and a recomputation that keeps the attention
(`keep_attention_context`: torch's selective policy, or for the flash4 backend its own keeper,
harts.ops.attention.keep) does not call the forward kernel again and gives the same gradients bit for bit; the
keeper puts no dispatch mode over the block and replays for every backward. The real kernels are tested on the GPU in test_groups.py (`test_gpu_backends_match_naive`)."""

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.checkpoint import checkpoint

from harts.model.model import keep_attention_context
from harts.ops.attention.flash4 import flash4_attention, flash4_varlen
from tests.ops.attention.helpers import flash_backward_standin, standin_flash4, varlen_standin

CU_Q = torch.tensor([0, 5, 12, 13], dtype=torch.int32)
CU_K = torch.tensor([0, 9, 16, 20], dtype=torch.int32)  # keys before the queries: ancestors, bottom-right causal


def _inputs(seed: int, heads=2, qk_dim=6, v_dim=4):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(int(CU_Q[-1]), heads, qk_dim, generator=generator, dtype=torch.float64)
    k = torch.randn(int(CU_K[-1]), heads, qk_dim, generator=generator, dtype=torch.float64)
    v = torch.randn(int(CU_K[-1]), heads, v_dim, generator=generator, dtype=torch.float64)
    return q, k, v, torch.randn(int(CU_Q[-1]), heads, v_dim, generator=generator, dtype=torch.float64)


def _counting_standin(monkeypatch):
    """The stand-in FA4, recording the keyword arguments of every forward call, then of every backward call."""
    calls, backward_calls = [], []

    def forward(q, k, v, **kwargs):
        calls.append(kwargs)
        return varlen_standin(q, k, v, **kwargs)

    def backward(*args, **kwargs):
        backward_calls.append(kwargs)
        return flash_backward_standin(*args, **kwargs)

    standin_flash4(monkeypatch, forward, backward)
    return calls, backward_calls


@pytest.mark.parametrize("seed", range(3))
def test_operator_forward_and_gradients(monkeypatch, seed):
    calls, backward_calls = _counting_standin(monkeypatch)
    q, k, v, grad = _inputs(seed)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash4_varlen(*inputs, CU_Q, CU_K, 7, 9, 0.3, False)
    reference = [t.clone().requires_grad_() for t in (q, k, v)]
    expected, expected_lse, *_ = varlen_standin(*reference, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, softmax_scale=0.3,
                                                causal=True, return_lse=True)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-12, atol=1e-12)
    assert out.requires_grad and not lse.requires_grad
    got = torch.autograd.grad(out, inputs, grad)
    want = torch.autograd.grad(expected, reference, grad)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
    ((forward_kwargs,), (backward_kwargs,)) = calls, backward_calls
    assert {key: forward_kwargs[key] for key in ("max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal")} == {
        "max_seqlen_q": 7, "max_seqlen_k": 9, "softmax_scale": 0.3, "causal": True}
    assert {key: backward_kwargs[key] for key in ("max_seqlen_q", "max_seqlen_k", "deterministic")} == {
        "max_seqlen_q": 7, "max_seqlen_k": 9, "deterministic": False}
    assert forward_kwargs["cu_seqlens_q"] is CU_Q and backward_kwargs["cu_seqlens_k"] is CU_K


def _block(weight, modes=None):
    """An MLA-like block: projections in front of two attention calls and behind them (the second call's inputs
    depend on the first's output, so a replay in the wrong order changes the gradients); `modes` collects the
    dispatch mode active around the attention."""

    def block(q, k, v):
        if modes is not None:
            modes.append(_get_current_dispatch_mode())
        first = flash4_attention(q @ weight, k @ weight, v, CU_Q, CU_K, 7, 9, 0.3, False)
        second = flash4_attention(q * 0.5, k, torch.cat([first, first], dim=0)[: v.shape[0]], CU_Q, CU_K, 7, 9, 0.3,
                                  False)
        return (first * second).tanh()

    return block


@pytest.mark.parametrize("backend", ["sdpa", "flash4"], ids=["selective-policy", "keeper"])
def test_a_kept_recomputation_does_not_run_the_forward_kernel_again(monkeypatch, backend):
    """Both mechanisms (torch's selective policy over the operator, the flash4 backend's keeper) run each forward
    kernel once instead of twice, the backward kernel once, with the same gradients bit for bit."""
    calls, backward_calls = _counting_standin(monkeypatch)
    q, k, v, grad = _inputs(0)
    generator = torch.Generator().manual_seed(1)
    block = _block(torch.randn(6, 6, generator=generator, dtype=torch.float64))
    grads, counts = {}, {}
    for kept in (False, True):
        calls.clear()
        backward_calls.clear()
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        context = {"context_fn": keep_attention_context(backend)} if kept else {}
        out = checkpoint(block, *inputs, use_reentrant=False, **context)
        grads[kept] = torch.autograd.grad(out, inputs, grad)
        counts[kept] = (len(calls), len(backward_calls))
    assert counts == {False: (4, 2), True: (2, 2)}
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))


def test_the_keeper_puts_no_dispatch_mode_over_the_block(monkeypatch):
    """Why flash4 has its own keeper: torch's selective policy runs every op of the block through a Python dispatch
    mode, in the forward and in the recomputation; the keeper runs none."""
    _counting_standin(monkeypatch)
    q, k, v, grad = _inputs(1)
    modes = {}
    for backend in ("sdpa", "flash4"):
        modes[backend] = []
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = checkpoint(_block(torch.eye(6, dtype=torch.float64), modes[backend]), *inputs, use_reentrant=False,
                         context_fn=keep_attention_context(backend))
        torch.autograd.grad(out, inputs, grad)
    assert len(modes["sdpa"]) == len(modes["flash4"]) == 2  # the forward and the recomputation
    assert all(mode is not None for mode in modes["sdpa"]) and all(mode is None for mode in modes["flash4"])


def test_the_keeper_replays_every_backward(monkeypatch):
    """A recomputation replays from the first kept output: a graph kept with `retain_graph` runs backward twice
    with the same gradients (torch's selective policy hands each kept output out once and refuses this)."""
    calls, _ = _counting_standin(monkeypatch)
    q, k, v, grad = _inputs(2)
    block = _block(torch.randn(6, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64))
    plain = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = torch.autograd.grad(block(*plain), plain, grad)
    calls.clear()
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = checkpoint(block, *inputs, use_reentrant=False, context_fn=keep_attention_context("flash4"))
    first = torch.autograd.grad(out, inputs, grad, retain_graph=True)
    second = torch.autograd.grad(out, inputs, grad)
    assert len(calls) == 2
    for a, b, c in zip(expected, first, second):
        assert torch.equal(a, b) and torch.equal(b, c)


def test_outside_a_keeper_flash4_attention_is_the_operator(monkeypatch):
    calls, _ = _counting_standin(monkeypatch)
    q, k, v, _ = _inputs(0)
    with torch.no_grad():
        got = flash4_attention(q, k, v, CU_Q, CU_K, 7, 9, 0.3, False)
    assert torch.equal(got, flash4_varlen(q, k, v, CU_Q, CU_K, 7, 9, 0.3, False)[0]) and len(calls) == 2


def test_the_kept_values_go_with_the_backward_not_with_the_graph(monkeypatch):
    """After the backward the kept outputs are freed, though the caller still holds the output (and so the
    graph's nodes): nothing but the checkpoint's saved tensors holds them."""
    import gc

    pointers = []

    def forward(q, k, v, **kwargs):
        result = varlen_standin(q, k, v, **kwargs)
        pointers.append(result[0].data_ptr())
        return result

    standin_flash4(monkeypatch, forward)
    q, k, v, grad = _inputs(4)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = checkpoint(_block(torch.eye(6, dtype=torch.float64)), *inputs, use_reentrant=False,
                     context_fn=keep_attention_context("flash4"))

    def alive():
        return [o for o in gc.get_objects() if type(o) is torch.Tensor and o.data_ptr() in pointers]

    assert len(pointers) == 2 and alive()
    torch.autograd.grad(out, inputs, grad)
    assert out.grad_fn is not None and not alive()


def test_a_context_leaves_its_own_entry_and_a_failed_call_leaves_none():
    """A keeper context removes its own entry (not the top one), and `keeper_scope` drops what a call that raised
    left entered (under torch 2.11 a checkpoint's forward context stays entered after its block raised)."""
    from harts.ops.attention.keep import active_keeper, keeper_contexts, keeper_scope

    (first, _), (second, _) = keeper_contexts(), keeper_contexts()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert active_keeper() == (second.keeper, False)
    second.__exit__(None, None, None)
    assert active_keeper() is None
    with pytest.raises(RuntimeError, match="in the block"):
        with keeper_scope():
            forward, _ = keeper_contexts()
            forward.__enter__()  # never exited, as a checkpoint's context after its block raised
            raise RuntimeError("in the block")
    assert active_keeper() is None
