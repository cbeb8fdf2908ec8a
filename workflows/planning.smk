# Planning quality and time per step, every planner of the config on every listed step of a dataset (CPU work:
# the OR-Tools planner's CP-SAT runs 2 workers). A planner that fails on a step is an error row (common.smk).


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
        record=planning_record,
        failures=lambda wildcards: failures_file(planning_record(wildcards)),
        failed_attempts=lambda wildcards: failed_attempts(planning_record(wildcards)),
    threads: job("planning")["threads"]
    resources:
        runtime=job("planning")["runtime"],
        mem_mb=job("planning")["mem_mb"],
        measurement=1,
    log:
        "reports/logs/planning/{dataset}.log",
    benchmark:
        "reports/benchmarks/planning/{dataset}.tsv"
    shell:
        "harts bench planning --trees {input.synth} --data data/trees/{wildcards.dataset}"
        " --seed {params.seed} --steps {params.steps} --capacity {params.capacity} --dp {params.dp}"
        " --planners {params.planners} --time-limit {params.time_limit} --repeats {params.repeats}"
        " --out {output.records}"
        ' 2>&1 | tee {log} || {{ test $? -eq 1 && echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) error rows in {params.record}"'
        ' >> {params.failures}; }}'
