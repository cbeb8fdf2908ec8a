"""`fused_logsumexp_entropy` against `naive_logsumexp_entropy`: on CPU under the Triton interpreter (a subprocess:
tests/ops/logsumexp/interpreter.py) on one row of one partial tile, rows of several tiles with V not a multiple of the
tile, a maximum that moves into every tile, offsets of ±1e4, −inf entries and a row of −inf only, its launches
compiled for sm_90 without a GPU (`run_interpreted`); on CUDA (`-m gpu`) through `logsumexp_entropy`'s dispatch at
the LM head's shape. The objective's tests (tests/objective/test_logprobs.py) check the LM head that uses it."""

import pytest
import torch

from harts.ops.logsumexp import logsumexp_entropy, naive_logsumexp_entropy
from tests.ops.kda.interpreter import run_interpreted
from tests.ops.logsumexp.interpreter import row_error

CASES = ("one-row-partial-tile", "random", "rising", "offsets", "masked")


def test_interpreted_kernel_matches_reference():
    results = run_interpreted("tests.ops.logsumexp.interpreter", "kernel")
    # A row of −inf only: lse −inf and H NaN, from both forms.
    assert results.pop("masked.all_inf_row") == {"fused": [[float("-inf")], [True]],
                                                 "naive": [[float("-inf")], [True]]}
    assert all(results.pop(f"{case}.unchanged") for case in CASES)
    assert set(results) == {f"{case}.{value}" for case in CASES for value in ("lse", "lse_with_entropy", "entropy")}
    # fp32 against the fp64 reference (the worst row: relative at lse ≈ 1e4, absolute near 0): about 1e-7 measured.
    # Each value compared on its own: a NaN fails.
    assert all(error < 1e-6 for error in results.values()), results


def test_cpu_dispatch_is_the_pytorch_form_in_place():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(42)) * 4
    kept = logits.clone()
    lse, entropy = logsumexp_entropy(logits)
    assert entropy is None and torch.equal(logits, kept)
    assert torch.equal(lse, torch.logsumexp(kept, dim=-1))
    lse, entropy = logsumexp_entropy(logits, entropy=True)
    log_p = kept - lse[:, None]
    assert torch.equal(logits, log_p)  # the logits are scratch: the log-probs, in place
    assert torch.equal(entropy, -(log_p.exp() * log_p).sum(dim=-1))


def test_fused_refuses_what_it_does_not_run():
    from harts.ops.logsumexp import fused_logsumexp_entropy

    with pytest.raises(ValueError, match="expected contiguous fp32 logits"):
        fused_logsumexp_entropy(torch.zeros(4, 6).T)
    with pytest.raises(ValueError, match="expected contiguous fp32 logits"):
        fused_logsumexp_entropy(torch.zeros(4, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match="vocabulary is empty"):
        fused_logsumexp_entropy(torch.zeros(4, 0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("offset", [0.0, 1e4], ids=["centred", "offset-1e4"])
def test_cuda_dispatch_matches_reference_at_the_lm_heads_shape(offset):
    gen = torch.Generator(device="cuda").manual_seed(42)
    logits = torch.randn(2048, 157184, generator=gen, device="cuda") * 4 + offset
    logits[:8, 1000:] = float("-inf")  # rows with a masked tail
    kept = logits.clone()
    lse, entropy = logsumexp_entropy(logits, entropy=True)
    assert torch.equal(logits, kept)
    ref_lse, _ = naive_logsumexp_entropy(logits.double())
    assert row_error(lse, ref_lse) < 1e-6  # a NaN fails too
    ref_entropy = torch.cat([naive_logsumexp_entropy(logits[:8, :1000].double(), entropy=True)[1],
                             naive_logsumexp_entropy(logits[8:].double(), entropy=True)[1]])
    assert row_error(entropy, ref_entropy) < 1e-6
