"""Weights & Biases logging of benchmark records: one W&B run per record, logged while the benchmark runs.

`BenchLogger(options)` belongs to one `harts bench ...` invocation. `start(benchmark, config)` opens
the run of the next record before it is measured, `log(metrics)` adds a history row while it is
measured (live progress: each warm-up and timed repeat of `bench speedup`, each plan of `bench
planning`), `finish(record)` puts every finite numeric result (flattened to `a/b/c` keys) into the
run's summary and the record itself into an artifact of type `benchmark-record`, and closes the
run (exit code 1 for an error record, its message in the summary); `close()` shuts the W&B service
down so that offline runs are complete on disk. `log_records(records, options)` is start + finish
for records measured without live hooks. `log_report(name, paths)` logs a report's files (PDF,
CSV) as an artifact of type `report` in a run of job type `report`.

Runs: group = benchmark/model/parallel (or benchmark/dataset), job_type = benchmark, name =
group/planner/stepN, tags = benchmark, model, parallel, planner, device, dtype, dataset; config =
the record's config plus its allow-listed environment (versions, git sha, hardware).

Settings: `--wandb-project`, `--wandb-group` and `--wandb-mode` (`add_arguments`, on every `harts
bench` command that logs) beside W&B's environment variables, which win where set: WANDB_MODE,
WANDB_PROJECT, WANDB_RUN_GROUP, WANDB_TAGS, WANDB_NAME, WANDB_JOB_TYPE (an argument whose variable
is set is not passed, so W&B reads the variable). Mode without either: online when WANDB_API_KEY
is set or under a sweep agent (WANDB_SWEEP_ID), else offline. Offline runs go to $WANDB_DIR or
reports/wandb/ (git-ignored); upload them later with `wandb sync`. Artifact files are copied into
the run's own directory (`artifacts/`), so an offline run directory is complete in itself.

W&B's system metrics (CPU, memory, GPU utilisation and memory, sampled by the W&B service every
15 s, WANDB_X_STATS_SAMPLING_INTERVAL to change) are on; its git, code and host-metadata capture
are off (the record holds an allow-listed environment without keys or tokens). Logging never
fails a benchmark: the first error W&B raises is one warning line on stderr, and logging stops
for the rest of the invocation.

Tested in tests/tracking/test_wandb_log.py with a stand-in `wandb` module and with real offline
runs read back from their `.wandb` files (history rows, summary, artifacts).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harts.extras import require
from harts.files import atomic_path, write_text

logger = logging.getLogger(__name__)

DEFAULT_DIR = Path("reports") / "wandb"
DEFAULT_PROJECT = "harts"
INIT_TIMEOUT_S = 30.0
MODES = ("online", "offline", "disabled")
# wandb.init argument -> the environment variable that W&B reads for it (and that wins over our value).
ENVIRONMENT = {"project": "WANDB_PROJECT", "group": "WANDB_RUN_GROUP", "tags": "WANDB_TAGS", "name": "WANDB_NAME",
               "job_type": "WANDB_JOB_TYPE"}


@dataclass(frozen=True)
class WandbOptions:
    """The `--wandb-*` flags (None: not given)."""

    project: str | None = None
    group: str | None = None
    mode: str | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Weights & Biases (environment variables win where set)")
    group.add_argument("--wandb-project", metavar="NAME", help=f"W&B project (WANDB_PROJECT; default {DEFAULT_PROJECT})")
    group.add_argument("--wandb-group", metavar="NAME",
                       help="W&B run group of every run (WANDB_RUN_GROUP; default benchmark/model/parallel)")
    group.add_argument("--wandb-mode", choices=MODES,
                       help="W&B mode (WANDB_MODE; default offline, online with WANDB_API_KEY or under a sweep agent)")


def options(args: argparse.Namespace) -> WandbOptions:
    return WandbOptions(project=args.wandb_project, group=args.wandb_group, mode=args.wandb_mode)


def requested(args: argparse.Namespace) -> bool:
    """Whether a command that logs only on request (`harts train`, `harts rl`) was asked to: `--wandb` or
    any `--wandb-*` flag."""
    return bool(args.wandb or args.wandb_project or args.wandb_group or args.wandb_mode)


def wandb_mode(environ: dict[str, str] | None = None, flag: str | None = None) -> str:
    env = os.environ if environ is None else environ
    if env.get("WANDB_MODE"):
        return env["WANDB_MODE"]
    if flag:
        return flag
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


def step_of(config: dict[str, Any]) -> int | None:
    """The record's step: its `step`, else the one a step file names (data/trees/NAME/step_003.npz -> 3)."""
    if isinstance(config.get("step"), int):
        return config["step"]
    match = re.fullmatch(r"step_(\d+)", Path(str(config.get("data") or config.get("trees") or "")).name.split(".")[0])
    return int(match.group(1)) if match else None


