# HARTS pipeline: synthetic or ingested steps -> planning, speedup and fidelity records (reports/raw/, written by
# the `harts` CLI) -> PDF/CSV reports and reports/summary.md. The workflow holds no logic of its own: rules call
# `harts ...` or thin scripts (workflows/scripts/) that import harts.report.
#   snakemake reports/speedup.pdf                                   the default profile (CPU, small)
#   snakemake --workflow-profile profiles/h200 reports/summary.md   one GPU
#   snakemake --workflow-profile profiles/slurm --configfile configs/pipeline-paper.yaml    a SLURM cluster
#   snakemake --report reports/report.html                          the reports and CSVs in one HTML file
# Sizes and per-rule threads, runtime and memory: configs/pipeline*.yaml (schema:
# workflows/schemas/pipeline.schema.yaml, its knob keys made from harts.config.execution); where and how jobs run:
# profiles/*/ (docs/pipeline.md "Pipeline").

from pathlib import Path

from snakemake.utils import min_version

from harts.workflow.config import check_config_files, coerce_strings, load_schema, validate

min_version("9.0")


configfile: "configs/pipeline.yaml"


check_config_files(workflow.configfiles)

# The schema file with the execution knobs' keys made from harts.config.execution (harts.workflow.config).
SCHEMA = load_schema(Path(workflow.basedir) / "workflows/schemas/pipeline.schema.yaml")
# `--config` gives nested values as strings ('512'): read them as the schema's types first.
coerce_strings(config, SCHEMA)
validate(config, SCHEMA)


envvars:
    "PATH",


include: "workflows/common.smk"


wildcard_constraints:
    dataset=NAME,
    step=r"\d{3}",
    model=NAME,
    parallel=NAME,
    planner=alternatives(["harts", "treetrain-ortools", "greedy-trie", "per-trajectory"]),


include: "workflows/trees.smk"
include: "workflows/planning.smk"
include: "workflows/speedup.smk"
include: "workflows/fidelity.smk"
include: "workflows/reports.smk"
include: "workflows/rl.smk"


# Cheap rules that read a few JSON files run where Snakemake runs, never in a cluster queue.
localrules:
    speedup_config,
    report_speedup,
    report_planning,
    report_fidelity,
    report_rl,
    report_rl_default,
    summary,


report: "workflows/report/workflow.rst"


rule all:
    default_target: True
    input:
        "reports/summary.md",
        multiext("reports/speedup", ".pdf", ".csv"),
        multiext("reports/planning", ".pdf", ".csv"),
        multiext("reports/fidelity", ".pdf", ".csv"),
