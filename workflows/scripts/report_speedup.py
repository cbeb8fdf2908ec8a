"""Snakemake adapter: reports/speedup.pdf and .csv (harts.report.speedup), logged to W&B as an artifact."""

from contextlib import redirect_stderr, redirect_stdout

from harts.report.speedup import write_speedup_report
from harts.tracking.wandb_log import log_report

snakemake = globals()["snakemake"]
with open(snakemake.log[0], "w", encoding="utf-8") as log, redirect_stdout(log), redirect_stderr(log):
    rows = write_speedup_report(list(snakemake.input), snakemake.output.pdf, snakemake.output.csv)
    print(f"{len(rows)} row(s) -> {snakemake.output.pdf}, {snakemake.output.csv}")
    log_report("speedup", [snakemake.output.pdf, snakemake.output.csv], records=list(snakemake.input))
