"""Snakemake adapter: reports/summary.md (harts.report.summary) with the pipeline's resolved config."""

from contextlib import redirect_stderr, redirect_stdout

from harts.report.summary import write_summary

snakemake = globals()["snakemake"]
with open(snakemake.log[0], "w", encoding="utf-8") as log, redirect_stdout(log), redirect_stderr(log):
    write_summary(
        snakemake.output[0], speedup=list(snakemake.input.speedup), planning=list(snakemake.input.planning),
        fidelity=list(snakemake.input.fidelity), trees=list(snakemake.input.trees),
        reports=list(snakemake.input.reports), pipeline_config=dict(snakemake.config),
        benchmarks_dir=snakemake.params.benchmarks, ours=snakemake.params.ours, baseline=snakemake.params.baseline,
    )
    print(f"wrote {snakemake.output[0]}")