def run_identity(benchmark: str, config: dict[str, Any]) -> dict[str, Any]:
    """W&B `group`, `job_type`, `name` and `tags` of the run of one record."""
    dataset = dataset_of(config)
    model, parallel, planner, step = config.get("model"), config.get("parallel"), config.get("planner"), step_of(config)
    parts = [benchmark] + ([model, parallel or "single"] if model else [dataset or "default"])
    group = "/".join(str(p) for p in parts)
    tags = [benchmark, model, parallel, planner, config.get("device"), config.get("dtype"), dataset]
    if config.get("recompute"):
        tags.append("recompute")
    tags = sorted({str(t)[:64] for t in tags if t})
    name = group + (f"/{planner}" if planner else "") + (f"/step{step}" if step is not None else "")
    if config.get("variant"):  # `bench speedup --variant`: one run per step and variant
        name += f"/{config['variant']}"
    return {"group": group, "job_type": benchmark, "name": name, "tags": tags}


def init_arguments(identity: dict[str, Any], options: WandbOptions, environ: dict[str, str] | None = None) -> dict:
    """wandb.init's project, group, job_type, name and tags: the flags over our defaults, and none whose
    environment variable is set (W&B reads it)."""
    env = os.environ if environ is None else environ
    values = {**identity, "project": options.project or DEFAULT_PROJECT}
    if options.group:
        values["group"] = options.group
    return {key: value for key, value in values.items() if not env.get(ENVIRONMENT[key])}


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


