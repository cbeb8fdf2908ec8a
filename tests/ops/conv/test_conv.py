"""The fused causal conv + SiLU (`fused_shifted_conv_silu`, `Layout.causal_conv_silu(fused=True)`)
against the reference: on CPU under the Triton interpreter in fp32 (a subprocess:
tests/ops/conv/interpreter.py) to fp32 rounding; on CUDA (`-m gpu`) in bf16 within bf16 tolerances."""

from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from harts.ops.conv import naive_shifted_conv_silu
from harts.runtime.layout import compact_layout, naive_causal_conv
from harts.trees.trie import PrefixIndex
from tests.ops.kda.helpers import relative_error, value_and_grads
from tests.ops.kda.interpreter import run_interpreted
from tests.trees.helpers import make_step, random_sequences


def test_interpreted_kernel_matches_reference():
    errors = run_interpreted("tests.ops.conv.interpreter", "kernel")
    assert len(errors) == 15
    assert max(errors.values()) < 1e-5, errors


def test_interpreted_tiles_give_the_same_values():
    """Any tile of the shifted kernels computes each element the same way (the tile benchmark's premise)."""
    errors = run_interpreted("tests.ops.conv.interpreter", "tiles")
    assert len(errors) == 9
    assert all(v == 0.0 for k, v in errors.items() if not k.endswith(".dw")), errors
    assert max(errors.values()) < 1e-6, errors


def test_interpreted_layout_fixes_the_exception_rows():
    errors = run_interpreted("tests.ops.conv.interpreter", "layout")
    counts = {name: errors.pop(name) for name in list(errors) if name.endswith("exception_rows")}
    assert min(counts.values()) > 0, counts
    assert len(errors) == 12
    assert max(errors.values()) < 1e-5, errors


def test_interpreted_one_node_equals_the_composition_without_full_size_copies():
    """`fused_conv_silu` gives the values of the shifted node + `index_copy` of the gathered node's rows (y, dx,
    dw), on both executions' layouts, and makes no full-size tensor outside its kernels (the composition makes
    several: y's copy, dy with the exception rows zeroed, the gathered node's zero dx, the sum of the two dx)."""
    results = run_interpreted("tests.ops.conv.interpreter", "one_node")
    assert min(v for k, v in results.items() if k.endswith("exception_rows")) > 0, results
    assert all(v == 0 for k, v in results.items() if k.endswith("_differing")), results
    assert all(v == 0 for k, v in results.items() if k.endswith("one_node_full_size_ops")), results
    assert min(v for k, v in results.items() if k.endswith("composition_full_size_ops")) >= 3, results


def _check_bitwise(counts):
    assert min(v for k, v in counts.items() if k.endswith("compact_exception_rows")) > 0, counts
    assert all(v == 0 for k, v in counts.items() if k.endswith("differing_positions")), counts


def test_interpreted_executions_agree_bitwise():
    _check_bitwise(run_interpreted("tests.ops.conv.interpreter", "executions"))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64", "bf16"])
def test_reference_is_the_layout_conv_of_one_sequence(dtype):
    """With no exception rows but the first W − 1 (one sequence), the reference equals SiLU of the
    layout's shifted conv (same taps; bf16: one rounding instead of one per tap)."""
    gen = torch.Generator().manual_seed(42)
    x = torch.randn(37, 12, generator=gen, dtype=torch.float64)
    weight = torch.randn(12, 4, generator=gen, dtype=torch.float64)
    predecessors = torch.arange(37)[:, None] - torch.arange(1, 4)
    predecessors = torch.where(predecessors >= 0, predecessors, 37)
    expected = F.silu(naive_causal_conv(x, weight, predecessors)).view(37, 3, 4).transpose(0, 1)
    got = naive_shifted_conv_silu(x.to(dtype), weight.to(dtype), 3)
    assert got.shape == (3, 37, 4) and got.is_contiguous()
    tolerance = 1e-12 if dtype == torch.float64 else 1e-2
    torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("rows", [1, 1000, 4099])
def test_cuda_kernel_matches_reference(rows):
    from harts.ops.conv import fused_shifted_conv_silu

    gen = torch.Generator(device="cuda").manual_seed(42)
    x = torch.randn(rows, 3 * 256, generator=gen, device="cuda")
    weight = torch.randn(3 * 256, 4, generator=gen, device="cuda") * 0.5
    upstream = torch.randn(3, rows, 256, generator=gen, device="cuda")
    expected = value_and_grads(partial(naive_shifted_conv_silu, num_parts=3),
                               [x.double().requires_grad_(), weight.double().requires_grad_()], upstream)
    got = value_and_grads(partial(fused_shifted_conv_silu, num_parts=3),
                          [x.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()], upstream)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.bfloat16
    # bf16 inputs: the reference sees the same rounded inputs only up to their rounding (~2^-9).
    for actual, reference in zip(got, expected):
        assert relative_error(actual, reference) < 2e-2


@pytest.mark.gpu
@requires_cuda
def test_cuda_layout_matches_the_unfused_path():
    rng = np.random.default_rng(0)
    step = make_step(random_sequences(rng, 10, 60, 3))
    layout = compact_layout(step, PrefixIndex.from_step(step), np.arange(step.num_trajectories), conv_size=4,
                            chunk_size=4, replay=True).to("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(layout.num_kda_rows, 3 * 64, generator=gen, device="cuda")
    weight = torch.randn(3 * 64, 4, generator=gen, device="cuda")
    upstream = torch.randn(3, layout.num_kda_rows, 64, generator=gen, device="cuda")
    results = []
    for fused, dtype in ((False, torch.float64), (True, torch.bfloat16)):
        leaves = [x.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_()]
        results.append(value_and_grads(partial(layout.causal_conv_silu, num_parts=3, fused=fused), leaves, upstream))
    for actual, reference in zip(results[1], results[0]):
        assert relative_error(actual, reference) < 2e-2


@pytest.mark.gpu
@requires_cuda
def test_cuda_executions_agree_bitwise():
    """The compiled kernels (where contraction into fused multiply-adds is the compiler's choice
    unless written out) give every row the same bits in both executions."""
    from tests.ops.conv.interpreter import differing_positions

    _check_bitwise(differing_positions("cuda", "bfloat16"))
