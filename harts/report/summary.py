"""`reports/summary.md`: every table of the run, with hardware, versions, config and git sha.

`write_summary(path, speedup=..., planning=..., fidelity=..., trees=..., reports=..., pipeline_config=...,
benchmarks_dir=...)` reads the record files (harts.tracking.records) and writes markdown sections:
provenance (hardware, package versions, the git sha(s) the records were measured at and whether
the tree had uncommitted changes, the time range), the datasets (trees-build records: S, C, S/C,
segments, build time), the speedup, planning and fidelity tables (the same rows as the PDFs, the
paper's figures beside ours), the wall time and peak memory of every pipeline job (Snakemake's
`benchmark:` files), the report files, and the resolved pipeline config. A table whose records
are missing says so instead of leaving a gap.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import yaml

from harts.files import write_text
from harts.report.records import NOT_MEASURED, load_records, provenance
from harts.report.render import markdown_table


def trees_table(paths: list[str | Path]) -> tuple[list[str], list[list[str]]]:
    header = ["step file", "trajectories", "S", "C", "S/C", "segments", "trie build s", "peak / token array"]
    rows = []
    for record in load_records(paths, "trees-build"):
        r = record.get("results", {})
        source = record["config"].get("data") or f"{record['config'].get('trees')} step {record['config'].get('step')}"
        if "error" in record:
            rows.append([str(source), "error"] + [""] * 6)
            continue
        rows.append([str(source), f"{r['trajectories']:,}", f"{r['semantic_tokens']:,}", f"{r['compact_tokens']:,}",
                     f"{r['semantic_tokens'] / r['compact_tokens']:.2f}", f"{r['segments']:,}",
                     f"{r['build_seconds_median']:.3f}", f"{r['peak_over_token_array']:.2f}x"])
    return header, rows


def job_times(benchmarks_dir: str | Path) -> tuple[list[str], list[list[str]]]:
    """Wall time and peak RSS of every job with a Snakemake benchmark file under `benchmarks_dir`."""
    header = ["job", "wall s", "max RSS MiB"]
    rows = []
    root = Path(benchmarks_dir)
    for path in sorted(root.rglob("*.tsv")) if root.is_dir() else []:
        with open(path, newline="", encoding="utf-8") as handle:
            lines = list(csv.DictReader(handle, delimiter="\t"))
        if not lines:
            continue
        last = lines[-1]
        seconds, rss = last.get("s"), last.get("max_rss")
        rows.append([str(path.relative_to(root).with_suffix("")), _number(seconds, ".1f"), _number(rss, ".0f")])
    return header, rows


def _number(text: Any, spec: str) -> str:
    try:
        return format(float(text), spec)
    except (TypeError, ValueError):
        return str(text) if text not in (None, "", "NA", "-") else NOT_MEASURED


def _section(title: str, body: str) -> str:
    return f"## {title}\n\n{body.strip()}\n"


def _table_or_note(paths: list[str | Path], make, what: str) -> str:
    existing = [p for p in paths if Path(p).is_file()]
    if not existing:
        return f"{what}: not measured (no records)."
    missing = [str(p) for p in paths if not Path(p).is_file()]
    note = f"\n\nNot in this table (no records file): {', '.join(f'`{p}`' for p in missing)}." if missing else ""
    return make(existing) + note


def write_summary(path: str | Path, *, speedup: list[str | Path], planning: list[str | Path],
                  fidelity: list[str | Path], trees: list[str | Path], reports: list[str | Path],
                  pipeline_config: dict[str, Any], benchmarks_dir: str | Path | None = None, ours: str = "harts",
                  baseline: str = "treetrain-ortools") -> str:
    """Write the summary markdown to `path` and return it."""
    from harts.report.fidelity import fidelity_markdown
    from harts.report.planning import planning_markdown
    from harts.report.speedup import speedup_markdown
    from harts.tracking.records import environment, git_state

    all_records = []
    for paths, benchmark in ((speedup, "speedup"), (planning, "planning"), (fidelity, "fidelity"),
                             (trees, "trees-build")):
        all_records += load_records([p for p in paths if Path(p).is_file()], benchmark)
    info = provenance(all_records)
    git = git_state()
    versions = "\n".join(f"- {name}: {', '.join(map(str, v))}" for name, v in sorted(info["versions"].items()))
    now = environment()
    sections = [
        "# HARTS reproduction summary\n\n"
        "Every figure below was measured by this run (the JSON records under `reports/raw/`); the paper's "
        "figures are marked `paper`. A cell that could not be measured says so.\n",
        _section("Provenance", "\n".join([
            "- hardware: " + ("; ".join(info["hardware"]) or "unknown"),
            "- records measured at git " + (", ".join(info["git_shas"]) or "unknown")
            + (" (with uncommitted changes)" if info["git_dirty"] else ""),
            f"- summary written at git {git['sha']}{' (with uncommitted changes)' if git['dirty'] else ''}, "
            f"{now['utc']} UTC",
            f"- measurements from {info['utc_first'] or '?'} to {info['utc_last'] or '?'} UTC",
            "- versions:\n" + "\n".join("  " + line for line in versions.splitlines()),
        ])),
        _section("Datasets", _table_or_note(trees, lambda p: markdown_table(*trees_table(p)), "datasets")),
        _section("Speedup (reports/speedup.pdf)", _table_or_note(speedup, speedup_markdown, "speedup")),
        _section("Planning quality (reports/planning.pdf)",
                 _table_or_note(planning, lambda p: planning_markdown(p, ours, baseline), "planning")),
        _section("Fidelity (reports/fidelity.pdf)", _table_or_note(fidelity, fidelity_markdown, "fidelity")),
    ]
    if benchmarks_dir is not None:
        header, rows = job_times(benchmarks_dir)
        sections.append(_section("Pipeline jobs (wall time, peak memory)",
                                 markdown_table(header, rows) if rows else "no job benchmark files found."))
    sections.append(_section("Files", "\n".join(
        [f"- report: `{p}`" for p in reports]
        + [f"- records: `{p}`" + ("" if Path(p).is_file() else " (absent)")
           for p in [*speedup, *planning, *fidelity, *trees]])))
    sections.append(_section("Pipeline config", "```yaml\n" + yaml.safe_dump(pipeline_config, sort_keys=False)
                             + "```"))
    text = "\n".join(sections)
    write_text(path, text)
    return text
