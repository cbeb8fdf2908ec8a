"""The Snakemake pipeline: lint, a dry run of every target in every profile, config checks, and (slow) the
`tiny` profile end to end: every report built, PDFs parsed, CSV columns, W&B offline runs, reruns.

Every run works in a temporary directory holding a copy of configs/ and a link to data/samples, with the
repository's Snakefile, so nothing under the repository's data/ or reports/ is touched.
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
TARGETS = ["reports/speedup.pdf", "reports/speedup.csv", "reports/planning.pdf", "reports/planning.csv",
           "reports/fidelity.pdf", "reports/fidelity.csv", "reports/summary.md"]
PROFILES = {"default": "configs/pipeline.yaml", "tiny": "configs/pipeline-tiny.yaml",
            "h200": "configs/pipeline-h200.yaml", "h200x2": "configs/pipeline-h200x2.yaml",
            "paper": "configs/pipeline-paper.yaml"}


@pytest.fixture
def workdir(tmp_path):
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "samples").symlink_to(REPO / "data" / "samples")
    return tmp_path


def snakemake(cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Snakemake on the repository's Snakefile in `cwd`, W&B in its default (offline) mode."""
    environ = {k: v for k, v in os.environ.items() if k not in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_SWEEP_ID")}
    return subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env=environ)


def job_counts(output: str) -> dict[str, int]:
    table = output[output.index("Job stats:"):]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.MULTILINE)}


def test_lint_only_the_documented_exception(workdir):
    result = snakemake(workdir, "--lint")
    output = result.stdout + result.stderr
    messages = set(re.findall(r"^\s+\* (.+?):?$", output, re.MULTILINE))
    # Deliberate exception (README): the jobs run in the environment harts is installed in, not in a
    # per-rule conda environment or container.
    assert messages == {"Specify a conda environment or container for each rule."}, output
    assert "Lints for snakefile" not in output


@pytest.mark.parametrize("profile", list(PROFILES), ids=list(PROFILES))
def test_dry_run_every_target(workdir, profile):
    config = yaml.safe_load((REPO / PROFILES[profile]).read_text(encoding="utf-8"))
    model, parallel = config["speedup"]["models"][0], config["speedup"]["parallel"][-1]
    one_config = f"reports/raw/speedup/{model}/{parallel}.json"
    result = snakemake(workdir, "-n", "--workflow-profile", profile, *TARGETS, one_config)
    assert result.returncode == 0, result.stderr[-3000:]
    counts = job_counts(result.stdout)
    s, f = config["speedup"], config["fidelity"]
    assert counts["speedup_step"] == len(s["models"]) * len(s["parallel"]) * len(s["planners"]) * len(s["steps"])
    assert counts["fidelity"] == len(f["models"]) * len(f["parallel"])
    assert counts["planning"] == len(config["planning"]["datasets"])
    assert counts["summary"] == counts["report_speedup"] == counts["report_planning"] == counts["report_fidelity"] == 1

    alone = job_counts(snakemake(workdir, "-n", "--workflow-profile", profile, one_config).stdout)
    assert alone["speedup_step"] == len(s["planners"]) * len(s["steps"]) and alone["speedup_config"] == 1
    assert "fidelity" not in alone and "planning" not in alone


@pytest.mark.parametrize("profile", list(PROFILES), ids=list(PROFILES))
def test_dry_run_rl_report(workdir, profile):
    """reports/rl.pdf: one rl_seed job per seed of the pipeline config's RL config (CUDA jobs ask for a GPU);
    not part of `all`."""
    from harts.rl.config import load_rl_config

    name = yaml.safe_load((REPO / PROFILES[profile]).read_text(encoding="utf-8")).get("rl", {}).get("config", "cpu")
    rl = load_rl_config(REPO / "configs" / "rl" / f"{name}.yaml")
    result = snakemake(workdir, "-n", "--workflow-profile", profile, "reports/rl.pdf")
    assert result.returncode == 0, result.stderr[-3000:]
    counts = job_counts(result.stdout)
    assert counts["rl_seed"] == len(rl.seeds) and counts["report_rl_default"] == 1
    for seed in rl.seeds:
        assert f"reports/raw/rl/{name}/seed_{seed:03d}.json" in result.stdout
    assert ("gpu=1" in result.stdout) == (rl.device == "cuda")
    assert "rl_seed" not in job_counts(snakemake(workdir, "-n", "--workflow-profile", profile).stdout)


BAD_CONFIGS = {
    "unknown-key": ({"speedup": {"warmup": 3}}, "Additional properties are not allowed ('warmup' was unexpected)"),
    "unknown-planner": ({"planning": {"planners": ["harts", "magic"]}}, "'magic' is not one of"),
    "missing-model": ({"speedup": {"models": ["nope"]}}, "no file configs/models/nope.yaml"),
    "missing-parallel": ({"fidelity": {"parallel": ["dp16"]}}, "no file configs/parallel/dp16.yaml"),
    "unknown-dataset": ({"fidelity": {"dataset": "elsewhere"}}, "fidelity.dataset 'elsewhere' is not in datasets"),
    "missing-synth-config": ({"datasets": {"tiny": {"synth": "configs/trees/nope.yaml"}}},
                             "datasets.tiny.synth: no file or directory configs/trees/nope.yaml"),
    "missing-ingest-input": ({"datasets": {"swe-agent": {"ingest": {"input": "data/nope", "format": "messages",
                                                                     "tokenizer": "byte"}}}},
                             "datasets.swe-agent.ingest.input: no file or directory data/nope"),
    "missing-rl-config": ({"rl": {"config": "nope"}}, "rl.config: no file configs/rl/nope.yaml"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS), ids=list(BAD_CONFIGS))
