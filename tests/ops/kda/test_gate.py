"""KDA's gate: fla's fused kernel (`kda_gate` on CUDA) against `naive_kda_gate`, on CPU under the
Triton interpreter in fp32 (tests/ops/kda/interpreter.py) and on CUDA (`-m gpu`) with bf16 inputs, both the
softplus gate and the bounded one (a lower bound); the bounded reference against fla's own
`naive_kda_lowerbound_gate` and transformers' `BailingHybridForgetGate` expression."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from harts.ops.kda.gate import kda_gate, naive_kda_gate

from .helpers import relative_error, value_and_grads
from .interpreter import run_interpreted


@pytest.mark.parametrize("case", ["gate", "gate-lower-bound"])
def test_interpreted_fla_gate_matches_reference(case):
    errors = run_interpreted("tests.ops.kda.interpreter", case)
    assert set(errors) == {"g", "df", "dA_log", "ddt_bias"}
    assert max(errors.values()) < 1e-6, errors


def test_bounded_reference_is_the_formula():
    """fla's torch reference of its bounded gate and transformers' BailingHybrid expression
    (lower_bound · sigmoid(exp(A_log) · (f + dt_bias))) give the same values, within (lower_bound, 0)."""
    from fla.ops.kda.gate import naive_kda_lowerbound_gate

    gen = torch.Generator().manual_seed(42)
    f = torch.randn(5, 2, 3, generator=gen) * 3
    A_log, dt_bias = torch.rand(2, generator=gen), torch.randn(6, generator=gen)
    g = naive_kda_gate(f, A_log, dt_bias, lower_bound=-5.0)
    assert g.dtype == torch.float32 and bool(((g > -5) & (g < 0)).all())
    torch.testing.assert_close(g, naive_kda_lowerbound_gate(f, A_log, dt_bias, lower_bound=-5.0), rtol=0, atol=0)
    transformers_form = -5.0 * torch.sigmoid(A_log.exp().view(1, 2, 1) * (f + dt_bias.view(2, 3)))
    torch.testing.assert_close(g, transformers_form, rtol=1e-6, atol=1e-7)
    assert torch.equal(kda_gate(f, A_log, dt_bias, -5.0), g)
    assert not torch.allclose(g, naive_kda_gate(f, A_log, dt_bias))


def test_reference_is_the_gate_formula():
    gen = torch.Generator().manual_seed(42)
    f, A_log, dt_bias = torch.randn(5, 2, 3, generator=gen), torch.rand(2, generator=gen), torch.randn(6, generator=gen)
    g = naive_kda_gate(f.bfloat16(), A_log, dt_bias)
    expected = -A_log.exp()[:, None] * F.softplus(f.bfloat16().float() + dt_bias.view(2, 3))
    assert g.dtype == torch.float32
    torch.testing.assert_close(g, expected, rtol=0, atol=0)
    assert torch.equal(kda_gate(f, A_log, dt_bias), naive_kda_gate(f, A_log, dt_bias))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
def test_cuda_dispatch_matches_reference(lower_bound):
    gen = torch.Generator(device="cuda").manual_seed(42)
    f = torch.randn(4099, 16, 128, generator=gen, device="cuda") * 4
    A_log = torch.rand(16, generator=gen, device="cuda") * 2
    dt_bias = torch.randn(16 * 128, generator=gen, device="cuda")
    upstream = torch.randn(4099, 16, 128, generator=gen, device="cuda")
    results = []
    for run, dtype in ((partial(naive_kda_gate, lower_bound=lower_bound), torch.float64),
                       (partial(kda_gate, lower_bound=lower_bound), torch.bfloat16)):
        results.append(value_and_grads(run, [x.to(dtype).requires_grad_() for x in (f, A_log, dt_bias)], upstream))
    assert results[1][0].dtype == torch.float32
    for actual, reference in zip(results[1], results[0]):
        assert relative_error(actual, reference) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_gate_is_accurate_on_the_initialised_range():
    """fp32 parameters, f + dt_bias around the initialisation's softplus⁻¹(dt), dt in [1e-3, 0.1]:
    every element within a few 1e-7·exp(A_log) of the fp64 reference (fla's approximate softplus)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.exp(torch.empty(16 * 128, device="cuda").uniform_(-6.9, -2.3, generator=gen))
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    A_log = torch.empty(16, device="cuda").uniform_(1, 16, generator=gen).log()
    f = (torch.randn(4099, 16, 128, generator=gen, device="cuda") * 0.5).bfloat16()
    g = kda_gate(f, A_log, dt_bias)
    reference = naive_kda_gate(f.double(), A_log.double(), dt_bias.double())
    bound = 1e-6 * A_log.double().exp().view(1, -1, 1) + 1e-4 * reference.abs()
    assert ((g.double() - reference).abs() <= bound).all()
