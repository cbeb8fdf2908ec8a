"""naive_recurrent_kda against fla's naive_recurrent_kda (the same math, written independently)."""

import numpy as np
import pytest
import torch

from harts.ops.kda.naive import naive_recurrent_kda

from .helpers import relative_error


def _inputs(batch, length, heads, key_dim, value_dim, seed=42):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, heads, key_dim, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(batch, length, heads, key_dim, generator=gen), dim=-1)
    v = torch.randn(batch, length, heads, value_dim, generator=gen)
    g = -torch.rand(batch, length, heads, key_dim, generator=gen)
    beta = torch.rand(batch, length, heads, generator=gen)
    h0 = torch.randn(batch, heads, key_dim, value_dim, generator=gen)
    return q, k, v, g, beta, h0


@pytest.mark.parametrize("length", [1, 63, 100], ids=lambda n: f"T{n}")
def test_matches_fla_naive(length):
    from fla.ops.kda.naive import naive_recurrent_kda as fla_naive

    q, k, v, g, beta, h0 = _inputs(2, length, 3, 8, 5)
    o, s = naive_recurrent_kda(q, k, v, g, beta, scale=0.3, initial_state=h0, output_final_state=True)
    o_ref, s_ref = fla_naive(q, k, v, g, beta, scale=0.3, initial_state=h0, output_final_state=True)
    assert relative_error(o, o_ref) < 1e-6
    assert relative_error(s, s_ref) < 1e-6


def test_varlen_equals_separate_sequences():
    lengths = [5, 1, 17]
    q, k, v, g, beta, _ = _inputs(1, sum(lengths), 2, 4, 3)
    h0 = torch.randn(len(lengths), 2, 4, 3, generator=torch.Generator().manual_seed(1))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]))
    o, s = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    for i, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        part = [x[:, lo:hi] for x in (q, k, v, g, beta)]
        o_i, s_i = naive_recurrent_kda(*part, initial_state=h0[i : i + 1], output_final_state=True)
        assert torch.equal(o[:, lo:hi], o_i)
        assert torch.equal(s[i], s_i[0])


def test_fp64_stays_fp64():
    q, k, v, g, beta, h0 = (x.double() for x in _inputs(1, 9, 1, 4, 4))
    o, s = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.dtype == s.dtype == torch.float64


def test_varlen_needs_batch_one():
    q, k, v, g, beta, _ = _inputs(2, 4, 1, 4, 4)
    with pytest.raises(ValueError, match="batch must be 1"):
        naive_recurrent_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4]))
