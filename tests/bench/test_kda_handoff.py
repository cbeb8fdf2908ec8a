"""`harts bench kda-handoff`'s harness on CPU: the GPU measurements faked, the records checked.

The kernels themselves are checked by tests/ops/kda (interpreter on CPU, bf16 on a GPU); here the
harness must keep every case as a record, written as it comes, and a SIGTERM (a device slot's
timeout) must leave the finished cases and an error row naming the case it stopped.
"""

import json
import signal

import pytest
import torch

import harts.bench.kda_handoff as kda_handoff
from harts.cli.main import main

from .helpers import sigterm_on_call

CHECK = {"ok": True, "packed_call": {"o": 0.003}, "compact_tree": {"o": 0.003}, "tolerance": {}}


def _fake_case(args, num_seqs, num_boundaries):
    timing = {"median_ms": 2.0 + num_boundaries, "min_ms": 2.0, "max_ms": 3.0, "times_ms": [2.0]}
    return {"boundary_states": num_boundaries, "split_calls": 1, "unsplit": timing, "ours": timing,
            "ours_over_unsplit": 1.0}


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake GPU")
    monkeypatch.setattr(kda_handoff, "_check", lambda args: CHECK)
    monkeypatch.setattr(kda_handoff, "_handoff_case", _fake_case)


def _run(tmp_path, *extra):
    out = tmp_path / "handoff.json"
    code = main(["bench", "kda-handoff", "--sequences", "1,64", "--boundaries", "0,512", "--out", str(out), *extra])
    return code, json.loads(out.read_text())


def test_one_record_per_case_after_the_check(fake_gpu, tmp_path):
    code, records = _run(tmp_path)
    assert code == 0
    assert [r["benchmark"] for r in records] == ["kda-handoff-check"] + ["kda-handoff"] * 4
    cases = [(r["config"]["sequences"], r["config"]["boundaries_requested"]) for r in records[1:]]
    assert cases == [(1, 0), (1, 512), (64, 0), (64, 512)]
    assert records[2]["results"]["ours"]["median_ms"] == 514.0


def test_a_failed_check_refuses_the_timings(fake_gpu, tmp_path, monkeypatch):
    monkeypatch.setattr(kda_handoff, "_check", lambda args: CHECK | {"ok": False})
    code, records = _run(tmp_path)
    assert code == 1 and records[-1]["error"] == "correctness check failed; timings refused"


def test_sigterm_keeps_the_finished_cases_and_names_the_stopped_one(fake_gpu, tmp_path, monkeypatch):
    monkeypatch.setattr(kda_handoff, "_handoff_case", sigterm_on_call(_fake_case, 3))
    code, records = _run(tmp_path)
    assert code == 128 + signal.SIGTERM
    assert ["error" in r for r in records] == [False, False, False, True]
    stopped = records[-1]
    assert stopped["config"]["sequences"] == 64 and stopped["config"]["boundaries_requested"] == 0
    assert stopped["error"] == "Terminated: SIGTERM"


def test_without_a_gpu_it_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "kda-handoff", "--out", str(tmp_path / "x.json")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_records_are_on_disk_before_the_next_case(fake_gpu, tmp_path, monkeypatch):
    """A run killed outright (SIGKILL, a lost machine) still leaves the cases it finished."""
    seen = []

    def case(args, num_seqs, num_boundaries):
        seen.append(len(json.loads((tmp_path / "handoff.json").read_text())))
        return _fake_case(args, num_seqs, num_boundaries)

    monkeypatch.setattr(kda_handoff, "_handoff_case", case)
    code, _ = _run(tmp_path)
    assert code == 0 and seen == [1, 2, 3, 4]


def test_the_tree_case_record_and_its_error_row_share_one_config(fake_gpu, tmp_path, monkeypatch):
    tree = {"semantic_rows": 10, "compact_rows": 4, "calls": 2, "compact": {"median_ms": 1.0},
            "compact_separate_calls": {"median_ms": 1.5}, "per_trajectory": {"median_ms": 2.0}, "speedup": 2.0,
            "output_drift_vs_per_trajectory": 0.0}
    monkeypatch.setattr(kda_handoff, "_tree_case", lambda args, synth: tree)
    code, records = _run(tmp_path, "--trees", "configs/trees/tiny.yaml")
    assert code == 0 and records[-1]["benchmark"] == "kda-compact-tree"
    config = records[-1]["config"]
    # The config's own tasks (a paper step of one task cannot reach the compression it is calibrated to).
    assert config["trees"] == "configs/trees/tiny.yaml" and config["synth"]["num_tasks"] == config["tasks"] == 2
    assert config["heads"] == 16 and config["dtype"] == "bfloat16"

    _, records = _run(tmp_path, "--trees", "configs/trees/tiny.yaml", "--tasks", "1")
    assert records[-1]["config"]["synth"]["num_tasks"] == records[-1]["config"]["tasks"] == 1

    monkeypatch.setattr(kda_handoff, "_tree_case", sigterm_on_call(lambda args, synth: tree, 1))
    code, stopped = _run(tmp_path, "--trees", "configs/trees/tiny.yaml")
    assert code == 128 + signal.SIGTERM and stopped[-1]["config"] == config
    assert stopped[-1]["error"] == "Terminated: SIGTERM"
