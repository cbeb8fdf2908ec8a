"""naive_recurrent_gdn against fla's `naive_recurrent_gated_delta_rule` and transformers' Qwen3-Next
`torch_recurrent_gated_delta_rule` (the same math, written independently; the latter with grouped values)."""

import numpy as np
import pytest
import torch

from harts.ops.gdn.naive import naive_recurrent_gdn
from tests.ops.kda.helpers import relative_error

from .helpers import gdn_inputs


@pytest.mark.parametrize("length", [1, 63, 100], ids=lambda n: f"T{n}")
def test_matches_fla_naive(length):
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    q, k, v, g, beta = (x.detach() for x in gdn_inputs((2, length), 3, 3, 8, 5, torch.float32, seed=42))
    h0 = torch.randn(2, 3, 8, 5, generator=torch.Generator().manual_seed(1))
    o, s = naive_recurrent_gdn(q, k, v, g, beta, scale=0.3, initial_state=h0, output_final_state=True)
    o_ref, s_ref = naive_recurrent_gated_delta_rule(q, k, v, beta, g, scale=0.3, initial_state=h0,
                                                    output_final_state=True)
    assert relative_error(o, o_ref) < 1e-6
    assert relative_error(s, s_ref) < 1e-6


@pytest.mark.parametrize("group", [1, 2, 3], ids=lambda r: f"HV{r}xH")
def test_grouped_values_match_transformers(group):
    """Value head j reads query/key head j // group: transformers' Qwen3-Next recurrence (its own GVA)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    q, k, v, g, beta = (x.detach() for x in gdn_inputs((2, 37), 2, 2 * group, 8, 6, torch.float32, seed=3))
    h0 = torch.randn(2, 2 * group, 8, 6, generator=torch.Generator().manual_seed(2))
    o, s = naive_recurrent_gdn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, s_ref = torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert relative_error(o, o_ref) < 1e-6
    assert relative_error(s, s_ref) < 1e-6


def test_varlen_equals_separate_sequences():
    lengths = [5, 1, 17]
    q, k, v, g, beta = (x.detach() for x in gdn_inputs((1, sum(lengths)), 1, 2, 4, 3, torch.float32, seed=4))
    h0 = torch.randn(len(lengths), 2, 4, 3, generator=torch.Generator().manual_seed(1))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]))
    o, s = naive_recurrent_gdn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    for i, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        part = [x[:, lo:hi] for x in (q, k, v, g, beta)]
        o_i, s_i = naive_recurrent_gdn(*part, initial_state=h0[i : i + 1], output_final_state=True)
        assert torch.equal(o[:, lo:hi], o_i)
        assert torch.equal(s[i], s_i[0])


def test_fp64_stays_fp64():
    q, k, v, g, beta = (x.detach() for x in gdn_inputs((1, 9), 1, 1, 4, 4, torch.float64, seed=5))
    o, s = naive_recurrent_gdn(q, k, v, g, beta, output_final_state=True)
    assert o.dtype == s.dtype == torch.float64


def test_bad_shapes():
    q, k, v, g, beta = (x.detach() for x in gdn_inputs((1, 4), 2, 3, 4, 4, torch.float32, seed=6))
    with pytest.raises(ValueError, match="HV a multiple of H = 2"):
        naive_recurrent_gdn(q, k, v, g, beta)
    q, k, v, g, beta = (x.detach() for x in gdn_inputs((2, 4), 1, 1, 4, 4, torch.float32, seed=6))
    with pytest.raises(ValueError, match=r"g and beta must be \[B, T, HV\]"):
        naive_recurrent_gdn(q, k, v, g[..., None], beta)
    with pytest.raises(ValueError, match="batch must be 1"):
        naive_recurrent_gdn(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4]))
