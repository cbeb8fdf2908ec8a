"""harts.bench.wandb_log: mode, grouping and metrics of W&B runs; a real offline run read back from its
`.wandb` file; W&B failures never fail a benchmark."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from harts.bench import wandb_log
from harts.bench.records import make_record
from harts.bench.wandb_log import flatten_metrics, group_runs, log_records, run_identity, wandb_mode

WANDB_VARIABLES = ("WANDB_MODE", "WANDB_API_KEY", "WANDB_SWEEP_ID", "WANDB_DIR", "WANDB_PROJECT")


@pytest.fixture
def clean_env(monkeypatch):
    for name in WANDB_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def speedup(step: int, parallel: str = "single", error: str | None = None) -> dict:
    config = {"model": "tiny", "parallel": parallel, "planner": "harts", "device": "cpu", "dtype": "fp32",
              "recompute": True, "trees": "data/trees/tiny/step_000.npz", "step": step}
    if error:
        return make_record("speedup", config, error=error)
    return make_record("speedup", config, {"fbg_speedup": 2.0 + step, "baseline": {"fbg_s": 4.0, "samples": [1, 2]},
                                           "ok": True, "note": "text", "nan": float("nan")})


MODES = {
    "nothing-set": ({}, "offline"),
    "api-key": ({"WANDB_API_KEY": "k"}, "online"),
    "sweep-agent": ({"WANDB_SWEEP_ID": "abc"}, "online"),
    "mode-wins": ({"WANDB_MODE": "disabled", "WANDB_API_KEY": "k"}, "disabled"),
    "explicit-offline": ({"WANDB_MODE": "offline", "WANDB_API_KEY": "k"}, "offline"),
}


@pytest.mark.parametrize("case", list(MODES), ids=list(MODES))
def test_mode(case):
    environ, expected = MODES[case]
    assert wandb_mode(environ) == expected


def test_identity_groups_and_metrics():
    identity = run_identity(speedup(0, parallel="dp2"))
    assert identity == {"group": "speedup/tiny/dp2", "job_type": "speedup", "name": "speedup/tiny/dp2/harts",
                        "tags": ["cpu", "dp2", "fp32", "harts", "recompute", "speedup", "tiny"]}
    planning = make_record("planning", {"trees": "configs/trees/paper.yaml", "data": "data/trees/paper", "step": 3,
                                        "planner": "treetrain-ortools"}, {"compact_tokens": 5})
    assert run_identity(planning)["group"] == "planning/paper"
    assert run_identity(planning)["name"] == "planning/paper/treetrain-ortools"
    runs = group_runs([speedup(0), speedup(1), speedup(0, parallel="dp2")])
    assert [(identity["name"], len(records)) for identity, records in runs] == [
        ("speedup/tiny/single/harts", 2), ("speedup/tiny/dp2/harts", 1)]
    assert flatten_metrics(speedup(1)["results"]) == {"fbg_speedup": 3.0, "baseline/fbg_s": 4.0, "ok": 1}


class FakeRun:
    def __init__(self, calls: list, **kwargs):
        self.calls, self.kwargs, self.summary, self.logged = calls, kwargs, {}, []
        self.dir = str(Path(kwargs["dir"]) / "wandb" / f"offline-run-{len(calls)}" / "files")

    def log(self, metrics, step):
        self.logged.append((step, metrics))

    def finish(self, exit_code=0):
        self.calls.append(("finish", self.kwargs["name"], exit_code))


def fake_wandb(calls: list, fail: BaseException | None = None):
    module = types.ModuleType("wandb")
    module.Settings = lambda **kwargs: kwargs

    def init(**kwargs):
        if fail is not None:
            raise fail
        run = FakeRun(calls, **kwargs)
        calls.append(("init", run))
        return run

    module.init = init
    module.teardown = lambda: calls.append(("teardown",))
    return module


def test_one_run_per_configuration(clean_env, monkeypatch, tmp_path):
    calls: list = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    records = [speedup(0), speedup(1, error="RuntimeError: out of memory"), speedup(0, parallel="dp2")]
    dirs = log_records(records, directory=tmp_path)
    assert len(dirs) == 2
    (_, first), _, (_, second), _, teardown = calls
    assert teardown == ("teardown",), "the service is shut down (runs flushed) before log_records returns"
    assert first.kwargs["mode"] == "offline" and first.kwargs["project"] == "harts"
    assert first.kwargs["group"] == "speedup/tiny/single" and first.kwargs["job_type"] == "speedup"
    assert first.kwargs["config"]["model"] == "tiny" and "git" in first.kwargs["config"]["environment"]
    assert first.kwargs["settings"]["x_disable_stats"] and first.kwargs["settings"]["disable_git"]
    assert first.logged == [(0, {"fbg_speedup": 2.0, "baseline/fbg_s": 4.0, "ok": 1, "data_step": 0}),
                            (1, {"data_step": 1, "failed": 1})]
    assert first.summary == {"error": "RuntimeError: out of memory"}
    assert calls[1] == ("finish", "speedup/tiny/single/harts", 1) and calls[3][2] == 0
    assert second.kwargs["group"] == "speedup/tiny/dp2"


@pytest.mark.parametrize("failure", [RuntimeError("wandb-core did not start"), SystemExit(1)],
                         ids=["exception", "system-exit"])
def test_wandb_failure_is_one_warning(clean_env, monkeypatch, tmp_path, capsys, failure):
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb([], fail=failure))
    assert log_records([speedup(0)], directory=tmp_path) == []
    err = capsys.readouterr().err
    assert err.startswith("harts: warning: W&B logging skipped (") and err.count("\n") == 1


def test_disabled_does_not_import_wandb(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setitem(sys.modules, "wandb", None)  # an import would raise
    assert log_records([speedup(0)], directory=tmp_path) == []


def read_wandb_file(path: Path) -> list[bytes]:
    """Payloads of a W&B transaction log (LevelDB log format: 7-byte file header, 32 KiB blocks of records
    with a 7-byte header: crc32c, length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, payloads, pending = 7, [], b""
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        if left < 7:
            position += left
            continue
        length, kind = int.from_bytes(data[position + 4 : position + 6], "little"), data[position + 6]
        payload = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind == 1:
            payloads.append(payload)
        elif kind == 2:
            pending = payload
        elif kind == 3:
            pending += payload
        elif kind == 4:
            payloads.append(pending + payload)
        else:
            break
    return payloads


def test_real_offline_run(clean_env, tmp_path, capsys):
    from wandb.proto import wandb_internal_pb2

    dirs = log_records([speedup(0), speedup(1)], directory=tmp_path)
    assert len(dirs) == 1 and Path(dirs[0]).name.startswith("offline-run-")
    assert "wandb sync" in capsys.readouterr().err
    runs, history = [], []
    for payload in read_wandb_file(next(Path(dirs[0]).glob("*.wandb"))):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            runs.append(record.run)
        elif kind == "history":
            history.append({item.key or "/".join(item.nested_key): item.value_json for item in record.history.item})
    assert len(runs) == 1
    assert (runs[0].run_group, runs[0].job_type, runs[0].display_name) == (
        "speedup/tiny/single", "speedup", "speedup/tiny/single/harts")
    assert "recompute" in runs[0].tags
    assert [(float(h["fbg_speedup"]), int(h["data_step"])) for h in history] == [(2.0, 0), (3.0, 1)]


def test_default_directory_is_under_reports(clean_env, monkeypatch, tmp_path):
    calls: list = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    monkeypatch.chdir(tmp_path)
    log_records([speedup(0)])
    assert calls[0][1].kwargs["dir"] == str(wandb_log.DEFAULT_DIR) == "reports/wandb"
