"""Optional Weights & Biases logging of a training run: one W&B run per `harts train` invocation.

`WandbTracker.start(start_record, run_dir)` opens a run in the mode harts.bench.wandb_log picks
(offline unless WANDB_MODE, WANDB_API_KEY or a sweep agent say otherwise; offline runs under
$WANDB_DIR or reports/wandb, for `wandb sync` later) with the resolved config, the start
record's allow-listed environment and `resumed_from`; `log(record)` logs every finite number of
a step record (nested keys flattened, `seconds/forward`) at W&B step = the training step, so a
resumed run's curve continues where the checkpoint left off; `finish(failed)` closes the run and
shuts the W&B service down so offline files are complete. As for the benchmarks, W&B never fails
a run: whatever it raises becomes one warning line and logging stops; W&B's own git, code and
system capture are off. Tested with a stand-in `wandb` module in tests/training/test_tracking.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from harts.bench.wandb_log import DEFAULT_DIR, DEFAULT_PROJECT, INIT_TIMEOUT_S, flatten_metrics, wandb_mode


class WandbTracker:
    def __init__(self) -> None:
        self.run = None
        self._wandb = None
        self._offline_dir: Path | None = None

    @classmethod
    def start(cls, start_record: dict[str, Any], run_dir: str | Path) -> WandbTracker:
        tracker = cls()
        mode = wandb_mode()
        if mode != "disabled":
            tracker._guard(tracker._init, start_record, Path(run_dir), mode)
        return tracker

    def _init(self, start_record: dict[str, Any], run_dir: Path, mode: str) -> None:
        import wandb

        directory = Path(os.environ.get("WANDB_DIR") or DEFAULT_DIR)
        directory.mkdir(parents=True, exist_ok=True)
        train = start_record["config"]["train"]
        environment = {k: v for k, v in start_record["environment"].items() if k != "utc"}
        settings = wandb.Settings(
            silent=True, console="off", init_timeout=INIT_TIMEOUT_S, x_disable_stats=True, x_disable_meta=True,
            x_disable_machine_info=True, disable_git=True, disable_code=True, save_code=False,
        )
        tags = [train["model"], train["execution"]["execution"], train["execution"]["planner"], train["device"],
                train["dtype"], train["loss"]["name"]]
        self._wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT, dir=str(directory), mode=mode,
            config={**start_record["config"], "environment": environment, "resumed_from": start_record["resumed_from"]},
            settings=settings, group=f"train/{train['model']}", job_type="train", name=run_dir.name,
            tags=sorted({str(t)[:64] for t in tags}),
        )
        if mode == "offline":
            self._offline_dir = Path(self.run.dir).parent

    def log(self, record: dict[str, Any]) -> None:
        if self.run is not None:
            metrics = flatten_metrics({k: v for k, v in record.items() if k not in ("event", "step")})
            self._guard(self.run.log, metrics, step=record["step"])

    def finish(self, failed: bool) -> None:
        if self.run is not None:
            self._guard(self.run.finish, exit_code=1 if failed else 0)
            self.run = None
        if self._wandb is not None:
            self._guard(self._wandb.teardown)
            self._wandb = None
        if self._offline_dir is not None:
            print(f"wandb: offline run in {self._offline_dir}; upload with `wandb sync {self._offline_dir}`",
                  file=sys.stderr)
            self._offline_dir = None

    def _guard(self, function, *args, **kwargs) -> None:
        try:
            function(*args, **kwargs)
        except (Exception, SystemExit) as error:  # W&B must never fail training.
            message = str(error).strip().splitlines()[0] if str(error).strip() else ""
            print(f"harts: warning: W&B logging stopped ({type(error).__name__}: {message})", file=sys.stderr)
            self.run = None
