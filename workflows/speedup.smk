# Speedup of the compact execution over the per-trajectory baseline: one job per (model, parallel
# configuration, planner, step); reports/raw/speedup/{model}/{parallel}.json collects one parallel
# configuration's records. A job takes the threads, runtime and memory of the config's resources.speedup_step,
# its parallel configuration's world size as `gpu` (its own devices: harts.workflow.devices), and one
# `measurement` (the local profiles run one at a time); its torch threads (OMP_NUM_THREADS) are the resource
# `torch_threads`, its threads unless a profile sets it.


rule speedup_step:
    input:
        step=lambda wildcards: step_file(config["speedup"]["dataset"], wildcards.step),
        model="configs/models/{model}.yaml",
        parallel="configs/parallel/{parallel}.yaml",
    output:
        "reports/raw/speedup/{model}/{parallel}/{planner}/step_{step}.json",
    params:
        parallel=parallel_flag,
        device=config["speedup"]["device"],
        dtype=config["speedup"]["dtype"],
        repeats=config["speedup"]["repeats"],
        breakdown="" if config["speedup"]["breakdown"] else "--no-breakdown",
        execution=" ".join(pipeline_flags(config["speedup"])),
        record=speedup_record,
        failures=lambda wildcards: failures_file(speedup_record(wildcards)),
        failed_attempts=lambda wildcards: failed_attempts(speedup_record(wildcards)),
    threads: job("speedup_step")["threads"]
    resources:
        runtime=job("speedup_step")["runtime"],
        mem_mb=job("speedup_step")["mem_mb"],
        gpu=lambda wildcards: gpus("speedup", wildcards),
        gpu_pool=GPU_POOL,
        measurement=1,
        torch_threads=lambda wildcards, threads: threads,
    log:
        "reports/logs/speedup/{model}/{parallel}/{planner}/step_{step}.log",
    benchmark:
        "reports/benchmarks/speedup/{model}/{parallel}/{planner}/step_{step}.tsv"
    shell:
        "OMP_NUM_THREADS={resources.torch_threads} python -m harts.workflow.devices --take {resources.gpu}"
        " --pool {resources.gpu_pool} -- harts bench speedup --model {input.model} --trees {input.step}"
        " {params.parallel} --planner {wildcards.planner} --device {params.device} --dtype {params.dtype}"
        " {params.execution} --repeats {params.repeats} {params.breakdown}"
        " --out {output}"
        ' 2>&1 | tee {log} || {{ test $? -eq 1 && echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) error rows in {params.record}"'
        ' >> {params.failures}; }}'


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
