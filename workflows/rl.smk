# Online RL (the paper's §5.3): GRPO on rollout trees the model samples itself, the compact execution and the
# per-trajectory baseline side by side from the same initial weights and sampling seeds. One job per seed of an
# RL config (configs/rl/NAME.yaml, which lists its seeds), both executions in lockstep inside the job, every step
# logged to W&B as it ends (offline by default); the report plots both reward curves with their seed spread.
#   snakemake --cores all reports/rl.pdf          the pipeline config's RL config (rl.config: cpu by default,
#                                                 h200 in the GPU profiles)
#   snakemake --cores all reports/rl-NAME.pdf     any configs/rl/NAME.yaml (rl-tiny: the tests' few steps)
# reports/rl.pdf is not part of `all` (the default CPU run takes 10-11 minutes on an idle 2-core machine). A job
# takes the threads, runtime and memory of the config's resources.rl_seed (default: one thread, so `--cores N`
# runs N CPU seeds at a time); a CUDA job takes one `gpu` of the pool (harts.workflow.devices). The two executions
# of a seed share their process and device, which is what the per-step time comparison needs.


rule rl_seed:
    input:
        rl="configs/rl/{rl}.yaml",
        model=lambda wildcards: rl_model_file(wildcards.rl),
    output:
        "reports/raw/rl/{rl}/seed_{seed}.json",
    wildcard_constraints:
        rl=NAME,
        seed=r"\d{3}",
    threads: job("rl_seed")["threads"]
    resources:
        runtime=job("rl_seed")["runtime"],
        mem_mb=job("rl_seed")["mem_mb"],
        gpu=lambda wildcards: 1 if rl_config(wildcards.rl).device == "cuda" else 0,
        gpu_pool=GPU_POOL,
        torch_threads=lambda wildcards, threads: threads,
    log:
        "reports/logs/rl/{rl}/seed_{seed}.log",
    benchmark:
        "reports/benchmarks/rl/{rl}/seed_{seed}.tsv"
    shell:
        "OMP_NUM_THREADS={resources.torch_threads} python -m harts.workflow.devices --take {resources.gpu}"
        " --pool {resources.gpu_pool} -- harts rl --config {input.rl} --seeds {wildcards.seed} --out {output}"
        " --wandb --no-progress 2>&1 | tee {log} || [ $? -eq 1 ]"


rule report_rl:
    input:
        lambda wildcards: rl_records(wildcards.rl),
    output:
        pdf="reports/rl-{rl}.pdf",
        csv="reports/rl-{rl}.csv",
    wildcard_constraints:
        rl=NAME,
    log:
        "reports/logs/report/rl-{rl}.log",
    script:
        "scripts/report_rl.py"


rule report_rl_default:
    input:
        rl_records(config["rl"]["config"]),
    output:
        pdf="reports/rl.pdf",
        csv="reports/rl.csv",
    log:
        "reports/logs/report/rl.log",
    script:
        "scripts/report_rl.py"
