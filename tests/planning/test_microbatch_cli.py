"""`harts plan microbatches` and `harts bench planning` end to end (no torch import)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from harts.cli.main import main
from harts.planning.microbatch import validate
from harts.planning.plans import Plan
from harts.trees.io import read_step, write_step

from .microbatch_helpers import rollout_step

KEYS = {"planner", "microbatches", "compact_tokens", "lower_bound_compact_tokens", "plan_seconds",
        "p95_slot_imbalance", "step_imbalance"}


@pytest.fixture
def step_file(tmp_path):
    step = rollout_step(np.random.default_rng(42), num_tasks=3, branches=(2, 7), shared=20, prompt=(2, 6),
                        continuation=(5, 40))
    path = tmp_path / "step.npz"
    write_step(step, path)
    return path


@pytest.mark.parametrize("planner", ["harts", "greedy-trie", "per-trajectory", "treetrain-ortools"])
def test_plan_microbatches_json_and_out(step_file, tmp_path, capsys, planner):
    out = tmp_path / "plan.json"
    argv = ["plan", "microbatches", str(step_file), "--capacity", "200", "--dp", "2", "--planner", planner,
            "--out", str(out), "--json"]
    if planner == "treetrain-ortools":
        argv += ["--time-limit", "2"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert set(summary) == KEYS and summary["planner"] == planner
    written = Plan.read(out)
    validate(written, read_step(step_file))
    assert summary["compact_tokens"] == written.compact_tokens
    assert summary["microbatches"] == written.num_microbatches
    assert 0 <= summary["p95_slot_imbalance"] and 0 <= summary["step_imbalance"] < 1


@pytest.mark.parametrize("reading", [("ffd", "solver"), ("lpt", "sorted")], ids="-".join)
def test_plan_microbatches_treetrain_reading(step_file, tmp_path, reading):
    out = tmp_path / "plan.json"
    assert main(["plan", "microbatches", str(step_file), "--capacity", "200", "--dp", "2", "--planner",
                 "treetrain-ortools", "--time-limit", "3", "--replica-assignment", reading[0], "--slot-order",
                 reading[1], "--out", str(out), "--json"]) == 0
    details = Plan.read(out).details
    assert (details["replica_assignment"], details["slot_order"], details["time_limit_s"]) == (*reading, 3.0)
    assert details["solve_summary"]["solves"] >= 2


def test_plan_microbatches_errors(step_file, capsys):
    assert main(["plan", "microbatches", str(step_file), "--capacity", "5", "--dp", "2"]) == 2
    assert "more than the capacity T = 5" in capsys.readouterr().err


@pytest.mark.parametrize("option", [["--time-limit", "3"], ["--replica-assignment", "lpt"], ["--slot-order", "sorted"]],
                         ids=lambda option: option[0][2:])
def test_treetrain_options_with_another_planner_are_an_error(step_file, capsys, option):
    assert main(["plan", "microbatches", str(step_file), "--capacity", "500", "--dp", "2", *option]) == 2
    assert f"{option[0]} applies to the treetrain-ortools planner only" in capsys.readouterr().err


def test_bench_planning_says_when_treetrain_options_have_no_effect(tmp_path, capsys):
    """The pipeline passes --time-limit to every planning bench: without treetrain-ortools, a note."""
    out = tmp_path / "planning.json"
    assert main(["bench", "planning", "--trees", "configs/trees/tiny.yaml", "--steps", "0", "--dp", "2", "--repeats",
                 "1", "--planners", "harts,greedy-trie", "--time-limit", "3", "--slot-order", "sorted",
                 "--out", str(out)]) == 0
    assert ("note: treetrain-ortools options {'time_limit_s': 3.0, 'slot_order': 'sorted'} have no effect: "
            "--planners does not list it") in capsys.readouterr().err
    assert all(r["config"]["options"] == {} for r in json.loads(out.read_text()))


def test_plan_microbatches_imports_no_torch(step_file):
    code = (
        "import sys\n"
        "from harts.cli.main import main\n"
        f"assert main(['plan', 'microbatches', {str(step_file)!r}, '--capacity', '300', '--dp', '2']) == 0\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'fla', 'megatron')]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)


def test_bench_planning_writes_records_and_table(tmp_path, capsys):
    out = tmp_path / "planning.json"
    status = main(["bench", "planning", "--trees", "configs/trees/tiny.yaml", "--dp", "2", "--steps", "0,1",
                   "--planners", "harts,treetrain-ortools,greedy-trie", "--time-limit", "2", "--slot-order", "sorted",
                   "--out", str(out)])
    assert status == 0
    records = json.loads(out.read_text())
    assert [(r["config"]["step"], r["config"]["planner"]) for r in records] == [
        (s, p) for s in (0, 1) for p in ("harts", "treetrain-ortools", "greedy-trie")
    ]
    for record in records:
        assert "error" not in record
        results = record["results"]
        assert results["compact_tokens"] >= results["lower_bound_compact_tokens"]
        assert results["microbatches"] % 2 == 0
        assert len(results["slot_imbalance"]) == results["microbatches"] // 2
        assert record["config"]["capacity"] == 512
        assert results["index_seconds"] > 0 and record["config"]["repeats"] == 3
        assert len(results["plan_seconds_each"]) == 3
        assert sorted(results["plan_seconds_each"])[1] == results["plan_seconds"]
        assert len(results["plan_seconds_without_index_each"]) == 3
        assert sorted(results["plan_seconds_without_index_each"])[1] == results["plan_seconds_without_index"] > 0
        if record["config"]["planner"] != "treetrain-ortools":
            assert results["identical_plans"]
        if record["config"]["planner"] == "harts":
            assert results["details"]["work_gap_to_bound"] >= 0
        if record["config"]["planner"] == "treetrain-ortools":
            assert record["config"]["options"] == {"time_limit_s": 2.0, "slot_order": "sorted"}
            details = results["details"]
            assert (details["replica_assignment"], details["slot_order"], details["time_limit_s"]) == (
                "ffd", "sorted", 2.0)
            solves = [info for r in details["replicas"] for info in (r, r.get("equalised")) if info]
            assert details["solve_summary"] == {"solves": len(solves),
                                                "optimal": sum(s["status"] == "OPTIMAL" for s in solves),
                                                "stopped_by_limit": sum(s["stopped_by_limit"] for s in solves)}
    gaps = [r["results"]["details"]["work_gap_to_bound"] for r in records if r["config"]["planner"] == "harts"]
    table = out.with_suffix(".md").read_text()
    assert "| all |" in table and "| paper | 77,581,958 (-3.28%) | 80,213,867 |" in table
    assert "seconds include building the step's prefix index" in table and "excl. index seconds time each" in table
    header = table.splitlines()[0]
    assert "| HARTS s | OR-Tools s | speedup | HARTS s excl. index | OR-Tools s excl. index | speedup excl. index |" in header
    assert f"(W proven optimal) on {sum(g == 0 for g in gaps)} of 2 steps" in table
    summaries = [r["results"]["details"]["solve_summary"] for r in records
                 if r["config"]["planner"] == "treetrain-ortools"]
    solves, optimal, stopped = (sum(s[key] for s in summaries) for key in ("solves", "optimal", "stopped_by_limit"))
    assert (f"OR-Tools (replicas by ffd, slots in sorted order, CP-SAT limit 2 s per solve): {solves} solves on 2 "
            f"steps, {optimal} proven optimal, {stopped} stopped at the limit") in table
    rows = out.with_suffix(".csv").read_text().splitlines()
    assert rows[0].startswith("step,HARTS tokens,OR-Tools tokens,compression") and len(rows) == 1 + 2 + 2
    assert "| paper |" in capsys.readouterr().out


def test_bench_planning_reads_data_dir(tmp_path):
    data = tmp_path / "steps"
    assert main(["trees", "synth", "--config", "configs/trees/tiny.yaml", "--steps", "1", "--out", str(data)]) == 0
    out = tmp_path / "records.jsonl"
    assert main(["bench", "planning", "--trees", "configs/trees/tiny.yaml", "--data", str(data), "--steps", "1",
                 "--planners", "harts", "--dp", "2", "--out", str(out)]) == 0
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["config"]["data"] == str(data) and record["results"]["trajectories"] > 0
    assert main(["bench", "planning", "--trees", "configs/trees/tiny.yaml", "--data", str(data), "--steps", "0",
                 "--planners", "harts", "--out", str(out)]) == 2


def test_bench_planning_refuses_a_step_given_twice(tmp_path, capsys):
    """step_001.npz beside step_001.jsonl: which one is step 1 is not guessed (the first by name was taken)."""
    data = tmp_path / "steps"
    assert main(["trees", "synth", "--config", "configs/trees/tiny.yaml", "--steps", "1", "--out", str(data)]) == 0
    (written,) = data.glob("step_001.*")
    other = data / ("step_001.jsonl" if written.suffix == ".npz" else "step_001.npz")
    other.write_bytes(written.read_bytes())
    capsys.readouterr()
    assert main(["bench", "planning", "--trees", "configs/trees/tiny.yaml", "--data", str(data), "--steps", "1",
                 "--planners", "harts", "--dp", "2", "--out", str(tmp_path / "records.json")]) == 2
    names = sorted([written.name, other.name], key=lambda n: not n.endswith(".npz"))
    assert capsys.readouterr().err == f"harts: error: {data}: step 1 is given twice ({names[0]}, {names[1]})\n"