def test_bad_config_fails_with_a_clear_message(workdir, case):
    change, message = BAD_CONFIGS[case]
    config = yaml.safe_load((REPO / "configs" / "pipeline-tiny.yaml").read_text(encoding="utf-8"))
    for section, values in change.items():
        config[section].update(values)
    (workdir / "bad.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    result = snakemake(workdir, "-n", "--configfile", "bad.yaml")
    assert result.returncode != 0
    assert message in result.stdout + result.stderr


def test_nested_config_values_on_the_command_line(workdir):
    # Snakemake hands nested --config values over as strings ('512'); they must reach the jobs as numbers.
    target = "reports/raw/speedup/tiny/single.json"
    result = snakemake(workdir, target, "-n", "-p", "--workflow-profile", "tiny",
                       "--config", "speedup={capacity: 300, recompute: true, repeats: 2, steps: [1]}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--capacity 300" in result.stdout and "--recompute --repeats 2" in result.stdout
    assert "step_001.json" in result.stdout and "step_000.json" not in result.stdout


def _pdf_text(path: Path) -> tuple[int, str]:
    from pypdf import PdfReader

    reader = PdfReader(str(path))
    return len(reader.pages), "\n".join(page.extract_text() or "" for page in reader.pages)


def _columns(path: Path) -> list[str]:
    with open(path, newline="", encoding="utf-8") as handle:
        return next(csv.reader(handle))


@pytest.mark.slow
def test_tiny_profile_end_to_end(workdir):
    from harts.bench.records import git_state
    from harts.report.fidelity import FIDELITY_COLUMNS
    from harts.report.planning import PLANNING_COLUMNS
    from harts.report.speedup import SPEEDUP_COLUMNS

    # One job that fails (a model config with an unknown key) beside the pipeline: the others finish.
    model = yaml.safe_load((workdir / "configs" / "models" / "tiny.yaml").read_text(encoding="utf-8"))
    (workdir / "configs" / "models" / "broken.yaml").write_text(
        yaml.safe_dump({**model, "name": "broken", "attention_sinks": 4}), encoding="utf-8")
    broken = "reports/raw/fidelity/broken/single.json"
    result = snakemake(workdir, "--cores", "2", "--workflow-profile", "tiny", "all", broken, timeout=900)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "Error in rule fidelity" in output
    assert not (workdir / broken).exists()
    assert "attention_sinks" in (workdir / "reports/logs/fidelity/broken/single.log").read_text(encoding="utf-8")

    reports = workdir / "reports"
    for name, pages, expected in (("speedup", 4, ["5.62x", "4.81x", "tiny / single / harts", "tiny / dp2 / harts"]),
                                  ("planning", 2, ["Planning quality: HARTS vs OR-Tools", "77,581,958"]),
                                  ("fidelity", 5, ["Replay ablation by handoff depth", "split-rerun", "tiny / dp2",
                                                   "Where a path departs from the baseline"])):
        count, text = _pdf_text(reports / f"{name}.pdf")
        assert count == pages, name
        for snippet in expected:
            assert snippet in text, (name, snippet)
    assert _columns(reports / "speedup.csv") == SPEEDUP_COLUMNS
    assert _columns(reports / "planning.csv") == PLANNING_COLUMNS
    assert _columns(reports / "fidelity.csv") == FIDELITY_COLUMNS
    summary = (reports / "summary.md").read_text(encoding="utf-8")
    for section in ("## Provenance", "## Datasets", "## Speedup", "## Planning quality", "## Fidelity",
                    "## Pipeline jobs", "## Pipeline config", git_state()["sha"], "data/trees/swe-agent/step_000.npz"):
        assert section in summary, section
    runs = list((reports / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) >= 9  # trees (3), planning (2 planners), speedup (2), fidelity (2)

    # Nothing to redo (a touched but unchanged input included); an edited parallel config reruns only its own
    # jobs and what reads their records.
    dp2 = workdir / "configs" / "parallel" / "dp2.yaml"
    os.utime(dp2)
    assert "Nothing to be done" in snakemake(workdir, "-n", "--workflow-profile", "tiny").stdout
    records = sorted((reports / "raw").rglob("*.json"))
    before = {p: p.stat().st_mtime_ns for p in records}
    dp2.write_text(dp2.read_text(encoding="utf-8") + "# edited\n", encoding="utf-8")
    counts = job_counts(snakemake(workdir, "-n", "--workflow-profile", "tiny").stdout)
    assert counts["speedup_step"] == 1 and counts["fidelity"] == 1 and counts["speedup_config"] == 1
    assert "planning" not in counts and "synth_trees" not in counts and "trees_record" not in counts
    assert {p: p.stat().st_mtime_ns for p in records} == before
