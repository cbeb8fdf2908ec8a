"""`packed_kda`: the per-trajectory baseline's single KDA call (fla's own chunk_kda on GPU)."""

import pytest
import torch

from harts.ops.kda.naive import naive_recurrent_kda
from harts.ops.kda.keep import keeping_kda_intermediates
from harts.ops.kda.packed import packed_kda

from .helpers import relative_error
from .interpreter import run_interpreted


def _inputs(rows, heads, dim, device, dtype, seed=0):
    generator = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(rows, heads, dim, generator=generator) for _ in range(3))
    g = -torch.rand(rows, heads, dim, generator=generator) * 0.2
    beta = torch.rand(rows, heads, generator=generator)
    return [x.to(device=device, dtype=dtype if i < 3 else torch.float32).requires_grad_()
            for i, x in enumerate((q, k, v, g, beta))]


def test_torch_backend_matches_recurrence():
    cu = torch.tensor([0, 37, 100, 165])
    inputs = _inputs(165, 2, 8, "cpu", torch.float64)
    out = packed_kda(*inputs, cu, chunk_size=16, use_qk_l2norm=True)
    grads = torch.autograd.grad(out.square().sum(), inputs)
    ref_inputs = [x.detach().clone().requires_grad_() for x in inputs]
    q, k = (x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12) for x in ref_inputs[:2])
    expected, _ = naive_recurrent_kda(q.unsqueeze(0), k.unsqueeze(0), *(x.unsqueeze(0) for x in ref_inputs[2:]),
                                      cu_seqlens=cu)
    ref_grads = torch.autograd.grad(expected[0].square().sum(), ref_inputs)
    assert relative_error(out, expected[0]) < 1e-6
    for got, want in zip(grads, ref_grads):
        assert relative_error(got, want) < 1e-6


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend 'cuda-magic'"):
        packed_kda(*_inputs(4, 1, 4, "cpu", torch.float32), torch.tensor([0, 4]), chunk_size=4, backend="cuda-magic")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fla_backend_matches_torch_reference():
    cu = torch.tensor([0, 1000, 1063, 3000, 4097], device="cuda")
    inputs = _inputs(4097, 4, 64, "cuda", torch.bfloat16)
    out = packed_kda(*inputs, cu, chunk_size=64, use_qk_l2norm=True, backend="fla")
    grad = torch.randn_like(out.float())
    grads = torch.autograd.grad(out.float(), inputs, grad)
    ref_inputs = [x.detach().float().requires_grad_() for x in inputs]
    expected = packed_kda(*ref_inputs, cu, chunk_size=64, use_qk_l2norm=True, backend="torch")
    ref_grads = torch.autograd.grad(expected, ref_inputs, grad)
    errors = {"o": relative_error(out.float(), expected)}
    errors.update({name: relative_error(g.float(), r) for name, g, r in zip(("dq", "dk", "dv", "dg", "dbeta"), grads, ref_grads)})
    print("packed fla vs torch fp32:", {k: f"{v:.2e}" for k, v in errors.items()})
    assert errors["o"] < 1e-2 and max(errors.values()) < 4e-2, errors


def test_interpreted_fla_packed_is_fla_chunk_kda_without_keeping_g():
    """`packed_chunk_kda` (the baseline's "fla" call) under the Triton interpreter: fla's `chunk_kda` bit for bit
    (output and every gradient, the L2 norm in the kernel), keeping the same tensors but g; keeping fla's
    intermediates for the backward changes no bit."""
    result = run_interpreted("tests.ops.kda.interpreter", "packed")
    diffs = {name: result[name] for name in ("o", "dq", "dk", "dv", "dg", "dbeta")}
    assert all(diff == 0 for diff in diffs.values()), diffs
    assert (result["g_kept_fla"], result["g_kept_lean"]) == (1, 0), result
    assert result["other_bytes_lean"] == result["other_bytes_fla"] > 0, result
    # keep_intermediates (harts.ops.kda.keep): the same bits from the same kernels, fla's intermediates kept.
    assert result["kept_vs_recomputed"] == 0 and result["kept_extra_bytes"] > 0, result
    # and fla's backward reads them instead of computing them again (w/u and the states: two calls)
    assert (result["backward_recomputes"], result["backward_recomputes_kept"]) == (2, 0), result


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fla_backend_is_fla_chunk_kda_on_cuda():
    """On the GPU in bf16 the baseline's call gives fla's `chunk_kda`'s output and gradients bit for bit, and
    within bf16 rounding when it keeps fla's intermediates."""
    from fla.ops.kda import chunk_kda

    cu = torch.tensor([0, 1000, 1063, 3000, 4097], device="cuda")
    inputs = _inputs(4097, 4, 64, "cuda", torch.bfloat16)
    upstream = torch.randn(4097, 4, 64, device="cuda", dtype=torch.bfloat16)
    out = packed_kda(*inputs, cu, chunk_size=64, use_qk_l2norm=True, backend="fla")
    grads = torch.autograd.grad(out, inputs, upstream)
    q, k, v, g, beta = (x.unsqueeze(0) for x in inputs)
    expected = chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)[0][0]
    expected_grads = torch.autograd.grad(expected, inputs, upstream)
    assert torch.equal(out, expected)
    for got, want in zip(grads, expected_grads):
        assert torch.equal(got, want)
    # Keeping fla's intermediates for the backward (as a recomputed block does): the same kernels, though the
    # autotuner may pick other tiles for the WY kernel's call with the gated q, so the bits may differ.
    with keeping_kda_intermediates():
        kept = packed_kda(*inputs, cu, chunk_size=64, use_qk_l2norm=True, backend="fla")
    assert relative_error(kept.float(), expected.float()) < 1e-2
    for got, want in zip(torch.autograd.grad(kept, inputs, upstream), expected_grads):
        assert relative_error(got.float(), want.float()) < 1e-2
