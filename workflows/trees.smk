# Steps on disk, data/trees/{dataset}/step_NNN.npz: generated from a trees config (one job per step) or
# ingested from agent logs (step 000); and a trees-build record per step (S, C, trie build time and memory,
# timed: one `measurement`). Threads, runtime and memory: the config's resources.RULE.


rule synth_trees:
    input:
        synth_config,
    output:
        step="data/trees/{dataset}/step_{step}.npz",
        meta="data/trees/{dataset}/synth/step_{step}.json",
    wildcard_constraints:
        dataset=alternatives(SYNTH_DATASETS),
    params:
        seed=config["seed"],
        index=lambda wildcards: int(wildcards.step),
        scratch=lambda wildcards: f"data/trees/{wildcards.dataset}/synth/tmp-{wildcards.step}",
    threads: job("synth_trees")["threads"]
    resources:
        runtime=job("synth_trees")["runtime"],
        mem_mb=job("synth_trees")["mem_mb"],
    log:
        "reports/logs/synth_trees/{dataset}/step_{step}.log",
    benchmark:
        "reports/benchmarks/synth_trees/{dataset}/step_{step}.tsv"
    shell:
        "rm -rf {params.scratch} && harts trees synth --config {input} --seed {params.seed} --steps {params.index}"
        " --out {params.scratch} > {log} 2>&1"
        " && mv {params.scratch}/step_{wildcards.step}.npz {output.step}"
        " && mv {params.scratch}/synth.json {output.meta} && rmdir {params.scratch}"


rule ingest_trees:
    input:
        lambda wildcards: ingest_spec(wildcards.dataset)["input"],
    output:
        "data/trees/{dataset}/step_{step}.npz",
    wildcard_constraints:
        dataset=alternatives(INGEST_DATASETS),
        step="000",
    params:
        format=lambda wildcards: ingest_spec(wildcards.dataset)["format"],
        tokenizer=lambda wildcards: ingest_spec(wildcards.dataset)["tokenizer"],
    threads: job("ingest_trees")["threads"]
    resources:
        runtime=job("ingest_trees")["runtime"],
        mem_mb=job("ingest_trees")["mem_mb"],
    log:
        "reports/logs/ingest_trees/{dataset}/step_{step}.log",
    benchmark:
        "reports/benchmarks/ingest_trees/{dataset}/step_{step}.tsv"
    shell:
        "harts trees ingest --format {params.format} --tokenizer {params.tokenizer} {input} {output} > {log} 2>&1"


rule trees_record:
    input:
        "data/trees/{dataset}/step_{step}.npz",
    output:
        "reports/raw/trees/{dataset}/step_{step}.json",
    threads: job("trees_record")["threads"]
    resources:
        runtime=job("trees_record")["runtime"],
        mem_mb=job("trees_record")["mem_mb"],
        measurement=1,
    log:
        "reports/logs/trees_record/{dataset}/step_{step}.log",
    benchmark:
        "reports/benchmarks/trees_record/{dataset}/step_{step}.tsv"
    shell:
        "harts bench trees --data {input} --repeats 3 --out {output} > {log} 2>&1"
