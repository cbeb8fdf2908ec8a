"""`fused_combine` against `naive_combine`: on CPU under the Triton interpreter (a subprocess:
tests/ops/combine/interpreter.py), on CUDA (`-m gpu`) through `combine`'s dispatch; on CPU `combine`
is the reference itself."""

import pytest
import torch

from harts.ops.combine import combine, gather_combine, naive_combine, naive_gather_combine
from tests.ops.kda.helpers import relative_error, value_and_grads
from tests.ops.kda.interpreter import run_interpreted


def test_interpreted_kernel_matches_reference():
    errors = run_interpreted("tests.ops.combine.interpreter", "kernel")
    assert len(errors) == 9
    exact = {name: error for name, error in errors.items() if not name.endswith(".dy")}
    assert max(exact.values()) < 1e-6, errors
    # dy is rounded once to bf16/fp16; the interpreter's fp32 → bf16 conversion truncates (≤ 2^-8).
    assert max(error for name, error in errors.items() if name.endswith(".dy")) < 2 ** -8, errors


def test_interpreted_gather_kernel_matches_reference():
    errors = run_interpreted("tests.ops.combine.interpreter", "gather")
    assert len(errors) == 15
    assert all(errors[name] == 0.0 for name in errors if name.endswith(("weighted_vs_combine", "sum_then_add"))), errors
    assert max(errors[name] for name in errors if name.endswith(".weighted")) < 1e-6, errors
    # the plain sum and the sum with an addend are rounded once to bf16/fp16 (the interpreter's conversion
    # truncates: ≤ 2^-8)
    assert max(errors[name] for name in errors if name.endswith((".plain", ".added"))) < 2 ** -8, errors


def test_gather_reference_is_combine_of_the_gathered_rows():
    gen = torch.Generator().manual_seed(42)
    probs, y = torch.rand(5, 3, generator=gen), torch.randn(15, 16, generator=gen)
    rows = torch.randperm(15, generator=gen).view(5, 3)
    assert torch.equal(gather_combine(probs, y, rows), naive_combine(probs, y[rows]))
    assert torch.equal(gather_combine(None, y, rows), y[rows].sum(dim=1))
    assert torch.equal(naive_gather_combine(probs, y, rows), gather_combine(probs, y, rows))


def test_gather_reference_adds_then_rounds_once():
    gen = torch.Generator().manual_seed(42)
    probs, y = torch.rand(5, 3, generator=gen), torch.randn(15, 16, generator=gen).bfloat16()
    rows = torch.randperm(15, generator=gen).view(5, 3)
    add = torch.randn(5, 16, generator=gen).bfloat16()
    out = gather_combine(probs, y, rows, add, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, (naive_combine(probs, y[rows]) + add.float()).bfloat16())
    assert torch.equal(gather_combine(probs, y, rows, add), naive_combine(probs, y[rows]) + add.float())


@pytest.mark.parametrize("fused", [False, True], ids=["naive", "fused"])
def test_gather_combine_refuses_an_addend_it_cannot_take(fused):
    from harts.ops.combine import naive_gather_combine as run
    if fused:
        from harts.ops.combine.fused import fused_gather_combine as run
    y, rows = torch.zeros(6, 4).bfloat16(), torch.arange(6).view(3, 2)
    with pytest.raises(ValueError, match="need weights"):
        run(None, y, rows, torch.zeros(3, 4))
    with pytest.raises(ValueError, match="need weights"):
        run(None, y, rows, None, torch.float32)
    with pytest.raises(ValueError, match=r"addend has shape \(3, 5\), expected \(3, 4\)"):
        run(torch.ones(3, 2), y, rows, torch.zeros(3, 5))


