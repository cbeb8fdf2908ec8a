"""chunk_kda_torch against the token recurrence: outputs, final and requested states, all gradients."""

import numpy as np
import pytest
import torch

from harts.ops.kda.chunk import chunk_kda_torch
from harts.ops.kda.naive import naive_recurrent_kda

from .helpers import relative_error

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}
LENGTHS = [1, 63, 64, 130, 33]


def _leaves(lengths, heads, key_dim, value_dim, dtype, gate_scale, seed=42):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(1, total, heads, key_dim, generator=gen, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(1, total, heads, key_dim, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(1, total, heads, value_dim, generator=gen, dtype=torch.float64)
    g = -torch.rand(1, total, heads, key_dim, generator=gen, dtype=torch.float64) * gate_scale
    beta = torch.rand(1, total, heads, generator=gen, dtype=torch.float64)
    h0 = torch.randn(len(lengths), heads, key_dim, value_dim, generator=gen, dtype=torch.float64)
    return [x.to(dtype).requires_grad_() for x in (q, k, v, g, beta, h0)]


def _requests(lengths, chunk, seed=42):
    """Per sequence: every chunk multiple inside it, its length, 0, and a random mid-chunk offset."""
    rng = np.random.default_rng(seed)
    offsets, ptr = [], [0]
    for length in lengths:
        mine = {0, length, *range(chunk, length, chunk), int(rng.integers(0, length + 1))}
        offsets += sorted(mine)
        ptr.append(len(offsets))
    return np.array(offsets), np.array(ptr)


def _naive_states(leaves, lengths, offsets, ptr):
    q, k, v, g, beta, h0 = leaves
    cu = np.concatenate([[0], np.cumsum(lengths)])
    states = []
    for i in range(len(lengths)):
        for offset in offsets[ptr[i] : ptr[i + 1]]:
            rows = slice(int(cu[i]), int(cu[i] + offset))
            _, state = naive_recurrent_kda(q[:, rows], k[:, rows], v[:, rows], g[:, rows], beta[:, rows],
                                           initial_state=h0[i : i + 1], output_final_state=True)
            states.append(state[0])
    return torch.stack(states)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("chunk", [4, 16, 64], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("gate_scale", [1.0, 5.0], ids=["gates1", "gates5"])
def test_matches_recurrence(dtype, chunk, gate_scale):
    leaves = _leaves(LENGTHS, 2, 8, 6, dtype, gate_scale)
    q, k, v, g, beta, h0 = leaves
    cu = torch.tensor(np.concatenate([[0], np.cumsum(LENGTHS)]))
    offsets, ptr = _requests(LENGTHS, chunk)
    o, final, states = chunk_kda_torch(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                       chunk_size=chunk, state_offsets=offsets, state_ptr=ptr)
    # The reference runs in fp64 on the same values, so the fp32 case measures fp32 error alone.
    exact = [x.detach().double().requires_grad_() for x in leaves]
    o_ref, final_ref = naive_recurrent_kda(*exact[:5], initial_state=exact[5], output_final_state=True, cu_seqlens=cu)
    states_ref = _naive_states(exact, LENGTHS, offsets, ptr)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in (o, final, states)]
    grads = torch.autograd.grad(sum((x * w.to(dtype)).sum() for x, w in zip((o, final, states), weights)), leaves)
    grads_ref = torch.autograd.grad(sum((x * w).sum() for x, w in zip((o_ref, final_ref, states_ref), weights)), exact)
    tolerance = TOLERANCE[dtype]
    for name, actual, expected in [("o", o, o_ref), ("final", final, final_ref), ("states", states, states_ref)]:
        assert relative_error(actual, expected) < tolerance, name
    for name, actual, expected in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], grads, grads_ref):
        assert relative_error(actual, expected) < tolerance, name


def test_batch_equals_varlen():
    leaves = _leaves([37, 37, 37], 2, 4, 4, torch.float64, 1.0)
    q, k, v, g, beta, h0 = (x.detach() for x in leaves)
    batched = [x.reshape(3, 37, *x.shape[2:]) for x in (q, k, v, g, beta)]
    o, final, _ = chunk_kda_torch(*batched, initial_state=h0, output_final_state=True, chunk_size=16)
    o_ref, final_ref, _ = chunk_kda_torch(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                          cu_seqlens=torch.tensor([0, 37, 74, 111]), chunk_size=16)
    assert torch.equal(o.reshape(o_ref.shape), o_ref)
    assert torch.equal(final, final_ref)


def test_empty_sequence_returns_initial_state():
    leaves = _leaves([0, 5, 0], 1, 4, 4, torch.float64, 1.0)
    q, k, v, g, beta, h0 = (x.detach() for x in leaves)
    o, final, states = chunk_kda_torch(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                       cu_seqlens=torch.tensor([0, 0, 5, 5]), chunk_size=4,
                                       state_offsets=np.array([0, 0]), state_ptr=np.array([0, 1, 1, 2]))
    assert torch.equal(final[0], h0[0]) and torch.equal(final[2], h0[2])
    assert torch.equal(states, h0[[0, 2]])


def test_without_initial_state_starts_from_zero():
    leaves = _leaves([20], 1, 4, 4, torch.float64, 1.0)
    q, k, v, g, beta, h0 = (x.detach() for x in leaves)
    o, _, _ = chunk_kda_torch(q, k, v, g, beta, chunk_size=8)
    o_ref, _, _ = chunk_kda_torch(q, k, v, g, beta, initial_state=torch.zeros_like(h0), chunk_size=8)
    assert torch.equal(o, o_ref)


def _call(**overrides):
    leaves = _leaves([6, 4], 1, 4, 4, torch.float32, 1.0)
    q, k, v, g, beta, h0 = (x.detach() for x in leaves)
    kwargs = dict(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=torch.tensor([0, 6, 10]), chunk_size=4)
    kwargs.update(overrides)
    return chunk_kda_torch(**kwargs)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(cu_seqlens=torch.tensor([0, 6, 9])), "cu_seqlens must rise"),
        (dict(cu_seqlens=torch.tensor([0, 7, 6, 10])), "cu_seqlens must rise"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(beta=torch.rand(1, 10)), "beta must be"),
        (dict(v=torch.rand(1, 9, 1, 4)), "v must be"),
        (dict(initial_state=torch.zeros(3, 1, 4, 4)), "initial_state must be"),
        (dict(state_offsets=np.array([7]), state_ptr=np.array([0, 1, 1])), "outside 0..6"),
        (dict(state_offsets=np.array([1]), state_ptr=np.array([0, 1])), "CSR pointer"),
        (dict(state_offsets=np.array([1])), "go together"),
    ],
    ids=["short-cu", "falling-cu", "chunk0", "beta-shape", "v-shape", "h0-shape", "offset-range", "ptr-shape",
         "offsets-alone"],
)
def test_bad_input(overrides, message):
    with pytest.raises(ValueError, match=message):
        _call(**overrides)
