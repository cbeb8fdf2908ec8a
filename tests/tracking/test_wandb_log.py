"""harts.tracking.wandb_log: mode and run arguments (flags beside the environment variables, which win), one run
per record with live history rows, summary and the record as an artifact (stand-in `wandb` module); real
offline runs read back from their `.wandb` files: `harts bench speedup`'s live per-repeat history, its record
artifact and a report's PDF/CSV artifact; W&B failures never fail a benchmark."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from harts.cli.main import main
from harts.tracking import wandb_log
from harts.tracking.records import make_record
from harts.tracking.wandb_log import (BenchLogger, WandbOptions, flatten_metrics, init_arguments, log_records,
                                      log_report, run_identity, wandb_mode)

WANDB_VARIABLES = ("WANDB_MODE", "WANDB_API_KEY", "WANDB_SWEEP_ID", "WANDB_DIR", "WANDB_PROJECT", "WANDB_RUN_GROUP",
                   "WANDB_TAGS", "WANDB_NAME", "WANDB_JOB_TYPE")


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
    "nothing-set": ({}, None, "offline"),
    "api-key": ({"WANDB_API_KEY": "k"}, None, "online"),
    "sweep-agent": ({"WANDB_SWEEP_ID": "abc"}, None, "online"),
    "mode-wins": ({"WANDB_MODE": "disabled", "WANDB_API_KEY": "k"}, None, "disabled"),
    "explicit-offline": ({"WANDB_MODE": "offline", "WANDB_API_KEY": "k"}, None, "offline"),
    "flag": ({}, "disabled", "disabled"),
    "flag-beats-api-key": ({"WANDB_API_KEY": "k"}, "offline", "offline"),
    "variable-beats-flag": ({"WANDB_MODE": "online"}, "offline", "online"),
}


@pytest.mark.parametrize("case", list(MODES), ids=list(MODES))
def test_mode(case):
    environ, flag, expected = MODES[case]
    assert wandb_mode(environ, flag) == expected


IDENTITY = {"group": "speedup/tiny/dp2", "job_type": "speedup", "name": "speedup/tiny/dp2/harts/step0", "tags": ["x"]}
ARGUMENTS = {
    "defaults": ({}, WandbOptions(), {**IDENTITY, "project": "harts"}),
    "flags": ({}, WandbOptions(project="mine", group="ablation"), {**IDENTITY, "project": "mine", "group": "ablation"}),
    "variables-win": ({"WANDB_PROJECT": "p", "WANDB_RUN_GROUP": "g", "WANDB_TAGS": "a,b", "WANDB_NAME": "n",
                       "WANDB_JOB_TYPE": "j"}, WandbOptions(project="mine", group="ablation"), {}),
    "group-variable-only": ({"WANDB_RUN_GROUP": "g"}, WandbOptions(group="ablation"),
                            {k: v for k, v in {**IDENTITY, "project": "harts"}.items() if k != "group"}),
}


@pytest.mark.parametrize("case", list(ARGUMENTS), ids=list(ARGUMENTS))
def test_init_arguments(case):
    environ, options, expected = ARGUMENTS[case]
    assert init_arguments(IDENTITY, options, environ) == expected


def test_identity_one_run_per_record_and_metrics():
    record = speedup(0, parallel="dp2")
    assert run_identity("speedup", record["config"]) == {
        "group": "speedup/tiny/dp2", "job_type": "speedup", "name": "speedup/tiny/dp2/harts/step0",
        "tags": ["cpu", "dp2", "fp32", "harts", "recompute", "speedup", "tiny"]}
    assert run_identity("speedup", speedup(1)["config"])["name"] == "speedup/tiny/single/harts/step1"
    variant = {**speedup(1)["config"], "variant": "recompute-blocks=14,keep-attention"}
    name = run_identity("speedup", variant)["name"]
    assert name == "speedup/tiny/single/harts/step1/recompute-blocks=14,keep-attention"
    assert wandb_log.artifact_name(name) == "speedup-tiny-single-harts-step1-recompute-blocks-14-keep-attention"
    planning = {"trees": "configs/trees/paper.yaml", "data": "data/trees/paper", "step": 3, "planner": "treetrain-ortools"}
    assert run_identity("planning", planning)["group"] == "planning/paper"
    assert run_identity("planning", planning)["name"] == "planning/paper/treetrain-ortools/step3"
    trees = {"data": "data/trees/tiny/step_012.npz", "repeats": 3}
    assert run_identity("trees-build", trees)["name"] == "trees-build/tiny/step12"
    assert run_identity("trees-build", {"data": "data/trees/tiny"})["name"] == "trees-build/tiny"
    assert flatten_metrics(speedup(1)["results"]) == {"fbg_speedup": 3.0, "baseline/fbg_s": 4.0, "ok": 1}
    assert wandb_log.artifact_name("speedup/tiny/dp2/harts/step0") == "speedup-tiny-dp2-harts-step0"


class FakeArtifact:
    def __init__(self, name, type):
        self.name, self.type, self.files = name, type, {}

    def add_file(self, path, name, policy):
        self.files[name] = (Path(path).read_text(encoding="utf-8"), policy)


class FakeRun:
    def __init__(self, calls: list, **kwargs):
        self.calls, self.kwargs, self.summary, self.logged, self.artifacts = calls, kwargs, {}, [], []
        self.name = kwargs.get("name")
        folder = Path(kwargs["dir"]) / "wandb" / f"offline-run-{len(calls)}" / "files"
        folder.mkdir(parents=True)
        self.dir = str(folder)

    def log(self, metrics, step):
        self.logged.append((step, metrics))

    def log_artifact(self, artifact):
        self.artifacts.append(artifact)

    def finish(self, exit_code=0):
        self.calls.append(("finish", self.kwargs["name"], exit_code))


def fake_wandb(calls: list, fail: BaseException | None = None):
    module = types.ModuleType("wandb")
    module.Settings = lambda **kwargs: kwargs
    module.Artifact = FakeArtifact

    def init(**kwargs):
        if fail is not None:
            raise fail
        run = FakeRun(calls, **kwargs)
        calls.append(("init", run))
        return run

    module.init = init
    module.teardown = lambda: calls.append(("teardown",))
    return module


def test_one_run_per_record_with_live_rows(clean_env, monkeypatch, tmp_path):
    calls: list = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    logger = BenchLogger(WandbOptions(project="mine"), tmp_path)
    ok, failed = speedup(0), speedup(1, error="RuntimeError: out of memory")
    logger.start("speedup", ok["config"])
    logger.log({"repeat": 0, "baseline": {"forward_s": 1.5, "phase": "warm-up"}})
    logger.log({"repeat": 1, "compact": {"fbg_s": 0.5}})
    logger.finish(ok)
    logger.start("speedup", failed["config"])
    logger.finish(failed)
    dirs = logger.close()
    (_, first), finish_first, (_, second), finish_second, teardown = calls
    assert teardown == ("teardown",), "the service is shut down (runs flushed) before close returns"
    assert len(dirs) == 2 and Path(dirs[0]).name == "offline-run-0"
    assert first.kwargs["mode"] == "offline" and first.kwargs["project"] == "mine"
    assert (first.kwargs["group"], first.kwargs["name"]) == ("speedup/tiny/single", "speedup/tiny/single/harts/step0")
    assert first.kwargs["config"]["model"] == "tiny" and "git" in first.kwargs["config"]["environment"]
    settings = first.kwargs["settings"]
    assert settings["disable_git"] and settings["x_disable_meta"]
    assert not settings.get("x_disable_stats") and not settings.get("x_disable_machine_info"), "system metrics are on"
    assert first.logged == [(0, {"repeat": 0, "baseline/forward_s": 1.5}), (1, {"repeat": 1, "compact/fbg_s": 0.5})]
    assert first.summary == {"fbg_speedup": 2.0, "baseline/fbg_s": 4.0, "ok": 1, "data_step": 0}
    (artifact,) = first.artifacts
    assert (artifact.name, artifact.type) == ("speedup-tiny-single-harts-step0", "benchmark-record")
    text, policy = artifact.files["record.json"]
    assert json.loads(text) == json.loads(json.dumps(ok)) and policy == "immutable"
    assert finish_first == ("finish", "speedup/tiny/single/harts/step0", 0)
    assert second.logged == [] and second.summary == {"data_step": 1, "failed": 1, "error": "RuntimeError: out of memory"}
    assert finish_second == ("finish", "speedup/tiny/single/harts/step1", 1)


def test_a_record_left_open_is_closed_as_failed(clean_env, monkeypatch, tmp_path):
    calls: list = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    logger = BenchLogger(directory=tmp_path)
    logger.start("speedup", speedup(0)["config"])
    logger.start("speedup", speedup(1)["config"])
    logger.close()
    assert [c for c in calls if c[0] == "finish"] == [("finish", "speedup/tiny/single/harts/step0", 1),
                                                      ("finish", "speedup/tiny/single/harts/step1", 1)]


@pytest.mark.parametrize("failure", [RuntimeError("wandb-core did not start"), SystemExit(1)],
                         ids=["exception", "system-exit"])
def test_wandb_failure_is_one_warning(clean_env, monkeypatch, tmp_path, capsys, failure):
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb([], fail=failure))
    logger = BenchLogger(directory=tmp_path)
    for record in (speedup(0), speedup(1)):
        logger.start("speedup", record["config"])
        logger.log({"repeat": 1})
        logger.finish(record)
    assert logger.close() == []
    err = capsys.readouterr().err
    assert err.startswith("harts: warning: W&B logging skipped (") and err.count("\n") == 1


@pytest.mark.parametrize("how", ["variable", "flag"])
def test_disabled_does_not_import_wandb(clean_env, monkeypatch, tmp_path, capsys, how):
    if how == "variable":
        monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setitem(sys.modules, "wandb", None)  # an import would raise (and warn)
    options = WandbOptions(mode="disabled" if how == "flag" else None)
    assert log_records([speedup(0)], options, directory=tmp_path) == []
    assert capsys.readouterr().err == ""


def test_default_directory_is_under_reports(clean_env, monkeypatch, tmp_path):
    calls: list = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    monkeypatch.chdir(tmp_path)
    log_records([speedup(0)])
    assert calls[0][1].kwargs["dir"] == str(wandb_log.DEFAULT_DIR) == "reports/wandb"


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


def read_offline_run(run_dir: str | Path) -> dict:
    """What an offline run directory holds: its run record, history rows ({key: value}) and the time each was
    logged (`logged_at`, W&B's `_timestamp`: Unix seconds), summary updates,
    artifacts ({name: (type, {file: local path})}) and the number of system-metrics (stats) records."""
    from wandb.proto import wandb_internal_pb2

    run = {"run": None, "history": [], "logged_at": [], "summary": {}, "artifacts": {}, "stats": 0}
    for payload in read_wandb_file(next(Path(run_dir).glob("*.wandb"))):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["run"] = record.run
        elif kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            run["history"].append({k: v for k, v in row.items() if not k.startswith("_")})
            run["logged_at"].append(row["_timestamp"])
        elif kind == "summary":
            run["summary"].update({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                   for item in record.summary.update if item.key or item.nested_key})
        elif kind == "artifact":
            files = {entry.path: entry.local_path for entry in record.artifact.manifest.contents}
            run["artifacts"][record.artifact.name] = (record.artifact.type, files)
        elif kind == "stats":
            run["stats"] += 1
    return run


def test_bench_speedup_offline_run_has_live_history_and_the_record(clean_env, monkeypatch, tree_step_path, tmp_path,
                                                                  capsys):
    path, _ = tree_step_path
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    # System metrics sampled every 0.1 s here (15 s by default), so that this short run holds some.
    monkeypatch.setenv("WANDB_X_STATS_SAMPLING_INTERVAL", "0.1")
    out = tmp_path / "speedup.json"
    code = main(["bench", "speedup", "--model", "tiny", "--trees", path, "--capacity", "80", "--repeats", "2",
                 "--no-breakdown", "--out", str(out), "--wandb-project", "cluster-test", "--wandb-group", "g1"])
    assert code == 0
    assert "wandb sync" in capsys.readouterr().err
    (run_dir,) = (tmp_path / "wb" / "wandb").glob("offline-run-*")
    run = read_offline_run(run_dir)
    assert (run["run"].project, run["run"].run_group, run["run"].display_name) == (
        "cluster-test", "g1", "speedup/tiny/single/harts/step0")
    # Live rows as each phase finished: both warm-ups (repeat 0), then the timed repeats, executions interleaved.
    order = [(row["repeat"], next(k.split("/")[0] for k in row if k != "repeat")) for row in run["history"]]
    assert order == [(0, "baseline"), (0, "compact"), (1, "baseline"), (1, "compact"), (2, "baseline"),
                     (2, "compact")]
    # Live, not buffered until the record is done: every phase after the first row ran between the first row's
    # and the last row's logging.
    later_phases_s = sum(value for row in run["history"][1:] for key, value in row.items() if key.endswith("/fbg_s"))
    assert run["logged_at"][-1] - run["logged_at"][0] >= 0.9 * later_phases_s > 0
    (record,) = json.loads(out.read_text())
    for execution in ("baseline", "compact"):
        timed = [row[f"{execution}/fbg_s"] for row in run["history"] if f"{execution}/fbg_s" in row][1:]
        assert timed == pytest.approx(record["results"][execution]["fbg_repeats_s"], rel=1e-12)
    assert run["summary"]["fbg_speedup"] == pytest.approx(record["results"]["fbg_speedup"], rel=1e-12)
    kind, files = run["artifacts"]["speedup-tiny-single-harts-step0"]
    assert kind == "benchmark-record"
    assert json.loads(Path(files["record.json"]).read_text()) == record
    assert Path(files["record.json"]).is_relative_to(run_dir), "the artifact's file lives in the run directory"
    assert run["stats"] > 0, "system metrics were sampled"


def test_report_artifact(clean_env, tmp_path):
    (tmp_path / "speedup.pdf").write_bytes(b"%PDF-1.4 not a real figure")
    (tmp_path / "speedup.csv").write_text("source,model\nours,tiny\n", encoding="utf-8")
    (run_dir,) = log_report("speedup", [tmp_path / "speedup.pdf", tmp_path / "speedup.csv"],
                            records=["reports/raw/speedup/tiny/single.json"], directory=tmp_path / "wb")
    run = read_offline_run(run_dir)
    assert (run["run"].job_type, run["run"].display_name) == ("report", "report/speedup")
    kind, files = run["artifacts"]["report-speedup"]
    assert kind == "report" and sorted(files) == ["speedup.csv", "speedup.pdf"]
    assert Path(files["speedup.pdf"]).read_bytes() == b"%PDF-1.4 not a real figure"


def test_report_files_of_one_name_are_one_warning_not_one_lost(clean_env, tmp_path, capsys):
    """Two report files named alike would be one file in the artifact: refused in one warning, the report kept."""
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "table.csv").write_text(f"source\n{folder}\n", encoding="utf-8")
    paths = [tmp_path / "a" / "table.csv", tmp_path / "b" / "table.csv"]
    assert log_report("tables", paths, directory=tmp_path / "wb") == []
    assert capsys.readouterr().err == (
        f"harts: warning: W&B logging skipped (ValueError: artifact report-tables: two files named table.csv "
        f"({paths[0]}, {paths[1]}); one would replace the other)\n")
    assert [p.read_text() for p in paths] == ["source\na\n", "source\nb\n"]


def test_bench_planning_offline_runs_per_step_and_planner(clean_env, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    out = tmp_path / "planning.json"
    code = main(["bench", "planning", "--trees", "tiny", "--steps", "0,1", "--capacity", "512", "--dp", "2",
                 "--planners", "harts,greedy-trie", "--repeats", "2", "--out", str(out)])
    assert code == 0
    records = {(r["config"]["planner"], r["config"]["step"]): r for r in json.loads(out.read_text())}
    runs = [read_offline_run(d) for d in (tmp_path / "wb" / "wandb").glob("offline-run-*")]
    assert sorted(run["run"].display_name for run in runs) == [
        f"planning/tiny/{planner}/step{step}" for planner in ("greedy-trie", "harts") for step in (0, 1)]
    for run in runs:
        _, _, planner, step = run["run"].display_name.split("/")
        record = records[(planner, int(step[4:]))]
        assert [row["repeat"] for row in run["history"]] == [1, 2]
        assert [row["plan_seconds"] for row in run["history"]] == pytest.approx(
            record["results"]["plan_seconds_each"], rel=1e-12)
        assert run["summary"]["compact_tokens"] == record["results"]["compact_tokens"]
        kind, files = run["artifacts"][wandb_log.artifact_name(run["run"].display_name)]
        assert kind == "benchmark-record" and json.loads(Path(files["record.json"]).read_text()) == record
