# Speedup of the compact execution over the per-trajectory baseline: one job per (model, parallel
# configuration, planner, step); reports/raw/speedup/{model}/{parallel}.json collects one parallel
# configuration's records, so `snakemake --cores all reports/raw/speedup/MODEL/PARALLEL.json` reruns it alone.
# Timing jobs take every core (threads), so no other job runs beside them; their torch threads
# (OMP_NUM_THREADS) are the resource `torch_threads`, all cores unless a profile sets it.


rule speedup_step:
    input:
        step=lambda wildcards: step_file(config["speedup"]["dataset"], wildcards.step),
        model="configs/models/{model}.yaml",
        parallel="configs/parallel/{parallel}.yaml",
    output:
        "reports/raw/speedup/{model}/{parallel}/{planner}/step_{step}.json",
    params:
        parallel=parallel_flag,
        capacity=config["speedup"]["capacity"],
        device=config["speedup"]["device"],
        dtype=config["speedup"]["dtype"],
        recompute="--recompute" if config["speedup"]["recompute"] else "",
        repeats=config["speedup"]["repeats"],
        breakdown="" if config["speedup"]["breakdown"] else "--no-breakdown",
    threads: workflow.cores
    resources:
        torch_threads=lambda wildcards, threads: threads,
        gpu=lambda wildcards: gpus("speedup", wildcards),
    log:
        "reports/logs/speedup/{model}/{parallel}/{planner}/step_{step}.log",
    benchmark:
        "reports/benchmarks/speedup/{model}/{parallel}/{planner}/step_{step}.tsv"
    shell:
        "OMP_NUM_THREADS={resources.torch_threads} harts bench speedup --model {input.model} --trees {input.step} {params.parallel}"
        " --planner {wildcards.planner} --capacity {params.capacity} --device {params.device} --dtype {params.dtype}"
        " {params.recompute} --repeats {params.repeats} {params.breakdown} --out {output}"
        " 2>&1 | tee {log} || [ $? -eq 1 ]"


rule speedup_config:
    input:
        lambda wildcards: speedup_step_records(wildcards.model, wildcards.parallel),
    output:
        "reports/raw/speedup/{model}/{parallel}.json",
    params:
        benchmark="speedup",
    log:
        "reports/logs/speedup_config/{model}/{parallel}.log",
    script:
        "scripts/collect_records.py"
