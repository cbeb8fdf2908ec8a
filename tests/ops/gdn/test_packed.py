"""`packed_gdn`, the per-trajectory baseline's single GDN call (on GPU fla's `chunk_gated_delta_rule`, or fla's KDA
kernels on the KDA form), and the compact GDN's fla path, on CPU (the torch backend; the fla backends under the
Triton interpreter) and on a GPU (gpu tests: each fla kernel against the fp32 torch backend, and the two kernels
against each other where fla runs both)."""

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
    with pytest.raises(ValueError, match="unknown kernel 'chunk'"):
        packed_gdn(*inputs, torch.tensor([0, 4]), chunk_size=4, kernel="chunk")


def test_interpreted_fla_packed_matches_torch():
    """fla's `chunk_gated_delta_rule` (grouped values, the L2 norm in its kernel) computes the torch backend's
    function: output and every gradient within fp32 rounding."""
    errors = run_interpreted("tests.ops.gdn.interpreter", "packed")
    assert max(errors.values()) < 1e-5, errors


def test_interpreted_fla_kda_kernel_matches_recurrence_and_torch():
    """The baseline's call on fla's KDA kernels (`kernel="kda"`: q and k repeated over the value groups, the gate
    broadcast over the key channels, one call without boundary states) computes the paper's recurrence and the
    torch backend's function: output and every gradient within fp32 rounding (measured 4e-7 to 1.1e-6); a baseline
    layout's GDN layers run it on one device plan of the call, with the same bits."""
    errors = run_interpreted("tests.ops.gdn.interpreter", "packed_kda")
    assert max(errors.values()) < 1e-5, errors


def test_interpreted_fla_compact_matches_per_trajectory():
    """The compact GDN on fla's KDA kernels with HARTS's boundary-state kernels (the broadcast gate), replay and
    no-replay schedules handing states across calls: output and every gradient within fp32 rounding."""
    errors = run_interpreted("tests.ops.gdn.interpreter", "compact")
    assert max(errors.values()) < 1e-5, errors


def _cuda_inputs(rows: int, dtype):
    inputs = gdn_inputs((rows,), 4, 8, 64, 64, torch.float32, seed=0, gate_scale=0.2)
    return [x.detach().to("cuda", dtype if i < 3 else torch.float32).requires_grad_() for i, x in enumerate(inputs)]


def _skip_where_fla_refuses(kernel: str) -> None:
    from harts.ops.gdn.packed import fla_gdn_refusal

    reason = fla_gdn_refusal() if kernel == "gdn" else None
    if reason is not None:
        pytest.skip(reason)


def _packed_on_cuda(kernel: str):
    """(o, gradients of q, k, v, g, beta) of the baseline's bf16 call on `kernel`, with the fp32 torch backend's."""
    cu = torch.tensor([0, 1000, 1063, 3000, 4097], device="cuda")
    inputs = _cuda_inputs(4097, torch.bfloat16)
    out = packed_gdn(*inputs, cu, chunk_size=64, use_qk_l2norm=True, backend="fla", kernel=kernel)
    grad = torch.randn(out.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    grads = torch.autograd.grad(out.float(), inputs, grad)
    ref_inputs = [x.detach().float().requires_grad_() for x in inputs]
    expected = packed_gdn(*ref_inputs, cu, chunk_size=64, use_qk_l2norm=True, backend="torch")
    ref_grads = torch.autograd.grad(expected, ref_inputs, grad)
    return [out.float(), *(g.float() for g in grads)], [expected, *ref_grads]


NAMES = ("o", "dq", "dk", "dv", "dg", "dbeta")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernel", ["gdn", "kda"])
def test_fla_backend_matches_torch_reference_on_cuda(kernel):
    """The baseline's call on each fla kernel (`chunk_gated_delta_rule`, or the KDA kernels on the KDA form) in
    bf16 against the fp32 torch backend (bounds as KDA's GPU test: bf16 rounding); fla's GDN kernel is skipped,
    with fla's reason, where the installed fla refuses its backward."""
    _skip_where_fla_refuses(kernel)
    actual, expected = _packed_on_cuda(kernel)
    errors = {n: relative_error(a, e) for n, a, e in zip(NAMES, actual, expected)}
    print(f"packed gdn fla ({kernel} kernel) vs torch fp32:", {k: f"{v:.2e}" for k, v in errors.items()})
    assert errors["o"] < 1e-2 and max(errors.values()) < 4e-2, errors


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fla_kernels_agree_on_cuda():
    """fla's GDN kernel and its KDA kernels on the KDA form compute the same call: in bf16 they differ from each
    other by no more than each differs from the fp32 reference (bf16 rounding), where fla runs both."""
    _skip_where_fla_refuses("gdn")
    gdn, _ = _packed_on_cuda("gdn")
    kda, _ = _packed_on_cuda("kda")
    errors = {n: relative_error(a, b) for n, a, b in zip(NAMES, kda, gdn)}
    print("packed gdn: kda kernel vs gdn kernel (bf16):", {k: f"{v:.2e}" for k, v in errors.items()})
    assert errors["o"] < 2e-2 and max(errors.values()) < 8e-2, errors


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_refused_kernel_is_refused_before_fla_runs_on_cuda():
    """Where fla refuses its GDN kernel's backward, `packed_gdn` refuses the call before its forward (a ValueError
    naming the kernel that works) instead of fla's RuntimeError in the backward; elsewhere the call trains."""
    from harts.ops.gdn.packed import fla_gdn_refusal

    inputs = _cuda_inputs(100, torch.bfloat16)
    cu = torch.tensor([0, 100], device="cuda")
    if fla_gdn_refusal() is None:
        out = packed_gdn(*inputs, cu, chunk_size=64, use_qk_l2norm=True, backend="fla", kernel="gdn")
        out.float().sum().backward()
    else:
        with pytest.raises(ValueError, match="gdn_kernel kda runs the baseline's GDN calls on fla's KDA kernels"):
            packed_gdn(*inputs, cu, chunk_size=64, use_qk_l2norm=True, backend="fla", kernel="gdn")


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
