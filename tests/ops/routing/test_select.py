"""Expert selection: the reference against torch's top-k and the stated tie rule; `fused_select_experts` against
the reference bit for bit, on CPU under the Triton interpreter (a subprocess: tests/ops/routing/interpreter.py)
and on CUDA (`-m gpu`)."""

import pytest
import torch

from harts.bench.routing import torch_topk_selection
from harts.ops.routing import naive_select_experts, select_experts
from tests.ops.kda.interpreter import run_interpreted


@pytest.mark.parametrize("groups,kept", [(1, 1), (8, 4), (4, 1)], ids=["no-groups", "8-groups-keep-4", "keep-1"])
def test_reference_is_torch_topk_without_ties(groups, kept):
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    assert torch.equal(naive_select_experts(x, 4, groups, kept), torch_topk_selection(x, 4, groups, kept))


def test_reference_breaks_ties_to_the_lower_index():
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 0.0]])
    assert naive_select_experts(x, 4).tolist() == [[1, 2, 4, 3]]
    # groups (0,1) (2,3) (4,5) score 256, 257 and 250, but bf16 rounds 256 + 1 to 256: the first two tie
    y = torch.tensor([[256.0, 0.0, 256.0, 1.0, 250.0, 0.0]], dtype=torch.bfloat16)
    assert naive_select_experts(y, 2, 3, 1).tolist() == [[0, 1]]


def test_reference_picks_only_from_kept_groups():
    """A kept expert scoring −inf ranks above every masked one (a −inf fill would tie with it, lower index first)."""
    x = torch.tensor([[0.0, 0.0, 0.0, 5.0, 5.0, float("-inf")]])
    assert naive_select_experts(x, 3, 2, 1).tolist() == [[3, 4, 5]]


def test_reference_orders_special_values_as_the_cpu_sort():
    x = torch.tensor([[-0.0, 0.0, float("-nan"), float("inf"), float("nan"), 1.0]])
    assert naive_select_experts(x, 6).tolist() == [[2, 4, 3, 5, 0, 1]]


def test_reference_refuses_what_no_row_can_pick():
    x = torch.zeros(2, 12)
    with pytest.raises(ValueError, match="num_groups 5 must divide the 12 experts"):
        naive_select_experts(x, 2, 5, 1)
    with pytest.raises(ValueError, match="top_k 7 must lie in 1..6"):
        naive_select_experts(x, 7, 4, 2)
    with pytest.raises(ValueError, match="topk_groups"):
        naive_select_experts(x, 2, 4, 5)
    with pytest.raises(ValueError, match=r"expected selection scores \[N, E\]"):
        naive_select_experts(x.view(-1), 2)


def test_interpreted_kernel_matches_reference():
    differing = run_interpreted("tests.ops.routing.interpreter", "select")
    assert len(differing) == 9 and not any(differing.values()), differing


def test_select_experts_is_the_reference_on_cpu():
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    assert torch.equal(select_experts(x, 3, 4, 2), naive_select_experts(x, 3, 4, 2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", [(65536, 128, 8, 8, 4), (1000, 96, 6, 6, 3), (333, 64, 4, 1, 1)],
                         ids=["ling3", "not-pow2", "no-groups"])
def test_fused_matches_reference_on_cuda(dtype, shape):
    """Sigmoid scores plus a bias in bf16 tie often and round their group sums to nearest: bit for bit."""
    rows, experts, top_k, groups, kept = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(rows, experts, device="cuda", generator=gen).to(dtype)
    bias = (torch.randn(experts, device="cuda", generator=gen) * 0.01).to(dtype)
    selection = torch.sigmoid(logits) + bias
    got = select_experts(selection, top_k, groups, kept)
    assert torch.equal(got, naive_select_experts(selection, top_k, groups, kept))
    assert torch.equal(got, naive_select_experts(selection.cpu(), top_k, groups, kept).cuda())
