import json

import torch

from harts.cli.main import main
from harts.ops.attention.groups import BACKENDS, sdpa_group_attention


def test_warm_seed_runs_before_the_measured_step_and_first_calls_are_recorded(tmp_path, monkeypatch):
    """`--warm-seed` runs every backend on the other seed's trees first (so that the first call of
    the measured step meets the shapes a previous step left behind); the first call is timed apart
    from the repeats."""
    calls = []

    def spy(q, k, v, groups, scale):
        calls.append((q.shape[0], groups.num_kv_rows))
        return sdpa_group_attention(q, k, v, groups, scale)

    monkeypatch.setitem(BACKENDS, "spy", spy)
    out = tmp_path / "attention.json"

    def run(*extra):
        calls.clear()
        code = main(["bench", "attention", "--model", "tiny", "--trees", "tiny", "--device", "cpu", "--backends", "spy",
                     "--microbatches", "1", "--repeats", "2", "--out", str(out), "--wandb-mode", "disabled", *extra])
        assert code == 0
        return list(calls), json.loads(out.read_text())

    measured, records = run("--seed", "0")
    warmed, warm_records = run("--seed", "0", "--warm-seed", "1")
    other, _ = run("--seed", "1")
    # Per execution: the dense-reference check, the first call, 2 repeats; with --warm-seed the warm
    # seed's microbatch comes between the check and the first call.
    assert len(measured) == 8 and len(warmed) == 10
    for i in range(2):
        plain, warm, seed_1 = measured[4 * i : 4 * i + 4], warmed[5 * i : 5 * i + 5], other[4 * i : 4 * i + 4]
        assert seed_1[1] != plain[1]  # the seeds' layouts differ
        assert warm == [plain[0], seed_1[1], *plain[1:]]
    for record in warm_records:
        assert record["config"]["warm_seed"] == 1
        results = record["results"]
        assert results["first_call_seconds"] > 0 and len(results["per_microbatch_first_call_seconds"]) == 1
    assert all(r["config"]["warm_seed"] is None for r in records)


def _backward_replaced(gradient):
    """The identity with `gradient(grad)` as its backward: a backend whose forward is right and backward wrong."""

    class Replaced(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return gradient(grad)

    return Replaced.apply


_doubled = _backward_replaced(lambda grad: 2 * grad)
_nan = _backward_replaced(lambda grad: torch.full_like(grad, float("nan")))


def test_a_backend_with_a_wrong_gradient_is_refused_not_timed(tmp_path, monkeypatch):
    def wrong_backward(q, k, v, groups, scale):
        return sdpa_group_attention(q, _doubled(k), v, groups, scale)

    def nan_backward(q, k, v, groups, scale):
        return sdpa_group_attention(_nan(q), k, v, groups, scale)

    monkeypatch.setitem(BACKENDS, "wrong-backward", wrong_backward)
    monkeypatch.setitem(BACKENDS, "nan-backward", nan_backward)
    out = tmp_path / "attention.json"
    code = main(["bench", "attention", "--model", "tiny", "--trees", "tiny", "--device", "cpu", "--backends",
                 "sdpa,wrong-backward,nan-backward", "--microbatches", "1", "--repeats", "1", "--out", str(out),
                 "--wandb-mode", "disabled"])
    records = json.loads(out.read_text())
    assert code == 1
    by_backend = {(r["config"]["execution"], r["config"]["backend"]): r for r in records}
    for execution in ("baseline", "compact"):
        assert by_backend[(execution, "sdpa")]["results"]["check_relative_error"] < 1e-5
        assert "wrong-backward disagrees with the dense reference" in by_backend[(execution, "wrong-backward")]["error"]
        assert by_backend[(execution, "wrong-backward")]["error"].endswith("in dk")
        assert "in dq" in by_backend[(execution, "nan-backward")]["error"]


def test_triton_tree_records_its_tiles_and_is_refused_on_the_cpu(tmp_path, monkeypatch):
    """On the CPU the backend is an error record (its kernels run on CUDA); a run of it (here the sdpa loop standing
    in for its kernels) records its tile lists' size: pairs and the share needing no mask."""
    out = tmp_path / "attention.json"
    argv = ["bench", "attention", "--model", "tiny", "--trees", "tiny", "--device", "cpu", "--backends", "triton_tree",
            "--microbatches", "1", "--repeats", "1", "--out", str(out), "--wandb-mode", "disabled"]
    assert main(argv) == 1
    records = json.loads(out.read_text())
    assert len(records) == 2 and all("runs Triton kernels on CUDA" in r["error"] for r in records)
    monkeypatch.setitem(BACKENDS, "triton_tree", sdpa_group_attention)
    assert main(argv) == 0
    for record in json.loads(out.read_text()):
        results = record["results"]
        assert results["tile_rows"] == 32 and results["tile_pairs"] > 0 and 0 < results["full_tile_share"] < 1


def test_triton_tree_at_other_tiles_runs_them_and_records_them(tmp_path, monkeypatch):
    """`triton_tree@BQxBK` passes its tiles to the backend and records them; a bad tile shape or an unknown name is
    refused before any work."""
    from harts.ops.attention import groups

    out = tmp_path / "attention.json"
    argv = ["bench", "attention", "--model", "tiny", "--trees", "tiny", "--device", "cpu", "--microbatches", "1",
            "--repeats", "1", "--out", str(out), "--wandb-mode", "disabled", "--backends"]
    seen = []

    def stand_in(q, k, v, groups, scale, tiles=None):
        seen.append(tiles)
        return sdpa_group_attention(q, k, v, groups, scale)

    monkeypatch.setattr(groups, "triton_tree_group_attention", stand_in)
    assert main([*argv, "triton_tree@32x64"]) == 0
    assert set(seen) == {(32, 64)}
    for record in json.loads(out.read_text()):
        assert record["config"]["backend"] == "triton_tree@32x64"
        results = record["results"]
        assert (results["tile_rows"], results["key_tile_rows"]) == (32, 64) and results["tile_pairs"] > 0
    out.unlink()
    for bad in ("triton_tree@48x64", "triton_tree@64", "triton_tree@8x8", "tree"):
        assert main([*argv, f"sdpa,{bad}"]) == 2
        assert not out.exists()
