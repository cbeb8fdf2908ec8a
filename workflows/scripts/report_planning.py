"""Snakemake adapter: reports/planning.pdf and .csv (harts.report.planning), logged to W&B as an artifact."""

from contextlib import redirect_stderr, redirect_stdout

from harts.report.planning import write_planning_report
from harts.tracking.wandb_log import log_report

snakemake = globals()["snakemake"]
with open(snakemake.log[0], "w", encoding="utf-8") as log, redirect_stdout(log), redirect_stderr(log):
    rows = write_planning_report(list(snakemake.input), snakemake.output.pdf, snakemake.output.csv,
                                 ours=snakemake.params.ours, baseline=snakemake.params.baseline)
    print(f"{len(rows)} row(s) -> {snakemake.output.pdf}, {snakemake.output.csv}")
    log_report("planning", [snakemake.output.pdf, snakemake.output.csv], records=list(snakemake.input))
