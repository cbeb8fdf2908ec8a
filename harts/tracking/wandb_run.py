"""Optional Weights & Biases logging of a training run: one W&B run per `harts train` invocation.

`WandbTracker.start(start_record, run_dir, options)` opens a run the way the benchmarks do
(harts.tracking.wandb_log): the mode from WANDB_MODE, else `--wandb-mode`, else offline unless
WANDB_API_KEY or a sweep agent say online; project, group, name, job type and tags from the
`--wandb-*` flags over our defaults, and none whose environment variable (WANDB_PROJECT,
WANDB_RUN_GROUP, WANDB_NAME, WANDB_JOB_TYPE, WANDB_TAGS) is set, so W&B reads the variable;
W&B's files under $WANDB_DIR, else the run's own folder (`harts train --out`: RUN/wandb/), else
reports/wandb, for `wandb sync` later. A run folder keeps its W&B run id (RUN/wandb-run-id, unless
WANDB_RUN_ID is set): a resumed `harts train` continues the same W&B run (resume="allow"; offline, its
pieces are synced into one run). The run's config is the
resolved config, the start record's allow-listed environment and `resumed_from`; `log(record)`
logs every finite number of a step record (nested keys flattened, `seconds/forward`) at W&B step =
the training step, so a resumed run's curve continues where the checkpoint left off;
`finish(failed)` closes the run and shuts the W&B service down so offline files are complete. As
for the benchmarks, W&B never fails a run: whatever it raises becomes one warning line and logging
stops; W&B's system metrics are on, its git, code and host-metadata capture off. Subclasses
(harts.rl.tracking) name their runs through `identity` and `run_config`. Tested with a stand-in
`wandb` module in tests/training/test_tracking.py.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path
from typing import Any

from harts.extras import require
from harts.files import write_text
from harts.tracking.wandb_log import (DEFAULT_DIR, INIT_TIMEOUT_S, WandbOptions, flatten_metrics, init_arguments,
                                   wandb_mode)

logger = logging.getLogger(__name__)

RUN_ID_NAME = "wandb-run-id"
"""The file of a run folder that holds its W&B run id."""


class WandbTracker:
    def __init__(self, options: WandbOptions | None = None) -> None:
        self.options = options or WandbOptions()
        self.run = None
        self._wandb = None
        self._offline_dir: Path | None = None

    @classmethod
    def start(cls, start_record: dict[str, Any], run_dir: str | Path | None = None,
              options: WandbOptions | None = None, *, directory: str | Path | None = None) -> WandbTracker:
        """Open the W&B run of `run_dir` (resumed with its id) or, without one, a new run whose files go to
        `directory` (default: reports/wandb); $WANDB_DIR overrides either."""
        tracker = cls(options)
        mode = wandb_mode(flag=tracker.options.mode)
        if mode != "disabled":
            tracker._guard(tracker._init, start_record, run_dir, directory, mode)
        return tracker

    def identity(self, start_record: dict[str, Any], run_dir: Path | None) -> dict[str, Any]:
        """wandb.init's group, job_type, name and tags of this run (before flags and variables)."""
        train = start_record["config"]["train"]
        tags = [train["model"], train["execution"]["execution"], train["execution"]["planner"], train["device"],
                train["dtype"], train["loss"]["name"]]
        return {"group": f"train/{train['model']}", "job_type": "train", "name": run_dir.name,
                "tags": sorted({str(t)[:64] for t in tags})}

    def run_config(self, start_record: dict[str, Any]) -> dict[str, Any]:
        environment = {k: v for k, v in start_record["environment"].items() if k != "utc"}
        return {**start_record["config"], "environment": environment, "resumed_from": start_record["resumed_from"]}

    def _init(self, start_record: dict[str, Any], run_dir: str | Path | None, directory: str | Path | None,
              mode: str) -> None:
        wandb = require("wandb", "W&B logging")
        directory = Path(os.environ.get("WANDB_DIR") or run_dir or directory or DEFAULT_DIR)
        directory.mkdir(parents=True, exist_ok=True)
        resume = {}
        if run_dir is not None and not os.environ.get("WANDB_RUN_ID"):
            resume = {"id": run_id(Path(run_dir)), "resume": "allow"}
        settings = wandb.Settings(
            silent=True, console="off", init_timeout=INIT_TIMEOUT_S, x_disable_meta=True,
            x_disable_machine_info=True, disable_git=True, disable_code=True, save_code=False,
        )
        identity = self.identity(start_record, None if run_dir is None else Path(run_dir))
        self._wandb = wandb
        self.run = wandb.init(dir=str(directory), mode=mode, config=self.run_config(start_record), settings=settings,
                              **resume, **init_arguments(identity, self.options))
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
            logger.info(f"wandb: offline run in {self._offline_dir}; upload with `wandb sync {self._offline_dir}`")
            self._offline_dir = None

    def _guard(self, function, *args, **kwargs) -> None:
        try:
            function(*args, **kwargs)
        except (Exception, SystemExit) as error:  # W&B must never fail training.
            message = str(error).strip().splitlines()[0] if str(error).strip() else ""
            logger.warning(f"W&B logging stopped ({type(error).__name__}: {message})")
            self.run = None


def run_id(run_dir: Path) -> str:
    """The W&B run id of `run_dir`: the one its first start wrote (RUN_ID_NAME), else a new one, written atomically."""
    path = run_dir / RUN_ID_NAME
    if path.exists():
        found = path.read_text(encoding="utf-8").strip()
        if not found or not all(c.isascii() and (c.isalnum() or c in "-_") for c in found) or len(found) > 64:
            raise ValueError(f"{path}: not a W&B run id (letters, digits, '-' or '_', at most 64)")
        return found
    new = uuid.uuid4().hex[:16]
    write_text(path, new + "\n")
    return new
