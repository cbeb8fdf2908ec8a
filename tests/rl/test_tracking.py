"""W&B logging of `harts rl`: one run per seed, every step at its step with both executions' figures."""

import argparse
import sys

import pytest

from harts.rl.config import load_rl_config, resolve
from harts.rl.loop import run_config
from harts.rl.tracking import RLTracker
from harts.tracking.wandb_log import WandbOptions, add_arguments, requested
from tests.rl.test_loop import TINY
from tests.training.test_tracking import fake_wandb, wandb_env  # noqa: F401


def test_each_step_is_logged_with_both_executions(wandb_env, monkeypatch, tmp_path, capsys):  # noqa: F811
    calls: list = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    config = resolve(load_rl_config(TINY))
    tracker = RLTracker.start({"config": run_config(config, 1), "environment": {"git": {"sha": "x"}, "utc": "now"}})
    for step in range(2):
        tracker.log({"step": step, "compact": {"reward": 0.5, "kl": None, "seconds": {"train": 0.1}},
                     "baseline": {"reward": 0.25, "kl": 0.0, "seconds": {"train": 0.3}}})
    tracker.finish(False)
    (_, run), finish, teardown = calls
    assert (finish, teardown) == (("finish", 0), ("teardown",))
    assert run.kwargs["group"] == "rl/tiny" and run.kwargs["job_type"] == "rl" and run.kwargs["name"] == "tiny/seed1"
    assert run.kwargs["mode"] == "offline" and run.kwargs["config"]["rl"]["num_steps"] == 3
    assert run.kwargs["config"]["environment"] == {"git": {"sha": "x"}}
    assert set(run.kwargs["tags"]) == {"tiny", "compact", "baseline", "cpu", "fp32", "rl"}
    assert [step for step, _ in run.logged] == [0, 1]
    assert run.logged[0][1] == {"compact/reward": 0.5, "compact/seconds/train": 0.1, "baseline/reward": 0.25,
                                "baseline/kl": 0.0, "baseline/seconds/train": 0.3}
    assert "offline run in" in capsys.readouterr().err


def test_disabled_logs_nothing(wandb_env, monkeypatch):  # noqa: F811
    calls: list = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    tracker = RLTracker.start({"config": run_config(resolve(load_rl_config(TINY)), 0),
                               "environment": {}})
    tracker.log({"step": 0, "compact": {"reward": 1.0}})
    tracker.finish(False)
    assert calls == []


def test_a_failing_wandb_never_fails_the_run(wandb_env, monkeypatch, capsys):  # noqa: F811
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb([], fail=RuntimeError("no network")))
    tracker = RLTracker.start({"config": run_config(resolve(load_rl_config(TINY)), 0),
                               "environment": {}})
    tracker.log({"step": 0, "compact": {"reward": 1.0}})
    tracker.finish(True)
    assert "W&B logging stopped (RuntimeError: no network)" in capsys.readouterr().err


def _start_with(options, monkeypatch, environ=None):
    calls: list = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    for name, value in (environ or {}).items():
        monkeypatch.setenv(name, value)
    tracker = RLTracker.start({"config": run_config(resolve(load_rl_config(TINY)), 1), "environment": {}}, options)
    tracker.finish(False)
    return calls[0][1].kwargs if calls else None


def test_flags_name_project_group_and_mode(wandb_env, monkeypatch):  # noqa: F811
    kwargs = _start_with(WandbOptions(project="mine", group="sweep-3", mode="online"), monkeypatch)
    assert (kwargs["project"], kwargs["group"], kwargs["mode"]) == ("mine", "sweep-3", "online")
    assert kwargs["name"] == "tiny/seed1" and kwargs["job_type"] == "rl"
    assert not kwargs["settings"].get("x_disable_stats"), "system metrics on"


def test_environment_variables_win_over_flags(wandb_env, monkeypatch):  # noqa: F811
    environ = {"WANDB_PROJECT": "theirs", "WANDB_RUN_GROUP": "g", "WANDB_TAGS": "a,b", "WANDB_MODE": "offline"}
    kwargs = _start_with(WandbOptions(project="mine", group="sweep-3", mode="online"), monkeypatch, environ)
    # W&B reads a set variable itself: the argument is not passed, so it cannot override it.
    assert not {"project", "group", "tags"} & set(kwargs) and kwargs["mode"] == "offline"
    assert _start_with(WandbOptions(mode="offline"), monkeypatch, {"WANDB_MODE": "disabled"}) is None


@pytest.mark.parametrize("argv, expected", [([], False), (["--wandb"], True), (["--wandb-group", "g"], True),
                                            (["--wandb-project", "p"], True), (["--wandb-mode", "offline"], True)],
                         ids=["none", "wandb", "group", "project", "mode"])
def test_any_wandb_flag_asks_for_logging(argv, expected):
    parser = argparse.ArgumentParser()
    parser.add_argument("--wandb", action="store_true")
    add_arguments(parser)
    assert requested(parser.parse_args(argv)) is expected
