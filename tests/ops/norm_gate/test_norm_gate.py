"""`fused_norm_gate` against `naive_norm_gate`: on CPU under the Triton interpreter in fp32 against fp64 (a
subprocess: tests/ops/norm_gate/interpreter.py), with each row's bits independent of the rows after it (so
both executions round a row alike); on CUDA (`-m gpu`) in bf16 against fp64, through `norm_gate`'s dispatch.
On CPU `norm_gate` is the model's former expression bit for bit."""

import pytest
import torch

from harts.model.layers import rms_norm
from harts.ops.norm_gate import naive_norm_gate, norm_gate
from tests.ops.kda.helpers import relative_error, value_and_grads
from tests.ops.kda.interpreter import run_interpreted


def test_interpreted_kernel_matches_reference():
    errors = run_interpreted("tests.ops.norm_gate.interpreter", "kernel")
    assert len(errors) == 12
    assert max(errors.values()) < 1e-6, errors


def test_interpreted_rows_do_not_depend_on_the_rows_after_them():
    assert run_interpreted("tests.ops.norm_gate.interpreter", "rows") == {"y": 1.0, "d_o": 1.0, "d_gate": 1.0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_dispatch_is_the_former_expression(dtype):
    gen = torch.Generator().manual_seed(42)
    o, gate = (torch.randn(9, 2, 16, generator=gen).to(dtype) for _ in range(2))
    weight = (1 + torch.randn(16, generator=gen) / 4).to(dtype)
    expected = rms_norm(o, weight, 1e-6) * torch.sigmoid(gate).to(o.dtype)
    assert torch.equal(norm_gate(o, gate, weight, 1e-6), expected)
    assert torch.equal(naive_norm_gate(o, gate, weight, 1e-6), expected)


def test_mismatched_shapes_are_a_value_error():
    pytest.importorskip("triton")
    from harts.ops.norm_gate import fused_norm_gate

    with pytest.raises(ValueError, match="do not match"):
        fused_norm_gate(torch.zeros(3, 2, 8), torch.zeros(3, 2, 4), torch.ones(8), 1e-6)


def _cuda_inputs(rows, heads=16, dim=128):
    gen = torch.Generator(device="cuda").manual_seed(42)
    o = torch.randn(rows, heads, dim, generator=gen, device="cuda") * 2
    gate = torch.randn(rows, heads, dim, generator=gen, device="cuda") * 3
    weight = 1 + torch.randn(dim, generator=gen, device="cuda") / 4
    return o, gate, weight, torch.randn(rows, heads, dim, generator=gen, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows, heads, dim", [(1, 16, 128), (5000, 16, 128), (333, 3, 96)],
                         ids=["one-row", "kda", "masked"])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32], ids=["bf16-weight", "fp32-weight"])
def test_cuda_dispatch_matches_reference(rows, heads, dim, weight_dtype):
    """bf16 rows (as under autocast) with a bf16 or fp32 weight (bf16 or fp32 parameters); rows and a head dim
    that do not fill the tiles."""
    o, gate, weight, upstream = _cuda_inputs(rows, heads, dim)
    results = []
    for dtypes in ((torch.float64,) * 2, (torch.bfloat16, weight_dtype)):
        inputs = [o.to(dtypes[0]), gate.to(dtypes[0]), weight.to(dtypes[1])]
        results.append(value_and_grads(lambda a, b, c: norm_gate(a, b, c, 1e-6),
                                       [t.requires_grad_() for t in inputs], upstream))
    assert results[1][0].dtype == torch.bfloat16 and results[1][3].dtype == weight_dtype
    for actual, reference in zip(results[1], results[0]):
        assert relative_error(actual, reference) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("first", [1, 1234])
def test_cuda_rows_do_not_depend_on_the_rows_after_them(first):
    o, gate, weight, upstream = (t.bfloat16() for t in _cuda_inputs(3000, heads=3, dim=96))
    results = []
    for rows in (first, 3000):
        inputs = [t[:rows].detach().requires_grad_() for t in (o, gate)] + [weight.detach().requires_grad_()]
        results.append(value_and_grads(lambda a, b, c: norm_gate(a, b, c, 1e-6), inputs, upstream[:rows]))
    for alone, among in zip(results[0][:3], results[1][:3]):
        assert torch.equal(alone, among[:first])


def test_interpreted_node_keeps_the_inputs_and_the_row_norms():
    """o, the gate, the weight and each row's 1/rms [N]: not the norm's output or the sigmoid (the memory this
    kernel saves in every KDA layer whose activations are kept)."""
    assert run_interpreted("tests.ops.norm_gate.interpreter", "saved") == {"kept": ["74x24", "74x24", "24", "74"]}
