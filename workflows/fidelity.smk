# Fidelity per (model, parallel configuration): `single` gives the replay ablation by handoff depth, the
# logit cosine of each path and |dloss| / gradients +- recomputation; another configuration gives the
# logit fidelity, loss and gradients of both executions on its ranks against the single-process baseline.


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
    threads: workflow.cores
    resources:
        torch_threads=lambda wildcards, threads: threads,
        gpu=lambda wildcards: gpus("fidelity", wildcards),
    log:
        "reports/logs/fidelity/{model}/{parallel}.log",
    benchmark:
        "reports/benchmarks/fidelity/{model}/{parallel}.tsv"
    shell:
        "OMP_NUM_THREADS={resources.torch_threads} harts bench fidelity --model {input.model} --trees {input.step} {params.parallel}"
        " {params.max_trees} {params.grad_max_tokens} --capacity {params.capacity} --device {params.device} --dtype {params.dtype}"
        " --out {output} 2>&1 | tee {log} || [ $? -eq 1 ]"
