import sys
import types
from pathlib import Path

import pytest

from harts.training.config import load_train_config
from harts.training.loop import train

MICRO = str(Path(__file__).with_name("micro-trees.yaml"))
WANDB_VARIABLES = ("WANDB_MODE", "WANDB_API_KEY", "WANDB_SWEEP_ID", "WANDB_DIR", "WANDB_PROJECT", "WANDB_RUN_GROUP",
                   "WANDB_TAGS", "WANDB_NAME", "WANDB_JOB_TYPE")


def _config():
    return load_train_config(None, {"model": "tiny", "data.trees": MICRO, "num_steps": 3, "execution.capacity": 1024,
                                    "optimizer.lr": 1e-3})


class FakeRun:
    def __init__(self, calls, **kwargs):
        self.calls, self.kwargs, self.logged = calls, kwargs, []
        self.dir = str(Path(kwargs["dir"]) / "wandb" / "offline-run-1" / "files")

    def log(self, metrics, step):
        self.logged.append((step, metrics))

    def finish(self, exit_code=0):
        self.calls.append(("finish", exit_code))


def fake_wandb(calls: list, fail: BaseException | None = None):
    module = types.ModuleType("wandb")
    module.Settings = lambda **kwargs: kwargs

    def init(**kwargs):
        if fail is not None:
            raise fail
        calls.append(("init", FakeRun(calls, **kwargs)))
        return calls[-1][1]

    module.init = init
    module.teardown = lambda: calls.append(("teardown",))
    return module


@pytest.fixture
def wandb_env(monkeypatch, tmp_path):
    for name in WANDB_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))


def test_each_step_is_logged_at_its_training_step(wandb_env, monkeypatch, tmp_path, capsys):
    calls: list = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    run_dir = tmp_path / "run"
    train(_config(), run_dir, max_steps=2, wandb=True)
    train(_config(), run_dir, resume=True, wandb=True)
    offline = tmp_path / "wandb" / "wandb" / "offline-run-1"
    assert capsys.readouterr().err.count(f"wandb: offline run in {offline}; upload with `wandb sync {offline}`") == 2
    (_, first), finish, teardown, (_, second), *_ = calls
    assert finish == ("finish", 0) and teardown == ("teardown",) and calls[-2:] == [("finish", 0), ("teardown",)]
    assert first.kwargs["mode"] == "offline" and first.kwargs["dir"] == str(tmp_path / "wandb")
    assert first.kwargs["group"] == "train/tiny" and first.kwargs["name"] == "run"
    assert first.kwargs["config"]["train"]["optimizer"]["lr"] == 1e-3 and "git" in first.kwargs["config"]["environment"]
    # W&B's system metrics on (as the benchmarks' runs), its git capture off.
    assert first.kwargs["settings"]["disable_git"] and not first.kwargs["settings"].get("x_disable_stats")
    assert first.kwargs["project"] == "harts"
    assert (first.kwargs["config"]["resumed_from"], second.kwargs["config"]["resumed_from"]) == (None, "step_000002")
    assert [step for step, _ in first.logged] == [1, 2] and [step for step, _ in second.logged] == [3]
    metrics = second.logged[0][1]
    assert {"loss", "policy_loss", "moe_loss", "grad_norm", "lr", "clip_fraction", "kl", "seconds/forward"} <= set(metrics)
    assert "event" not in metrics and "step" not in metrics


def test_a_failed_run_is_marked(wandb_env, monkeypatch, tmp_path):
    calls: list = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))

    def stop(record):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(_config(), tmp_path, wandb=True, on_step_end=[stop])
    assert calls[-2:] == [("finish", 1), ("teardown",)]


@pytest.mark.parametrize("failure", [RuntimeError("wandb-core did not start"), SystemExit(1)],
                         ids=["exception", "system-exit"])
def test_wandb_failure_is_one_warning(wandb_env, monkeypatch, tmp_path, capsys, failure):
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb([], fail=failure))
    assert len(train(_config(), tmp_path, wandb=True)) == 3
    err = [line for line in capsys.readouterr().err.splitlines() if "W&B" in line]
    assert len(err) == 1 and err[0].startswith("harts: warning: W&B logging stopped (")


def test_disabled_does_not_import_wandb(wandb_env, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setitem(sys.modules, "wandb", None)  # an import would raise (and warn)
    assert len(train(_config(), tmp_path, wandb=True)) == 3
    assert "W&B" not in capsys.readouterr().err


@pytest.mark.parametrize("run_id_variable", [None, "fromenv1"], ids=["run-folder-id", "WANDB_RUN_ID"])
def test_files_go_to_the_run_folder_and_a_resume_continues_its_run(monkeypatch, tmp_path, run_id_variable):
    for name in (*WANDB_VARIABLES, "WANDB_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    if run_id_variable:
        monkeypatch.setenv("WANDB_RUN_ID", run_id_variable)
    monkeypatch.chdir(tmp_path)  # nothing may land in ./reports/wandb
    calls: list = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    run_dir = tmp_path / "run"
    train(_config(), run_dir, max_steps=2, wandb=True)
    train(_config(), run_dir, resume=True, wandb=True)
    train(_config(), tmp_path / "other", max_steps=1, wandb=True)
    first, second, other = [call[1].kwargs for call in calls if call[0] == "init"]
    assert first["dir"] == second["dir"] == str(run_dir) and other["dir"] == str(tmp_path / "other")
    assert not (tmp_path / "reports").exists()
    if run_id_variable:  # W&B reads the variable itself
        assert "id" not in first and not (run_dir / "wandb-run-id").exists()
    else:
        assert first["id"] == second["id"] == (run_dir / "wandb-run-id").read_text().strip() != other["id"]
        assert first["resume"] == second["resume"] == "allow"


def test_a_damaged_run_id_is_one_warning_and_training_goes_on(wandb_env, monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb([]))
    (tmp_path / "wandb-run-id").write_text("../../etc\n")
    assert len(train(_config(), tmp_path, wandb=True)) == 3
    err = [line for line in capsys.readouterr().err.splitlines() if "W&B" in line]
    assert err == [f"harts: warning: W&B logging stopped (ValueError: {tmp_path / 'wandb-run-id'}: not a W&B run id "
                   "(letters, digits, '-' or '_', at most 64))"]
