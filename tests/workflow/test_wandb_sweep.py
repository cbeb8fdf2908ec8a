"""workflows/wandb-sweep.yaml: a W&B grid over models x parallel configurations x planners on GPUs whose every
point is a valid `harts bench speedup` command, run through the sweep's `bash -c` line as W&B's agent runs it
(its macro expansion, from wandb's own code), each run writing its own records file."""

from __future__ import annotations

import itertools
import os
import stat
import subprocess
from pathlib import Path

import yaml
from wandb.sdk.launch.sweeps.utils import create_sweep_command_args

from harts.cli.main import build_parser

REPO = Path(__file__).resolve().parents[2]
SWEEP = REPO / "workflows" / "wandb-sweep.yaml"


def agent_argv(sweep: dict, point: dict) -> list[str]:
    """The command W&B's agent starts for one grid point (wandb_agent.Agent._command_run's expansion)."""
    macros = create_sweep_command_args({"args": {name: {"value": value} for name, value in point.items()}})
    argv = []
    for item in sweep["command"]:
        argv += macros[item[2:-1]] if item.startswith("${") else [item]
    return argv


def test_every_grid_point_is_a_gpu_harts_command_with_its_own_output(tmp_path):
    sweep = yaml.safe_load(SWEEP.read_text(encoding="utf-8"))
    assert sweep["method"] == "grid" and sweep["metric"]["name"] == "fbg_speedup"
    names = list(sweep["parameters"])
    choices = [spec["values"] if "values" in spec else [spec["value"]] for spec in sweep["parameters"].values()]
    grid = [dict(zip(names, values)) for values in itertools.product(*choices)]
    assert len(grid) == 2 * 4 * 3
    for point in grid:
        assert (REPO / "configs" / "models" / f"{point['model']}.yaml").is_file()
        assert (REPO / "configs" / "parallel" / f"{point['parallel']}.yaml").is_file()

    # A stand-in `harts` prints the arguments the agent's command hands it.
    (tmp_path / "harts").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n', encoding="utf-8")
    (tmp_path / "harts").chmod(stat.S_IRWXU)
    parser = build_parser()
    outputs = set()
    for index, point in enumerate(grid):
        environ = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "WANDB_SWEEP_ID": "sw1",
                   "WANDB_RUN_ID": f"run{index}"}
        argv = subprocess.run(agent_argv(sweep, point), env=environ, capture_output=True, text=True,
                              check=True).stdout.splitlines()
        args = parser.parse_args(argv)
        assert args.run.__module__ == "harts.bench.speedup.run"
        assert (args.model, args.parallel, args.planner) == (point["model"], point["parallel"], point["planner"])
        assert (args.device, args.dtype, args.recompute, args.no_breakdown) == ("cuda", "bf16", True, True)
        assert args.out == f"reports/raw/sweep/sw1/run{index}.json"
        outputs.add(args.out)
    assert len(outputs) == len(grid), "every run writes its own records file"
