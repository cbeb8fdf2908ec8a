# Planning quality and time per step, every planner of the config on every listed step of a dataset.
# Exit status 1 of a bench command means "records written, some with an `error` field": the records are
# kept (a failed case is a row in the report, not a gap); any other failure fails the job.


rule planning:
    input:
        synth=synth_config,
        steps=lambda wildcards: [step_file(wildcards.dataset, s) for s in config["planning"]["steps"]],
    output:
        records="reports/raw/planning/{dataset}.json",
        table="reports/raw/planning/{dataset}.md",
        csv="reports/raw/planning/{dataset}.csv",
    params:
        seed=config["seed"],
        steps=comma(config["planning"]["steps"]),
        capacity=config["planning"]["capacity"],
        dp=config["planning"]["dp"],
        planners=comma(config["planning"]["planners"]),
        time_limit=config["planning"]["time_limit_s"],
        repeats=config["planning"]["repeats"],
    threads: workflow.cores
    log:
        "reports/logs/planning/{dataset}.log",
    benchmark:
        "reports/benchmarks/planning/{dataset}.tsv"
    shell:
        "harts bench planning --trees {input.synth} --data data/trees/{wildcards.dataset}"
        " --seed {params.seed} --steps {params.steps} --capacity {params.capacity} --dp {params.dp}"
        " --planners {params.planners} --time-limit {params.time_limit} --repeats {params.repeats}"
        " --out {output.records}"
        " 2>&1 | tee {log} || [ $? -eq 1 ]"