def artifact_name(text: str) -> str:
    """A W&B artifact name (letters, digits, '-', '_', '.') for a run name such as speedup/tiny/dp2/harts/step0."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.")


class BenchLogger:
    """The W&B runs of one benchmark invocation (see the module docstring). Every method is a no-op once
    logging is off (mode disabled, or after a W&B error)."""

    def __init__(self, options: WandbOptions | None = None, directory: str | Path | None = None) -> None:
        self.options = options or WandbOptions()
        self.mode = wandb_mode(flag=self.options.mode)
        self.directory = Path(directory or os.environ.get("WANDB_DIR") or DEFAULT_DIR)
        self.enabled = self.mode != "disabled"
        self.run = None
        self.run_dirs: list[str] = []
        self._wandb = None
        self._step = 0

    def start(self, benchmark: str, config: dict[str, Any], environment: dict[str, Any] | None = None) -> None:
        """Open the run of the record about to be measured (one still open is closed as failed)."""
        self._guard(self._start, run_identity(benchmark, config), config, environment)

    def log(self, metrics: dict[str, Any]) -> None:
        """One history row of the open run: the finite numbers of `metrics` (nested keys flattened)."""
        if self.run is not None:
            self._guard(self._log, flatten_metrics(metrics))

    def finish(self, record: dict[str, Any]) -> None:
        """Close the open run with the measured record: summary, the record as an artifact, exit code."""
        if self.run is not None:
            self._guard(self._finish, record)

    def log_records(self, records: list[dict[str, Any]]) -> None:
        """A run per record measured without live hooks."""
        for record in records:
            self.start(record["benchmark"], record["config"], record["environment"])
            self.finish(record)

    def log_report(self, name: str, paths: list[Path], records: list[str]) -> None:
        """A run of job type `report` whose artifact `report-NAME` holds `paths`."""
        identity = {"group": "report", "job_type": "report", "name": f"report/{name}", "tags": ["report", name]}
        self._guard(self._start, identity, {"report": name, "files": [str(p) for p in paths], "records": records},
                    None)
        self._guard(self._close_run, f"report-{name}", "report", paths, 0)

    def close(self) -> list[str]:
        """Shut W&B down (offline runs complete on disk); the local run directories of this invocation."""
        if self._wandb is not None:
            if self.run is not None:  # a record that never finished: its benchmark stopped
                run, self.run = self.run, None
                self._guard(lambda: run.finish(exit_code=1))
            wandb, self._wandb = self._wandb, None
            try:
                # finish() returns before the service has written the run's transaction log.
                wandb.teardown()
            except (Exception, SystemExit) as error:  # W&B must never fail a benchmark.
                self._warn(error)
        if self.mode == "offline" and self.run_dirs:
            logger.info(f"wandb: {len(self.run_dirs)} offline run(s) in {self.directory / 'wandb'}; upload with "
                        f"`wandb sync {self.directory / 'wandb'}/offline-run-*`")
        return self.run_dirs

    def _start(self, identity: dict[str, Any], config: dict[str, Any], environment: dict[str, Any] | None) -> None:
        if self._wandb is None:
            self._wandb = require("wandb", "W&B logging")
            self.directory.mkdir(parents=True, exist_ok=True)
        if self.run is not None:
            run, self.run = self.run, None
            run.finish(exit_code=1)
        if environment is None:
            from harts.tracking.records import environment as capture

            environment = capture()
        settings = self._wandb.Settings(
            silent=True, console="off", init_timeout=INIT_TIMEOUT_S, x_disable_meta=True, disable_git=True,
            disable_code=True, save_code=False,
        )
        self.run = self._wandb.init(
            dir=str(self.directory), mode=self.mode, settings=settings, reinit="finish_previous",
            config={**config, "environment": {k: v for k, v in environment.items() if k != "utc"}},
            **init_arguments(identity, self.options),
        )
        self._step = 0

    def _log(self, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=self._step)
        self._step += 1

    def _finish(self, record: dict[str, Any]) -> None:
        import json

        failed = "error" in record
        summary = flatten_metrics(record.get("results") or {})
        step = record["config"].get("step")
        if isinstance(step, int):
            summary["data_step"] = step
        if failed:
            summary.update(failed=1, error=str(record["error"])[:1000])
        self.run.summary.update(summary)
        path = self._artifact_folder() / "record.json"
        write_text(path, json.dumps(record, indent=2) + "\n")
        name = run_identity(record["benchmark"], record["config"])["name"]
        self._close_run(name, "benchmark-record", [path], 1 if failed else 0)

    def _close_run(self, name: str, kind: str, paths: list[Path], exit_code: int) -> None:
        """Log `paths` as one artifact of the open run (copied into its directory first), then finish it."""
        names = [path.name for path in paths]
        twice = next((n for n in names if names.count(n) > 1), None)
        if twice is not None:
            raise ValueError(f"artifact {artifact_name(name)}: two files named {twice} "
                             f"({', '.join(str(p) for p in paths if p.name == twice)}); one would replace the other")
        folder = self._artifact_folder()
        artifact = self._wandb.Artifact(artifact_name(name), type=kind)
        for path in paths:
            copy = folder / path.name
            if copy != path:
                with atomic_path(copy) as temporary:
                    shutil.copyfile(path, temporary)
            # The copy stays in the run's directory, unchanged until synced: no second copy in W&B's staging area.
            artifact.add_file(str(copy), name=path.name, policy="immutable")
        run, self.run = self.run, None
        run.log_artifact(artifact)
        self.run_dirs.append(str(Path(run.dir).parent))
        run.finish(exit_code=exit_code)

    def _artifact_folder(self) -> Path:
        folder = Path(self.run.dir).parent / "artifacts"
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def _guard(self, function, *args) -> None:
        if not self.enabled:
            return
        try:
            function(*args)
        except (Exception, SystemExit) as error:  # W&B must never fail a benchmark.
            self._warn(error)

    def _warn(self, error: BaseException) -> None:
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        logger.warning(f"W&B logging skipped ({type(error).__name__}: {message})")
        self.enabled = False
        self.run = None


def log_records(records: list[dict[str, Any]], options: WandbOptions | None = None,
                directory: str | Path | None = None) -> list[str]:
    """Log `records` (a run each) and shut W&B down; return the local run directories. Never raises
    except on KeyboardInterrupt."""
    if not records:
        return []
    logger = BenchLogger(options, directory)
    logger.log_records(records)
    return logger.close()


def log_report(name: str, paths: list[str | Path], records: list[str | Path] = (),
               options: WandbOptions | None = None, directory: str | Path | None = None) -> list[str]:
    """Log a report's files (its PDF and CSV) as the artifact `report-NAME` (type `report`) of a run of job
    type `report` whose config names the records it was built from. Never raises except on KeyboardInterrupt."""
    logger = BenchLogger(options, directory)
    logger.log_report(name, [Path(p) for p in paths], [str(p) for p in records])
    return logger.close()
