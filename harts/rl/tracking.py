"""W&B logging of `harts rl`: one W&B run per seed, every step logged live with both executions.

`RLTracker.start(start_record)` opens the run the way `harts train`'s tracker does
(harts.training.tracking.WandbTracker: offline unless WANDB_MODE, WANDB_API_KEY or a sweep agent
say otherwise; W&B never fails a run; its own git, code and system capture are off) with the
resolved RL config and the allow-listed environment; group = rl/NAME, job_type = rl, name =
NAME/seedS, tags = model, executions, device, dtype. `log({"step": t, "compact": record,
"baseline": record})` logs every finite number at W&B step t under `compact/...` and
`baseline/...` (`compact/reward`, `baseline/seconds/train`), so one chart holds both curves.
Tested with a stand-in `wandb` module in tests/rl/test_tracking.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from harts.bench.wandb_log import DEFAULT_DIR, DEFAULT_PROJECT, INIT_TIMEOUT_S, wandb_mode
from harts.training.tracking import WandbTracker


class RLTracker(WandbTracker):
    @classmethod
    def start(cls, start_record: dict[str, Any]) -> RLTracker:
        tracker = cls()
        mode = wandb_mode()
        if mode != "disabled":
            tracker._guard(tracker._init, start_record, mode)
        return tracker

    def _init(self, start_record: dict[str, Any], mode: str) -> None:
        import wandb

        directory = Path(os.environ.get("WANDB_DIR") or DEFAULT_DIR)
        directory.mkdir(parents=True, exist_ok=True)
        config = start_record["config"]
        rl = config["rl"]
        environment = {k: v for k, v in start_record["environment"].items() if k != "utc"}
        settings = wandb.Settings(
            silent=True, console="off", init_timeout=INIT_TIMEOUT_S, x_disable_stats=True, x_disable_meta=True,
            x_disable_machine_info=True, disable_git=True, disable_code=True, save_code=False,
        )
        tags = [rl["model"], *rl["executions"], rl["device"], rl["dtype"], "rl"]
        self._wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT, dir=str(directory), mode=mode,
            config={**config, "environment": environment}, settings=settings, group=f"rl/{config['name']}",
            job_type="rl", name=f"{config['name']}/seed{config['seed']}", tags=sorted({str(t)[:64] for t in tags}),
        )
        if mode == "offline":
            self._offline_dir = Path(self.run.dir).parent
