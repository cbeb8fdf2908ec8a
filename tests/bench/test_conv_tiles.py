"""`harts bench conv-tiles`: the tiles flag is checked, a CPU machine gets a one-line error; on CUDA (`-m gpu`)
every tile's record holds its times and agrees with the default tiles (tests/ops/conv checks the values of
the tiled kernels under the interpreter)."""

import json

import pytest
import torch

from harts.bench.conv_tiles import parse_tiles
from harts.cli.main import main


def test_parse_tiles():
    assert parse_tiles("32x128x4, 16x64x2") == [(32, 128, 4), (16, 64, 2)]
    for bad in ("32x128", "32x100x4", "32x128x32", "axbxc", "0x128x4"):
        with pytest.raises(ValueError, match="--tiles"):
            parse_tiles(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU error")
def test_needs_cuda(tmp_path, capsys):
    assert main(["bench", "conv-tiles", "--out", str(tmp_path / "t.json")]) != 0
    assert "needs a CUDA device" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_records(tmp_path):
    out = tmp_path / "tiles.json"
    assert main(["bench", "conv-tiles", "--model", "h200", "--rows", "4096", "--tiles", "32x128x4,16x64x2",
                 "--repeats", "2", "--out", str(out)]) == 0
    records = json.loads(out.read_text())
    assert [r["config"]["tile"]["rows"] for r in records] == [32, 16]
    assert records[0]["config"]["default_forward"] and records[1]["config"]["default_backward"]
    assert all(r["results"]["forward_ms"] > 0 and r["results"]["backward_ms"] > 0 for r in records)
