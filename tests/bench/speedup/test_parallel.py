"""`harts bench speedup --parallel` (harts.bench.speedup.parallel) on CPU ranks: the first slot of a plan, records of
dp2, tp2-sp, pp2 and ep2 whose figures agree with each other, and a model the config cannot split or a failed rank as
an error row."""

import math

import numpy as np
import pytest

from harts.bench.speedup.metrics import execution_times
from harts.bench.speedup.parallel import first_slot
from harts.parallel.launch import RankFailed
from tests.bench.speedup.helpers import check_record, speedup


def test_first_slot(tree_step_path):
    _, step = tree_step_path
    microbatches = [np.array([3, 1]), np.array([0]), np.array([2, 4, 5]), np.array([6, 7])]
    sub, members = first_slot(step, microbatches, dp=2)
    assert sub.ids == tuple(step.ids[k] for k in (3, 1, 0))
    assert [m.tolist() for m in members] == [[0, 1], [2]]
    assert np.array_equal(sub.trajectory_tokens(2), step.trajectory_tokens(0))


def test_unsplittable_model_and_failed_rank_are_error_rows(tree_step_path, tmp_path, capsys, monkeypatch):
    path, _ = tree_step_path
    too_wide = tmp_path / "tp4.yaml"
    too_wide.write_text("name: tp4\ntp: 4\n")
    code, records, _ = speedup(["--trees", path, "--capacity", "80", "--parallel", str(too_wide)], tmp_path, capsys)
    assert code == 1 and "not divisible by tp (4)" in records[0]["error"]
    assert records[0]["config"]["world_size"] == 4

    def failed_rank(*args, **kwargs):
        raise RankFailed("rank 1: RuntimeError: lost on purpose")

    monkeypatch.setattr("harts.parallel.launch.launch", failed_rank)
    code, records, printed = speedup(["--trees", path, "--capacity", "80", "--parallel", "dp2"], tmp_path, capsys)
    assert code == 1 and records[0]["error"] == "--parallel dp2: RankFailed: rank 1: RuntimeError: lost on purpose"
    assert printed[0]["error"] == records[0]["error"]


def _parallel_record(name, tree_step_path, tmp_path, capsys):
    from harts.parallel.config import load_parallel_config

    path, step = tree_step_path
    code, records, _ = speedup(["--trees", path, "--capacity", "80", "--repeats", "1", "--parallel", name],
                                tmp_path, capsys)
    assert code == 0, records
    (record,) = records
    parallel = load_parallel_config(name)
    check_record(record, step, name, parallel.world_size)
    results = record["results"]
    assert results["world_size"] == parallel.world_size and "breakdown" not in results
    assert results["breakdown_skipped"].startswith("--parallel")
    for name in ("baseline", "compact"):
        assert results[name]["microbatches"] % parallel.dp == 0
        assert len(results[name]["kda_calls"]) == results[name]["microbatches"]
    return record


def test_parallel_dp2_record(tree_step_path, tmp_path, capsys):
    record = _parallel_record("dp2", tree_step_path, tmp_path, capsys)
    for name in ("baseline", "compact"):
        execution = record["results"][name]
        assert execution["grad_reduction_s"] > 0
        (ranks,) = execution["samples"]
        assert execution["fbg_s"] == pytest.approx(max(r["forward"] + r["backward"] + r["grad_reduce"] for r in ranks))
        assert all(math.isfinite(r["grad_reduction_alone"]) and r["grad_reduction_alone"] > 0 for r in ranks)


@pytest.mark.parametrize("name", ["tp2-sp", "pp2", "ep2"])
def test_parallel_record_other_configs(name, tree_step_path, tmp_path, capsys):
    _parallel_record(name, tree_step_path, tmp_path, capsys)


@pytest.mark.gpu
def test_parallel_dp2_record_cuda(tree_step_path, tmp_path, capsys):
    """NCCL ranks, CUDA allocator peaks and bf16 with the GPU kernels (fla KDA, varlen attention)."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    path, step = tree_step_path
    code, records, _ = speedup(["--trees", path, "--capacity", "80", "--repeats", "2", "--parallel", "dp2",
                                 "--device", "cuda"], tmp_path, capsys)
    (record,) = records
    assert code == 0, record
    assert record["config"]["dtype"] == "bf16"
    results = record["results"]
    for name in ("baseline", "compact"):
        execution = results[name]
        assert len(execution["samples"]) == 2 and all(len(ranks) == 2 for ranks in execution["samples"])
        assert execution_times(execution["samples"]) == {k: execution[k] for k in execution_times(execution["samples"])}
        assert execution["grad_reduction_s"] > 0 and execution["peak_memory_bytes"] > 0
    assert 0 < results["baseline_mfu"] < 1
