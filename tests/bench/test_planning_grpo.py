"""`harts bench planning-grpo` end to end (small steps), its reference worker and its table."""

from __future__ import annotations

import csv
import json
import subprocess

import numpy as np
import pytest

from harts.bench.planning_grpo import grpo_table, same_plans_note
from harts.cli.main import main
from harts.planning.microbatch import nearest_rank

SMALL = ["--shapes", "agent,math", "--seeds", "5", "--steps", "1", "--groups", "6", "--repeats", "2"]


def _head() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def test_bench_planning_grpo(tmp_path, capsys):
    out = tmp_path / "grpo.json"
    assert main(["bench", "planning-grpo", *SMALL, "--planners", "harts,harts-no-tail,treetrain-ortools",
                 "--time-limit", "1", "--out", str(out)]) == 0
    records = json.loads(out.read_text())
    assert [(r["config"]["shape"], r["config"]["planner"]) for r in records] == [
        (shape, planner) for shape in ("agent", "math") for planner in ("harts", "harts-no-tail", "treetrain-ortools")]
    for record in records:
        results, config = record["results"], record["config"]
        assert config["grpo"]["num_groups"] == 6 and (config["capacity"], config["dp"], config["seed"]) == (8192, 4, 5)
        assert len(results["plan_seconds_each"]) == (1 if config["planner"] == "treetrain-ortools" else 2)
        assert results["identical_plans"]
        assert results["p95_slot_imbalance"] == nearest_rank(np.asarray(results["slot_imbalance"]), 95)
        assert results["lower_bound_compact_tokens"] <= results["compact_tokens"]
        assert record["environment"]["git"]["sha"]
    assert [r["config"]["options"] for r in records[:3]] == [{}, {"tail": False}, {"time_limit_s": 1.0}]
    tail, plain = records[0]["results"], records[1]["results"]
    assert tail["compact_tokens"] == plain["compact_tokens"]
    assert sorted(tail["slot_imbalance"], reverse=True) <= sorted(plain["slot_imbalance"], reverse=True)
    table = (tmp_path / "grpo.md").read_text()
    assert "| all | harts-no-tail | 2 | " in table and "Steps whose plan equals harts's" in table
    with open(tmp_path / "grpo.csv", newline="") as handle:
        rows = list(csv.reader(handle))
    assert len(rows) == 1 + 3 * 3
    assert "| all | treetrain-ortools |" in capsys.readouterr().out


@pytest.mark.skipif(_head() is None, reason="not a git checkout")
def test_reference_planner_runs_the_committed_planner(tmp_path):
    out = tmp_path / "grpo.json"
    assert main(["bench", "planning-grpo", *SMALL, "--planners", "harts-no-tail", "--reference", "HEAD",
                 "--out", str(out)]) == 0
    records = json.loads(out.read_text())
    assert [r["config"]["planner"] for r in records] == ["harts@HEAD", "harts-no-tail"] * 2
    for record in records:
        assert record["results"]["identical_plans"] and len(record["results"]["plan_cpu_seconds_each"]) == 2


@pytest.mark.parametrize("argv, message", [
    (["--shapes", "nope"], "unknown name 'nope'"),
    (["--planners", "harts,harts"], "listed twice"),
    (["--reference", "no-such-commit-xyz"], "--reference no-such-commit-xyz: cannot export harts/"),
    (["--planners", "harts", "--time-limit", "1"], "--time-limit applies to the treetrain-ortools planner only"),
], ids=["shape", "twice", "reference", "ortools-option"])
def test_bad_arguments_are_one_line(argv, message, tmp_path, capsys):
    try:
        status = main(["bench", "planning-grpo", *SMALL, *argv, "--out", str(tmp_path / "grpo.json")])
    except SystemExit as stop:  # argparse's own errors
        status = stop.code
    error = capsys.readouterr().err
    assert status == 2 and message in error and "Traceback" not in error


def _record(shape: str, seed: int, planner: str, slots: list[float], tokens: int, seconds: float) -> dict:
    return {"config": {"shape": shape, "seed": seed, "step": 0, "planner": planner},
            "results": {"slot_imbalance": slots, "step_imbalance": max(slots) / 10, "compact_tokens": tokens,
                        "plan_seconds": seconds, "plan_cpu_seconds": seconds / 2, "plan_digest": str(tokens)}}


def test_grpo_table_pools_slots_and_compares_like_with_like():
    records = [
        _record("a", 0, "old", [0.01, 0.03], 100, 1.0), _record("a", 0, "new", [0.01, 0.01], 100, 0.5),
        _record("b", 0, "old", [0.0, 0.02, 0.04], 200, 3.0), _record("b", 0, "new", [0.0, 0.01, 0.02], 190, 1.0),
        # A step only one planner finished is left out of every row that compares them.
        _record("b", 1, "old", [0.5], 999, 9.0),
    ]
    header, rows = grpo_table(records, ["old", "new"])
    table = {(row[0], row[1]): dict(zip(header, row)) for row in rows}
    assert [key for key in table] == [("a", "old"), ("a", "new"), ("b", "old"), ("b", "new"), ("all", "old"),
                                      ("all", "new")]
    everything = table["all", "new"]
    assert (everything["steps"], everything["slots"]) == ("2", "5")
    # Nearest rank over the 5 pooled slots: the 5th smallest.
    assert everything["P95 slot imb."] == "2.00%" and table["all", "old"]["P95 slot imb."] == "4.00%"
    assert everything["mean slot imb."] == f"{100 * np.mean([0.01, 0.01, 0.0, 0.01, 0.02]):.2f}%"
    assert everything["compact tokens"] == "290" and everything["tokens vs first"] == f"{290 / 300:.4f}"
    assert everything["mean s vs first"] == f"{0.75 / 2.0:.3f}" and everything["P95 s"] == "1.000"
    assert same_plans_note(records, ["old", "new"]) == "Steps whose plan equals old's: new 1 of 2."
