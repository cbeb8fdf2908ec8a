"""W&B logging of `harts rl`: one run per seed, every step at its step with both executions' figures."""

import sys

from harts.rl.config import load_rl_config, resolve
from harts.rl.loop import run_config
from harts.rl.tracking import RLTracker
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
