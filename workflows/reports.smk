# Reports from the records: PDF + CSV per experiment, and reports/summary.md with every table.


rule report_speedup:
    input:
        speedup_records(),
    output:
        pdf="reports/speedup.pdf",
        csv="reports/speedup.csv",
    log:
        "reports/logs/report/speedup.log",
    script:
        "scripts/report_speedup.py"


rule report_planning:
    input:
        planning_records(),
    output:
        pdf="reports/planning.pdf",
        csv="reports/planning.csv",
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
        pdf="reports/fidelity.pdf",
        csv="reports/fidelity.csv",
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
        "reports/summary.md",
    params:
        ours=config["planning"]["planners"][0],
        baseline=config["planning"]["planners"][1],
        benchmarks="reports/benchmarks",
    log:
        "reports/logs/report/summary.log",
    script:
        "scripts/summary.py"
