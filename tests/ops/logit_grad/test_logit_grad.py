"""`fused_logit_grad` against `naive_logit_grad`: on CPU under the Triton interpreter (a subprocess:
tests/ops/logit_grad/interpreter.py), in place in fp32 and rounded into bf16; on CUDA (`-m gpu`)
through `logit_grad`'s dispatch. The objective's tests (tests/objective/test_logprobs.py) check the
LM head that uses it against the S×V reference."""

import pytest
import torch

from harts.ops.logit_grad import logit_grad, naive_logit_grad
from tests.ops.kda.helpers import relative_error
from tests.ops.kda.interpreter import run_interpreted


def test_interpreted_kernel_matches_reference():
    errors = run_interpreted("tests.ops.logit_grad.interpreter", "kernel")
    assert len(errors) == 8
    # The interpreter rounds fp32 → bf16 toward zero: one bf16 ulp (2^-7 relative) at most.
    assert max(v for k, v in errors.items() if k.endswith("in-place")) < 1e-6, errors
    assert max(errors.values()) < 2**-7, errors


def test_naive_out_dtype_keeps_the_logits():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(42))
    kept = logits.clone()
    lse, grad_sum = torch.logsumexp(logits, -1), torch.ones(3)
    rounded = naive_logit_grad(logits, lse, grad_sum, out_dtype=torch.bfloat16)
    assert torch.equal(logits, kept)
    assert torch.equal(rounded, naive_logit_grad(logits.clone(), lse, grad_sum).bfloat16())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("entropy", [False, True], ids=["logprobs", "with-entropy"])
def test_cuda_dispatch_matches_reference(entropy):
    gen = torch.Generator(device="cuda").manual_seed(42)
    rows, vocab = 300, 157184
    logits = torch.randn(rows, vocab, generator=gen, device="cuda") * 4
    lse = torch.logsumexp(logits, dim=-1)
    grad_sum = torch.randn(rows, generator=gen, device="cuda")
    grad_entropy = torch.randn(rows, generator=gen, device="cuda")
    log_p = logits - lse[:, None]
    terms = (-(log_p.exp() * log_p).sum(-1), grad_entropy) if entropy else (None, None)
    reference = naive_logit_grad(logits.double(), lse.double(), grad_sum.double(),
                                 *(None if t is None else t.double() for t in terms))
    rounded = logit_grad(logits, lse, grad_sum, *terms, out_dtype=torch.bfloat16)
    assert rounded.dtype == torch.bfloat16
    assert relative_error(rounded, reference) < 2**-8
    in_place = logit_grad(logits, lse, grad_sum, *terms)
    assert in_place.data_ptr() == logits.data_ptr()
    assert relative_error(in_place, reference) < 1e-6
