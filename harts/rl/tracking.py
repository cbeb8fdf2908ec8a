"""W&B logging of `harts rl`: one W&B run per seed, every step logged live with both executions.

`RLTracker.start(start_record, options, directory)` opens the run as `harts train`'s tracker does
(harts.tracking.wandb_run.WandbTracker: the `--wandb-*` flags beside W&B's environment variables,
which win; offline by default; system metrics on; W&B never fails a run), its files in `directory`
(the records' folder), with the resolved RL config and the allow-listed environment; group = rl/NAME, job_type = rl, name = NAME/seedS, tags =
model, executions, device, dtype. `log({"step": t, "compact": record, "baseline": record})` logs
every finite number at W&B step t under `compact/...` and `baseline/...` (`compact/reward`,
`baseline/seconds/train`), so one chart holds both curves. Tested with a stand-in `wandb` module
in tests/rl/test_tracking.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harts.tracking.wandb_log import WandbOptions
from harts.tracking.wandb_run import WandbTracker


class RLTracker(WandbTracker):
    @classmethod
    def start(cls, start_record: dict[str, Any], options: WandbOptions | None = None,
              directory: str | Path | None = None) -> RLTracker:
        """A new W&B run (an RL seed is not resumed) with its files under `directory` (`harts rl --out`'s folder)."""
        return super().start(start_record, None, options, directory=directory)

    def identity(self, start_record: dict[str, Any], run_dir: Path | None) -> dict[str, Any]:
        config = start_record["config"]
        rl = config["rl"]
        tags = [rl["model"], *rl["executions"], rl["device"], rl["dtype"], "rl"]
        return {"group": f"rl/{config['name']}", "job_type": "rl", "name": f"{config['name']}/seed{config['seed']}",
                "tags": sorted({str(t)[:64] for t in tags})}

    def run_config(self, start_record: dict[str, Any]) -> dict[str, Any]:
        environment = {k: v for k, v in start_record["environment"].items() if k != "utc"}
        return {**start_record["config"], "environment": environment}
