# Fidelity per (model, parallel configuration): `single` gives the replay ablation by handoff depth, the
# logit cosine of each path and |dloss| / gradients +- recomputation; another configuration gives the
# logit fidelity, loss and gradients of both executions on its ranks against the single-process baseline.
# Resources as for speedup_step (workflows/speedup.smk), from the config's resources.fidelity.


rule fidelity:
    input:
        step=step_file(config["fidelity"]["dataset"], config["fidelity"]["step"]),
        model="configs/models/{model}.yaml",
        parallel="configs/parallel/{parallel}.yaml",
    output:
        "reports/raw/fidelity/{model}/{parallel}.json",
    params:
        parallel=parallel_flag,
        max_trees=f"--max-trees {config['fidelity']['max_trees']}" if "max_trees" in config["fidelity"] else "",
        grad_max_tokens=(f"--grad-max-tokens {config['fidelity']['grad_max_tokens']}"
                         if "grad_max_tokens" in config["fidelity"] else ""),
        capacity=config["fidelity"]["capacity"],
        device=config["fidelity"]["device"],
        dtype=config["fidelity"]["dtype"],
        record=fidelity_record,
        failures=lambda wildcards: failures_file(fidelity_record(wildcards)),
        failed_attempts=lambda wildcards: failed_attempts(fidelity_record(wildcards)),
    threads: job("fidelity")["threads"]
    resources:
        runtime=job("fidelity")["runtime"],
        mem_mb=job("fidelity")["mem_mb"],
        gpu=lambda wildcards: gpus("fidelity", wildcards),
        gpu_pool=GPU_POOL,
        measurement=1,
        torch_threads=lambda wildcards, threads: threads,
    log:
        "reports/logs/fidelity/{model}/{parallel}.log",
    benchmark:
        "reports/benchmarks/fidelity/{model}/{parallel}.tsv"
    shell:
        "OMP_NUM_THREADS={resources.torch_threads} python -m harts.workflow.devices --take {resources.gpu}"
        " --pool {resources.gpu_pool} -- harts bench fidelity --model {input.model} --trees {input.step}"
        " {params.parallel} {params.max_trees} {params.grad_max_tokens} --capacity {params.capacity}"
        " --device {params.device} --dtype {params.dtype} --out {output}"
        ' 2>&1 | tee {log} || {{ test $? -eq 1 && echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) error rows in {params.record}"'
        ' >> {params.failures}; }}'
