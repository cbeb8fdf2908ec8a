"""Weights & Biases logging of benchmark records: every `harts bench ...` run logs its config and metrics.

`log_records(records)` is called at the end of each benchmark's `run()`. It groups the records
into W&B runs, one per configuration (benchmark, model, parallel configuration, planner,
dataset), and logs each run's resolved config (the record's `config` plus its allow-listed
`environment`: versions, git sha, hardware) and, per record, every numeric scalar of `results`
flattened to `a/b/c` keys (plus `data_step`, the record's step); an error record logs its message
to the summary. Runs are grouped for the W&B UI: `group` = benchmark/model/parallel (or
benchmark/dataset), `job_type` = benchmark, tags = benchmark, model, parallel, planner, device,
dtype, dataset.

Mode: offline unless the user chose otherwise: `WANDB_MODE` is respected as set
(`online`, `offline`, `disabled`); without it the mode is `online` when `WANDB_API_KEY` is set or
the process runs under a W&B sweep agent (`WANDB_SWEEP_ID`), else `offline`. Offline runs go to
`$WANDB_DIR` or `reports/wandb/` (git-ignored); upload them later with `wandb sync`. Logging
never fails a benchmark: anything W&B raises is reported in one warning line on stderr. Nothing
outside the record is sent (W&B's own system, git and code capture is switched off; the
record's environment is an allow-list without keys or tokens).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

DEFAULT_DIR = Path("reports") / "wandb"
DEFAULT_PROJECT = "harts"
INIT_TIMEOUT_S = 30.0


def wandb_mode(environ: dict[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    if env.get("WANDB_MODE"):
        return env["WANDB_MODE"]
    if env.get("WANDB_API_KEY") or env.get("WANDB_SWEEP_ID"):
        return "online"
    return "offline"


def dataset_of(config: dict[str, Any]) -> str | None:
    source = config.get("data") or config.get("trees")
    if not source:
        return None
    path = Path(str(source))
    # data/trees/NAME/step_000.npz -> NAME; configs/trees/NAME.yaml -> NAME; data/trees/NAME -> NAME
    if path.suffix in (".yaml", ".yml"):
        return path.stem
    return path.parent.name if path.suffix else path.name


def run_identity(record: dict[str, Any]) -> dict[str, Any]:
    """W&B `group`, `job_type`, `name` and `tags` of the run a record belongs to."""
    config = record["config"]
    benchmark = record["benchmark"]
    dataset = dataset_of(config)
    model, parallel, planner = config.get("model"), config.get("parallel"), config.get("planner")
    parts = [benchmark] + ([model, parallel or "single"] if model else [dataset or "default"])
    group = "/".join(str(p) for p in parts)
    tags = [benchmark, model, parallel, planner, config.get("device"), config.get("dtype"), dataset]
    if config.get("recompute"):
        tags.append("recompute")
    tags = sorted({str(t)[:64] for t in tags if t})
    name = group + (f"/{planner}" if planner else "")
    return {"group": group, "job_type": benchmark, "name": name, "tags": tags}


def flatten_metrics(results: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Every finite numeric scalar of `results` as {"a/b/c": value}; lists and strings are left out."""
    metrics: dict[str, float] = {}
    for key, value in results.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            metrics.update(flatten_metrics(value, name + "/"))
        elif isinstance(value, bool):
            metrics[name] = int(value)
        elif isinstance(value, (int, float)) and math.isfinite(value):
            metrics[name] = value
    return metrics


def group_runs(records: list[dict[str, Any]]) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """[(identity, records)] in first-seen order: the records of one configuration form one run."""
    runs: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = {}
    for record in records:
        identity = run_identity(record)
        runs.setdefault(identity["name"], (identity, []))[1].append(record)
    return list(runs.values())


def log_records(records: list[dict[str, Any]], project: str | None = None,
                directory: str | Path | None = None) -> list[str]:
    """Log `records` to W&B (see the module docstring); return the local run directories. Never raises
    except on KeyboardInterrupt."""
    mode = wandb_mode()
    if mode == "disabled" or not records:
        return []
    try:
        return _log(records, mode, project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
                    Path(directory or os.environ.get("WANDB_DIR") or DEFAULT_DIR))
    except (Exception, SystemExit) as error:  # W&B must never fail a benchmark.
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        print(f"harts: warning: W&B logging skipped ({type(error).__name__}: {message})", file=sys.stderr)
        return []


def _log(records: list[dict[str, Any]], mode: str, project: str, directory: Path) -> list[str]:
    import wandb

    directory.mkdir(parents=True, exist_ok=True)
    settings = wandb.Settings(
        silent=True, console="off", init_timeout=INIT_TIMEOUT_S, x_disable_stats=True, x_disable_meta=True,
        x_disable_machine_info=True, disable_git=True, disable_code=True, save_code=False,
    )
    run_dirs = []
    try:
        _log_runs(wandb, records, mode, project, directory, settings, run_dirs)
    finally:
        # finish() returns before the service has written the run's transaction log: shut the
        # service down so that every offline run is complete on disk when this returns.
        wandb.teardown()
    if mode == "offline" and run_dirs:
        print(f"wandb: {len(run_dirs)} offline run(s) in {directory / 'wandb'}; upload with "
              f"`wandb sync {directory / 'wandb'}/offline-run-*`", file=sys.stderr)
    return run_dirs


def _log_runs(wandb, records, mode: str, project: str, directory: Path, settings, run_dirs: list[str]) -> None:
    for identity, members in group_runs(records):
        first = members[0]
        config = {**first["config"], "environment": {k: v for k, v in first["environment"].items() if k != "utc"}}
        run = wandb.init(project=project, dir=str(directory), mode=mode, config=config, settings=settings,
                         reinit="finish_previous", **identity)
        try:
            for index, record in enumerate(members):
                metrics = flatten_metrics(record.get("results") or {})
                step = record["config"].get("step")
                if isinstance(step, int):
                    metrics["data_step"] = step
                if "error" in record:
                    metrics["failed"] = 1
                    run.summary["error"] = str(record["error"])[:1000]
                run.log(metrics, step=index)
            run_dirs.append(str(Path(run.dir).parent))
        finally:
            run.finish(exit_code=1 if any("error" in r for r in members) else 0)
