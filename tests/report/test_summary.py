"""harts.report.summary: every table, provenance, job times and config in reports/summary.md."""

from __future__ import annotations

from harts.report.summary import write_summary
from harts.tracking.records import git_state, make_record, write_records

from .helpers import fidelity_record, planning_record, speedup_record, write


def test_summary_sections(tmp_path):
    speedup = write(tmp_path, "speedup.json", [speedup_record()])
    planning = write(tmp_path, "planning.json", [
        planning_record(planner="harts", step=0, tokens=1000, seconds=0.5),
        planning_record(planner="treetrain-ortools", step=0, tokens=1010, seconds=1.5)])
    trees = tmp_path / "trees.json"
    write_records([make_record("trees-build", {"data": "data/trees/tiny/step_000.npz"}, {
        "trajectories": 10, "semantic_tokens": 1971, "compact_tokens": 920, "segments": 17,
        "build_seconds_median": 0.001, "peak_over_token_array": 4.15})], trees)
    benchmarks = tmp_path / "benchmarks" / "speedup"
    benchmarks.mkdir(parents=True)
    (benchmarks / "step_000.tsv").write_text("s\th:m:s\tmax_rss\n12.5\t0:00:12\t300.2\n", encoding="utf-8")
    out = tmp_path / "summary.md"
    text = write_summary(out, speedup=[speedup, tmp_path / "absent-speedup.json"], planning=[planning],
                         fidelity=[tmp_path / "absent.json"],
                         trees=[trees], reports=["reports/speedup.pdf"], pipeline_config={"seed": 0, "speedup": {}},
                         benchmarks_dir=tmp_path / "benchmarks")
    assert out.read_text(encoding="utf-8") == text
    for expected in ("## Provenance", "## Datasets", "| data/trees/tiny/step_000.npz | 10 | 1,971 | 920 | 2.14 |",
                     "## Speedup", "| paper | Ling-3.0-tiny |", "## Planning quality", "77,581,958",
                     "fidelity: not measured (no records)", "| speedup/step_000 | 12.5 | 300 |", "```yaml\nseed: 0",
                     f"summary written at git {git_state()['sha']}",
                     f"Not in this table (no records file): `{tmp_path / 'absent-speedup.json'}`.",
                     f"- records: `{tmp_path / 'absent.json'}` (absent)", f"- records: `{speedup}`\n"):
        assert expected in text, expected


def test_fidelity_tables_in_summary(tmp_path):
    fidelity = write(tmp_path, "fidelity.json", [fidelity_record()])
    text = write_summary(tmp_path / "s.md", speedup=[], planning=[], fidelity=[fidelity], trees=[], reports=[],
                         pipeline_config={})
    assert "| ours | tiny | 2 | 102 |" in text and "HARTS (replay): loss, gradients" in text
    assert "speedup: not measured (no records)" in text
