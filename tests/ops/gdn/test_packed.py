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


def _cuda_inputs(rows: int, dtype):
    inputs = gdn_inputs((rows,), 4, 8, 64, 64, torch.float32, seed=0, gate_scale=0.2)
    return [x.detach().to("cuda", dtype if i < 3 else torch.float32).requires_grad_() for i, x in enumerate(inputs)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fla_backend_matches_torch_reference_on_cuda():
    """The baseline's call on fla's `chunk_gated_delta_rule` in bf16 against the fp32 torch backend (bounds as
    KDA's GPU test: bf16 rounding)."""
    cu = torch.tensor([0, 1000, 1063, 3000, 4097], device="cuda")
    inputs = _cuda_inputs(4097, torch.bfloat16)
    out = packed_gdn(*inputs, cu, chunk_size=64, use_qk_l2norm=True, backend="fla")
    grad = torch.randn(out.shape, device="cuda")
    grads = torch.autograd.grad(out.float(), inputs, grad)
    ref_inputs = [x.detach().float().requires_grad_() for x in inputs]
    expected = packed_gdn(*ref_inputs, cu, chunk_size=64, use_qk_l2norm=True, backend="torch")
    ref_grads = torch.autograd.grad(expected, ref_inputs, grad)
    errors = {"o": relative_error(out.float(), expected)}
    errors.update({n: relative_error(g.float(), r) for n, g, r in zip(("dq", "dk", "dv", "dg", "dbeta"), grads,
                                                                        ref_grads)})
    print("packed gdn fla vs torch fp32:", {k: f"{v:.2e}" for k, v in errors.items()})
    assert errors["o"] < 1e-2 and max(errors.values()) < 4e-2, errors


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fla_compact_matches_per_trajectory_on_cuda():
    """The compact GDN on fla's KDA kernels (broadcast gate, boundary states handed across calls) in bf16 against
    the fp32 per-trajectory torch reference."""
    from harts.ops.gdn.compact import compact_gdn
    from harts.planning.kda_calls import plan_kda_calls
    from tests.ops.kda.helpers import tree_from_shape

    from .helpers import per_trajectory_gdn

    tree = tree_from_shape([-1, 0, 0, 1, 1, 2], [700, 300, 65, 200, 1, 129])
    inputs = _cuda_inputs(tree.num_compact_tokens, torch.bfloat16)
    o = compact_gdn(*inputs, plan_kda_calls(tree, 64), backend="fla")
    index = torch.from_numpy(tree.compact_map()).cuda()
    semantic = o.index_select(0, index)
    grad = torch.randn(semantic.shape, device="cuda")
    grads = torch.autograd.grad(semantic.float(), inputs, grad)
    ref_inputs = [x.detach().float().cpu().requires_grad_() for x in inputs]
    expected = per_trajectory_gdn(ref_inputs, tree, 64)
    ref_grads = torch.autograd.grad(expected, ref_inputs, grad.cpu())
    errors = {"o": relative_error(semantic.float().cpu(), expected)}
    errors.update({n: relative_error(g.float().cpu(), r) for n, g, r in zip(("dq", "dk", "dv", "dg", "dbeta"),
                                                                              grads, ref_grads)})
    print("compact gdn fla vs per-trajectory torch fp32:", {k: f"{v:.2e}" for k, v in errors.items()})
    assert errors["o"] < 1e-2 and max(errors.values()) < 4e-2, errors