@pytest.mark.parametrize("kernel", ["combine", "gather_add"])
def test_forward_kernels_compile_without_contraction(kernel):
    """Compiled for sm_90 with the launch options (on the CPU): no fused multiply-add, so the products are rounded
    and summed as the interpreter and the composed reference do. With contraction, k = 1's product fuses with the
    addend (an H100 measured other bits)."""
    from harts.ops.combine import fused
    from tests.ops.hopper import compile_sm90

    pointers = {"p": "*fp32", "y": "*bf16", "out": "*bf16"}
    if kernel == "combine":  # eight products and their sum
        jit, signature, constexprs = fused._combine_forward_kernel, pointers, {"K": 8, "BK": 8}
    else:  # one product and the addend
        jit, signature = fused._gather_combine_kernel, pointers | {"rows": "*i64", "add": "*bf16"}
        constexprs = {"K": 1, "BK": 1, "WEIGHTED": True, "ADD": True}
    signature = signature | {"D": "i32"}
    compiled = compile_sm90(jit, {name: signature.get(name, "constexpr") for name in jit.arg_names},
                            constexprs | {"BD": fused.BLOCK_COLUMNS}, divisible=list(signature),
                            options=fused.FORWARD_OPTIONS)
    ptx = compiled.asm["ptx"]
    assert "mul" in ptx and "fma" not in ptx


def test_cpu_dispatch_is_the_reference():
    gen = torch.Generator().manual_seed(42)
    probs, y = torch.rand(5, 4, generator=gen), torch.randn(5, 4, 16, generator=gen).bfloat16()
    out = combine(probs, y)
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.bmm(probs.unsqueeze(1), y.float()).squeeze(1))
    assert torch.equal(naive_combine(probs, y), out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("top_k", [1, 8])
def test_cuda_dispatch_matches_reference(top_k):
    gen = torch.Generator(device="cuda").manual_seed(top_k)
    probs = torch.rand(4099, top_k, generator=gen, device="cuda")
    y = (torch.randn(4099, top_k, 2048, generator=gen, device="cuda") * 3).bfloat16()
    upstream = torch.randn(4099, 2048, generator=gen, device="cuda")
    results = []
    for run, cast in ((naive_combine, torch.float64), (combine, None)):
        leaves = [probs.to(cast or probs.dtype).requires_grad_(), y.to(cast or y.dtype).requires_grad_()]
        results.append(value_and_grads(run, leaves, upstream))
    (out, grad_probs, grad_y), (ref_out, ref_probs, ref_y) = results[1], results[0]
    assert out.dtype == torch.float32 and grad_y.dtype == torch.bfloat16
    assert relative_error(out, ref_out) < 1e-6 and relative_error(grad_probs, ref_probs) < 1e-6
    # dy: the fp32 product rounded once to nearest (a few ties of the fp64 product may round apart).
    assert (grad_y != ref_y.float().bfloat16()).float().mean() < 0.003


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_cuda_gather_combine(top_k):
    """Weighted: bit for bit the combine of the gathered rows (the lean experts' forward is the grouped one);
    plain: the fp32 sum rounded once; with an addend: bit for bit the combine, plus the addend, rounded once."""
    gen = torch.Generator(device="cuda").manual_seed(top_k)
    probs = torch.rand(4099, top_k, generator=gen, device="cuda")
    y = (torch.randn(4099 * top_k, 2048, generator=gen, device="cuda") * 3).bfloat16()
    rows = torch.randperm(4099 * top_k, generator=gen, device="cuda").view(4099, top_k)
    assert torch.equal(gather_combine(probs, y, rows), combine(probs, y[rows]))
    plain = gather_combine(None, y, rows)
    assert plain.dtype == torch.bfloat16
    assert relative_error(plain, naive_gather_combine(None, y.double(), rows)) < 2 ** -8
    add = (torch.randn(4099, 2048, generator=gen, device="cuda") * 3).bfloat16()
    added = gather_combine(probs, y, rows, add, torch.bfloat16)
    assert torch.equal(added, (combine(probs, y[rows]) + add.float()).bfloat16())
