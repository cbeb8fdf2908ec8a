"""harts.report.planning: per-step and all-steps rows (HARTS vs the OR-Tools planner) and the PDF."""

from __future__ import annotations

import csv

import pytest

from harts.report.planning import PLANNING_COLUMNS, planning_markdown, planning_rows, write_planning_report
from harts.report.records import ERROR, NOT_MEASURED

from .helpers import pdf_text, planning_record, write

OURS, THEIRS = "harts", "treetrain-ortools"


def _ortools_details(solves, optimal, stopped, assignment="ffd", order="solver", limit=10.0):
    return {"replica_assignment": assignment, "slot_order": order, "time_limit_s": limit,
            "solve_summary": {"solves": solves, "optimal": optimal, "stopped_by_limit": stopped}}


def _records():
    return [
        planning_record(planner=OURS, step=0, tokens=1000, seconds=0.5, slots=(0.01, 0.02), step_imbalance=0.01),
        planning_record(planner=THEIRS, step=0, tokens=1050, seconds=4.0, slots=(0.3, 0.4), step_imbalance=0.05,
                        details=_ortools_details(8, 3, 5)),
        planning_record(planner=OURS, step=1, tokens=900, seconds=0.25, slots=(0.05,), step_imbalance=0.02),
        planning_record(planner=THEIRS, step=1, tokens=990, seconds=2.5, slots=(0.1,), step_imbalance=0.03,
                        details=_ortools_details(9, 1, 8)),
    ]


def test_rows_per_step_over_all_steps_and_paper():
    rows = planning_rows(_records(), OURS, THEIRS)
    assert [(r["source"], r["step"]) for r in rows] == [("ours", 0), ("ours", 1), ("ours", "all"), ("paper", "all")]
    step0, step1, total, paper = rows
    assert step0["compression"] == pytest.approx(1.05) and step0["planning_speedup"] == pytest.approx(8.0)
    assert step0["compact_token_change"] == pytest.approx(1000 / 1050 - 1)
    assert step1["compression"] == pytest.approx(1.1) and step1["ours_p95_slot_imbalance"] == 0.05
    assert total["ours_compact_tokens"] == 1900 and total["baseline_compact_tokens"] == 2040
    assert total["planning_speedup"] == pytest.approx(6.5 / 0.75)
    # nearest-rank P95 over every slot of both steps: the largest of three (ours) and of three (theirs)
    assert total["ours_p95_slot_imbalance"] == pytest.approx(0.05)
    assert total["baseline_p95_slot_imbalance"] == pytest.approx(0.4)
    assert total["ours_step_imbalance"] == 0.02 and total["baseline_step_imbalance"] == 0.05
    assert paper["compact_token_change"] == pytest.approx(-0.0328, abs=5e-5)
    assert paper["compression"] == "1.007-1.079" and paper["planning_speedup"] == "7.24-9.73"
    assert all(set(r) == set(PLANNING_COLUMNS) for r in rows)
    assert all(r["planning_speedup_without_index"] == NOT_MEASURED for r in rows[:3]), "records before that timing"


def test_speedup_without_the_shared_index():
    """Each planner given the step's prefix index: per step, and Σ over the steps when every record has it."""
    records = [planning_record(planner=OURS, step=0, tokens=1000, seconds=0.5, seconds_without_index=0.01),
               planning_record(planner=THEIRS, step=0, tokens=1050, seconds=4.0, seconds_without_index=0.2),
               planning_record(planner=OURS, step=1, tokens=900, seconds=0.25, seconds_without_index=0.03),
               planning_record(planner=THEIRS, step=1, tokens=990, seconds=2.5, seconds_without_index=0.3)]
    step0, step1, total, _ = planning_rows(records, OURS, THEIRS)
    assert step0["planning_speedup_without_index"] == pytest.approx(20.0)
    assert step1["planning_speedup_without_index"] == pytest.approx(10.0)
    assert total["ours_plan_seconds_without_index"] == pytest.approx(0.04)
    assert total["planning_speedup_without_index"] == pytest.approx(0.5 / 0.04)
    assert step0["planning_speedup"] == pytest.approx(8.0)
    _, _, total, _ = planning_rows(records[:3] + _records()[3:], OURS, THEIRS)
    assert total["baseline_plan_seconds_without_index"] == NOT_MEASURED


