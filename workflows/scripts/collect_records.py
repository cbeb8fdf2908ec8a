"""Snakemake adapter: concatenate the records of the input files into the output file."""

from contextlib import redirect_stderr, redirect_stdout

from harts.report.records import load_records
from harts.tracking.records import write_records

snakemake = globals()["snakemake"]
with open(snakemake.log[0], "w", encoding="utf-8") as log, redirect_stdout(log), redirect_stderr(log):
    records = load_records(list(snakemake.input), snakemake.params.benchmark)
    write_records(records, snakemake.output[0])
    print(f"{len(records)} record(s) from {len(snakemake.input)} file(s) -> {snakemake.output[0]}")
