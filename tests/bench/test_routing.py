"""`harts bench routing`: a CPU machine gets a one-line error; on CUDA (`-m gpu`) the record holds both times and
the kernel equals the reference (tests/ops/routing checks the kernel under the interpreter); torch's composition
is the same selection where no scores tie."""

import json

import pytest
import torch

from harts.bench.routing import torch_topk_selection
from harts.cli.main import main
from harts.ops.routing import naive_select_experts


@pytest.mark.parametrize("groups,kept", [(1, 1), (8, 4)], ids=["no-groups", "8-groups-keep-4"])
def test_torch_composition_is_the_selection_without_ties(groups, kept):
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(torch_topk_selection(x, 6, groups, kept), naive_select_experts(x, 6, groups, kept))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU error")
def test_needs_cuda(tmp_path, capsys):
    assert main(["bench", "routing", "--out", str(tmp_path / "r.json")]) != 0
    assert "needs a CUDA device" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_record(tmp_path):
    out = tmp_path / "routing.json"
    assert main(["bench", "routing", "--model", "ling3-tiny", "--rows", "4096", "--repeats", "2",
                 "--out", str(out)]) == 0
    (record,) = json.loads(out.read_text())
    assert record["results"]["fused_equals_reference"] and record["results"]["fused_ms"] > 0
    assert record["config"]["num_groups"] == 8
