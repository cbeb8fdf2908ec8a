"""workflows/wandb-sweep.yaml: a W&B sweep whose program is the harts CLI; every grid point parses."""

from __future__ import annotations

import itertools
from pathlib import Path

import yaml

from harts.cli.main import build_parser

SWEEP = Path(__file__).resolve().parents[2] / "workflows" / "wandb-sweep.yaml"


def test_every_grid_point_is_a_valid_harts_command():
    sweep = yaml.safe_load(SWEEP.read_text(encoding="utf-8"))
    assert sweep["program"] == "harts" and sweep["method"] == "grid"
    assert sweep["command"][-1] == "${args}" and sweep["command"][0] == "harts"
    names = list(sweep["parameters"])
    choices = [spec["values"] if "values" in spec else [spec["value"]] for spec in sweep["parameters"].values()]
    grid = list(itertools.product(*choices))
    assert len(grid) == 4
    parser = build_parser()
    for point in grid:
        # W&B's ${args} macro expands to --name=value for every parameter.
        argv = sweep["command"][1:-1] + [f"--{name}={value}" for name, value in zip(names, point)]
        args = parser.parse_args(argv)
        assert (args.model, args.parallel, args.planner) == point[:3]
        assert args.run.__module__ == "harts.bench.speedup"
    assert sweep["metric"]["name"] == "fbg_speedup"