def test_missing_and_failed_plans_say_so():
    records = _records()[:3] + [planning_record(planner=THEIRS, step=1, tokens=0, seconds=0, error="CP-SAT: infeasible")]
    rows = planning_rows(records, OURS, THEIRS)
    assert rows[1]["baseline_compact_tokens"] == ERROR and rows[1]["compression"] == ERROR
    assert "treetrain-ortools: CP-SAT: infeasible" in rows[1]["error"]
    assert rows[2]["baseline_compact_tokens"] == ERROR and rows[2]["ours_compact_tokens"] == 1900
    rows = planning_rows(_records()[:3], OURS, THEIRS)
    assert rows[1]["baseline_compact_tokens"] == NOT_MEASURED and rows[1]["compression"] == NOT_MEASURED
    assert rows[2]["baseline_plan_seconds"] == NOT_MEASURED


def test_report_files(tmp_path):
    records = write(tmp_path, "tiny.json", _records())
    pdf, table = tmp_path / "planning.pdf", tmp_path / "planning.csv"
    write_planning_report([records], pdf, table)
    with open(table, newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        rows = list(reader)
    assert reader.fieldnames == PLANNING_COLUMNS and len(rows) == 4
    assert float(rows[0]["compression"]) == pytest.approx(1.05)
    pages, text = pdf_text(pdf)
    assert pages == 2
    for expected in ("Planning quality: HARTS vs OR-Tools", "P95 slot imbalance", "paper OR-Tools 34.64%",
                     "77,581,958", "-3.28%", "7.24-9.73x", "1.050x", "8.00x"):
        assert expected in text, expected
    assert ("OR-Tools (replicas by ffd, slots in solver order, CP-SAT limit 10 s per solve): 17 solves on 2 steps, "
            "4 proven optimal, 13 stopped at the limit.") in " ".join(text.split())


@pytest.mark.parametrize(("details", "lines"), [
    ([_ortools_details(8, 3, 5), _ortools_details(9, 3, 6)],
     ["OR-Tools (replicas by ffd, slots in solver order, CP-SAT limit 10 s per solve): 17 solves on 2 steps, "
      "6 proven optimal, 11 stopped at the limit."]),
    ([_ortools_details(8, 3, 4, limit=2.5), _ortools_details(2, 2, 0, "lpt", "sorted", 2.5)],
     ["OR-Tools (replicas by ffd, slots in solver order, CP-SAT limit 2.5 s per solve): 8 solves on 1 step, "
      "3 proven optimal, 4 stopped at the limit, 1 other.",
      "OR-Tools (replicas by lpt, slots in sorted order, CP-SAT limit 2.5 s per solve): 2 solves on 1 step, "
      "2 proven optimal, 0 stopped at the limit."]),
    ([{"time_limit_s": 10.0}, {"time_limit_s": 10.0}],
     ["OR-Tools (reading not recorded, CP-SAT limit 10 s per solve): solve statuses not recorded on 2 step(s)."]),
], ids=["one-reading", "two-readings-and-other", "records-before-statuses"])
def test_solve_statuses_under_the_table(tmp_path, details, lines):
    records = [planning_record(planner=OURS, step=0, tokens=1000, seconds=0.5),
               planning_record(planner=THEIRS, step=0, tokens=1050, seconds=4.0, details=details[0]),
               planning_record(planner=OURS, step=1, tokens=900, seconds=0.25),
               planning_record(planner=THEIRS, step=1, tokens=990, seconds=2.5, details=details[1])]
    path = write(tmp_path, "records.json", records)
    markdown = planning_markdown([path])
    assert markdown.split("\n\n")[1:] == lines
