# Reports from the records: PDF + CSV per experiment, and reports/summary.md with every table. These rules and
# speedup_config are local rules (Snakefile: localrules): they read a few JSON files, and on a cluster they run
# on the host that runs Snakemake instead of waiting in a queue. Their outputs go into `snakemake --report`
# (report: captions in workflows/report/); each report's PDF and CSV is also a W&B artifact (harts.tracking.wandb_log).


rule report_speedup:
    input:
        speedup_records(),
    output:
        pdf=report("reports/speedup.pdf", category="Speedup", caption="report/speedup.rst"),
        csv=report("reports/speedup.csv", category="Speedup", caption="report/speedup.rst"),
    log:
        "reports/logs/report/speedup.log",
    script:
        "scripts/report_speedup.py"


rule report_planning:
    input:
        planning_records(),
    output:
        pdf=report("reports/planning.pdf", category="Planning", caption="report/planning.rst"),
        csv=report("reports/planning.csv", category="Planning", caption="report/planning.rst"),
    params:
        ours=config["planning"]["planners"][0],
        baseline=config["planning"]["planners"][1],
    log:
        "reports/logs/report/planning.log",
    script:
        "scripts/report_planning.py"


rule report_fidelity:
    input:
        fidelity_records(),
    output:
        pdf=report("reports/fidelity.pdf", category="Fidelity", caption="report/fidelity.rst"),
        csv=report("reports/fidelity.csv", category="Fidelity", caption="report/fidelity.rst"),
    log:
        "reports/logs/report/fidelity.log",
    script:
        "scripts/report_fidelity.py"


rule summary:
    input:
        speedup=speedup_records(),
        planning=planning_records(),
        fidelity=fidelity_records(),
        trees=trees_records(),
        reports=multiext("reports/", "speedup.pdf", "planning.pdf", "fidelity.pdf"),
    output:
        report("reports/summary.md", category="Summary", caption="report/summary.rst"),
    params:
        ours=config["planning"]["planners"][0],
        baseline=config["planning"]["planners"][1],
        benchmarks="reports/benchmarks",
    log:
        "reports/logs/report/summary.log",
    script:
        "scripts/summary.py"
