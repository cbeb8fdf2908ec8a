"""`packed_gdn`, the per-trajectory baseline's single GDN call (fla's `chunk_gated_delta_rule` on GPU), and the
compact GDN's fla path, on CPU (the torch backend; the fla backends under the Triton interpreter)."""

import pytest
import torch

from harts.ops.gdn.naive import naive_recurrent_gdn
from harts.ops.gdn.packed import packed_gdn
from tests.ops.kda.helpers import relative_error
from tests.ops.kda.interpreter import run_interpreted

from .helpers import gdn_inputs


def test_torch_backend_matches_recurrence():
    cu = torch.tensor([0, 37, 100, 165])
    inputs = gdn_inputs((165,), 2, 4, 8, 6, torch.float64, seed=0)
    out = packed_gdn(*inputs, cu, chunk_size=16, use_qk_l2norm=True)
    grads = torch.autograd.grad(out.square().sum(), inputs)
    ref_inputs = [x.detach().clone().requires_grad_() for x in inputs]
    # fla's L2 norm: x / sqrt(Σx² + 1e-6)
    q, k = (x / (x.square().sum(-1, keepdim=True) + 1e-6).sqrt() for x in ref_inputs[:2])
    expected, _ = naive_recurrent_gdn(q.unsqueeze(0), k.unsqueeze(0), *(x.unsqueeze(0) for x in ref_inputs[2:]),
                                      cu_seqlens=cu)
    ref_grads = torch.autograd.grad(expected[0].square().sum(), ref_inputs)
    assert relative_error(out, expected[0]) < 1e-12
    for got, want in zip(grads, ref_grads):
        assert relative_error(got, want) < 1e-12


def test_bad_input():
    inputs = [x.detach() for x in gdn_inputs((4,), 1, 1, 4, 4, torch.float32, seed=0)]
    with pytest.raises(ValueError, match="unknown backend 'cuda-magic'"):
        packed_gdn(*inputs, torch.tensor([0, 4]), chunk_size=4, backend="cuda-magic")
    with pytest.raises(ValueError, match="cu_seqlens ends at row 3 but there are 4 rows"):
        packed_gdn(*inputs, torch.tensor([0, 3]), chunk_size=4)


def test_interpreted_fla_packed_matches_torch():
    """fla's `chunk_gated_delta_rule` (grouped values, the L2 norm in its kernel) computes the torch backend's
    function: output and every gradient within fp32 rounding."""
    errors = run_interpreted("tests.ops.gdn.interpreter", "packed")
    assert max(errors.values()) < 1e-5, errors


def test_interpreted_fla_compact_matches_per_trajectory():
    """The compact GDN on fla's KDA kernels with HARTS's boundary-state kernels (the broadcast gate), replay and
    no-replay schedules handing states across calls: output and every gradient within fp32 rounding."""
    errors = run_interpreted("tests.ops.gdn.interpreter", "compact")
    assert max(errors.values()) < 1e-5, errors
