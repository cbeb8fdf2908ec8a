"""`fused_swiglu` against `naive_swiglu`: on CPU under the Triton interpreter in fp32 (a subprocess:
tests/ops/swiglu/interpreter.py); on CUDA (`-m gpu`) in bf16 against the fp64 reference, through
`swiglu`'s dispatch. On CPU `swiglu` is the PyTorch expression itself (the model's CPU numerics). Each without
and with a clipping limit, whose expression is transformers' BailingHybrid `_apply_gate` (limit_after_act)."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from harts.ops.swiglu import naive_swiglu, naive_weighted_swiglu_backward, swiglu, weighted_swiglu_backward
from tests.ops.kda.helpers import relative_error, value_and_grads
from tests.ops.kda.interpreter import run_interpreted


LIMITS = {"unclipped": None, "clipped": 2.0}


@pytest.mark.parametrize("case", ["kernel", "kernel-limit"])
def test_interpreted_kernel_matches_reference(case):
    errors = run_interpreted("tests.ops.swiglu.interpreter", case)
    assert len(errors) == 6
    assert max(errors.values()) < 1e-6, errors


@pytest.mark.parametrize("case", ["weighted", "weighted-limit"])
def test_interpreted_weighted_backward_matches_reference(case):
    errors = run_interpreted("tests.ops.swiglu.interpreter", case)
    assert len(errors) == 9
    assert max(errors.values()) < 1e-6, errors


def _weighted_autograd(gate_up, weight, grad, limit=None):
    """The definition: autograd of weight[:, None] · swiglu(gate_up, limit), and its value."""
    gate_up, weight = gate_up.detach().requires_grad_(), weight.detach().requires_grad_()
    out = weight[:, None] * naive_swiglu(gate_up, limit)
    d_gate_up, d_weight = torch.autograd.grad(out, (gate_up, weight), grad)
    return d_gate_up, d_weight, out.detach()


@pytest.mark.parametrize("limit", LIMITS.values(), ids=LIMITS)
@pytest.mark.parametrize("rows", [0, 1, 37])
def test_naive_weighted_backward_is_autograd_of_the_expression(rows, limit):
    gen = torch.Generator().manual_seed(42)
    gate_up = torch.randn(rows, 2 * 24, generator=gen, dtype=torch.float64) * 3
    weight = torch.rand(rows, generator=gen, dtype=torch.float64) * 2
    grad = torch.randn(rows, 24, generator=gen, dtype=torch.float64)
    for name, got, expected in zip(("d_gate_up", "d_weight", "weighted"),
                                   naive_weighted_swiglu_backward(gate_up, weight, grad, limit),
                                   _weighted_autograd(gate_up, weight, grad, limit)):
        assert torch.allclose(got, expected, rtol=1e-12, atol=1e-12), name


def test_cpu_dispatch_is_the_torch_expression():
    gate_up = torch.randn(9, 16, generator=torch.Generator().manual_seed(42)).bfloat16()
    assert torch.equal(swiglu(gate_up), F.silu(gate_up[:, :8]) * gate_up[:, 8:])
    assert torch.equal(naive_swiglu(gate_up), swiglu(gate_up))


def test_clipped_is_transformers_bailing_expression():
    """`naive_swiglu` with a limit is transformers' BailingHybrid expert activation (`_apply_gate`: the SiLU
    clipped above, up clipped both ways, after the activation), values and gradients; it clips something here."""
    gen = torch.Generator().manual_seed(42)
    gate_up = (torch.randn(37, 2 * 24, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate).clamp(max=2.0) * up.clamp(min=-2.0, max=2.0)
    actual = swiglu(gate_up, 2.0)
    assert torch.equal(actual, expected)
    assert not torch.equal(actual, swiglu(gate_up))
    upstream = torch.randn(37, 24, generator=gen, dtype=torch.float64)
    assert torch.equal(torch.autograd.grad(actual, gate_up, upstream)[0],
                       torch.autograd.grad(expected, gate_up, upstream)[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("limit", LIMITS.values(), ids=LIMITS)
@pytest.mark.parametrize("rows", [1, 5000])
def test_cuda_dispatch_matches_reference(rows, limit):
    gen = torch.Generator(device="cuda").manual_seed(42)
    gate_up = torch.randn(rows, 2 * 512, generator=gen, device="cuda") * 3
    upstream = torch.randn(rows, 512, generator=gen, device="cuda")
    results = []
    for run, dtype in ((partial(naive_swiglu, limit=limit), torch.float64),
                       (partial(swiglu, limit=limit), torch.bfloat16)):
        results.append(value_and_grads(run, [gate_up.to(dtype).requires_grad_()], upstream))
    assert results[1][0].dtype == torch.bfloat16
    for actual, reference in zip(results[1], results[0]):
        assert relative_error(actual, reference) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_dispatch_keeps_leading_dims():
    gate_up = torch.randn(2, 5, 2 * 64, device="cuda", dtype=torch.bfloat16)
    out = swiglu(gate_up)
    assert out.shape == (2, 5, 64)
    assert torch.equal(out, swiglu(gate_up.reshape(10, -1)).view(2, 5, 64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("limit", LIMITS.values(), ids=LIMITS)
@pytest.mark.parametrize("rows", [1, 5000])
def test_cuda_weighted_backward_matches_reference(rows, limit):
    gen = torch.Generator(device="cuda").manual_seed(42)
    gate_up = torch.randn(rows, 2 * 512, generator=gen, device="cuda") * 3
    weight = torch.rand(rows, generator=gen, device="cuda") * 2
    grad = torch.randn(rows, 512, generator=gen, device="cuda")
    gate_up, grad = gate_up.bfloat16(), grad.bfloat16()
    expected = _weighted_autograd(gate_up.double(), weight.double(), grad.double(), limit)
    actual = weighted_swiglu_backward(gate_up, weight, grad, limit)
    assert [t.dtype for t in actual] == [torch.bfloat16, torch.float32, torch.bfloat16]
    # from the same bf16 inputs: dw accumulated in fp32, the others rounded once to bf16
    assert relative_error(actual[1], expected[1]) < 1e-5
    for got, reference in (actual[0], expected[0]), (actual[2], expected[2]):
        assert relative_error(got, reference) < 2 ** -8
