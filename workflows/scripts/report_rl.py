"""Snakemake adapter: reports/rl.pdf and .csv, or reports/rl-NAME.pdf and .csv (harts.report.rl)."""

from contextlib import redirect_stderr, redirect_stdout

from harts.report.rl import write_rl_report

snakemake = globals()["snakemake"]
with open(snakemake.log[0], "w", encoding="utf-8") as log, redirect_stdout(log), redirect_stderr(log):
    rows = write_rl_report(list(snakemake.input), snakemake.output.pdf, snakemake.output.csv)
    print(f"{len(rows)} row(s) -> {snakemake.output.pdf}, {snakemake.output.csv}")
