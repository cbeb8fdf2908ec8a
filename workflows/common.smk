# Helpers only (no rules): config lookups, the files each target needs, and checks of the names in the
# config that the JSON schema cannot make (model and parallel configuration files, dataset references).

import os
import re
import sys
from pathlib import Path

from harts.bench.speedup.cli import check_pipeline_section, pipeline_flags
from harts.config import load_yaml_mapping
from harts.parallel.config import load_parallel_config
from harts.rl.config import load_rl_config

# Jobs run `harts` of the environment Snakemake runs in (where harts is installed), also when Snakemake
# was started as .venv/bin/snakemake without activating the environment.
os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
NAME = r"[A-Za-z0-9_-]+"


def alternatives(names):
    """A regex matching exactly these names (or nothing)."""
    return "|".join(re.escape(n) for n in sorted(names)) or "(?!x)x"


SYNTH_DATASETS = [name for name, spec in config["datasets"].items() if "synth" in spec]
INGEST_DATASETS = [name for name, spec in config["datasets"].items() if "ingest" in spec]


def _check_config():
    datasets = config["datasets"]
    for name, spec in datasets.items():
        source = spec["synth"] if "synth" in spec else spec["ingest"]["input"]
        if not Path(source).exists():
            kind = "synth" if "synth" in spec else "ingest.input"
            raise ValueError(f"pipeline config: datasets.{name}.{kind}: no file or directory {source}")
    for section in ("speedup", "fidelity"):
        if config[section]["dataset"] not in datasets:
            raise ValueError(f"pipeline config: {section}.dataset {config[section]['dataset']!r} is not in datasets")
        for model in config[section]["models"]:
            path = Path(f"configs/models/{model}.yaml")
            if not path.is_file():
                raise ValueError(f"pipeline config: {section}.models: no file {path}")
            if load_yaml_mapping(path).get("name") != model:
                raise ValueError(f"{path}: its `name` must be {model!r} (records are labelled by it)")
        for name in config[section]["parallel"]:
            path = Path(f"configs/parallel/{name}.yaml")
            if not path.is_file():
                raise ValueError(f"pipeline config: {section}.parallel: no file {path}")
            if load_parallel_config(str(path)).name != name:
                raise ValueError(f"{path}: its `name` must be {name!r} (records are labelled by it)")
    rl = Path(f"configs/rl/{config['rl']['config']}.yaml")
    if not rl.is_file():
        raise ValueError(f"pipeline config: rl.config: no file {rl}")
    if load_rl_config(rl).name != config["rl"]["config"]:
        raise ValueError(f"{rl}: its `name` must be {config['rl']['config']!r} (records are labelled by it)")
    check_pipeline_section(config["speedup"])
    for name in config["planning"]["datasets"]:
        if name not in SYNTH_DATASETS:
            raise ValueError(f"pipeline config: planning.datasets: {name!r} is not a generated (synth) dataset")
    for name in INGEST_DATASETS:
        for section, steps in (("speedup", config["speedup"]["steps"]), ("fidelity", [config["fidelity"]["step"]])):
            if config[section]["dataset"] == name and steps != [0]:
                raise ValueError(f"pipeline config: {section}: an ingested dataset ({name}) has step 0 only")


_check_config()


def job(rule):
    """The pipeline config's `resources.RULE`: threads, runtime (minutes) and mem_mb of the rule's jobs (the
    SLURM profile asks for them; locally threads are capped at --cores)."""
    return config["resources"][rule]


# The host's GPUs that a local GPU profile gives the pipeline (`--resources gpu=M`): GPU jobs run their command
# through `python -m harts.workflow.devices --take {resources.gpu} --pool {resources.gpu_pool}`, which gives each its
# own devices of this pool (CUDA_VISIBLE_DEVICES). 0 without that resource (the CPU and SLURM profiles: a SLURM
# job's allocation holds its own devices), and the wrapper then runs the command unchanged. A resource, not a
# param, so that changing it reruns nothing. (Snakemake >= 9.27: an unset resource reads as value None.)
GPU_POOL = workflow.global_resources.get("gpu").value or 0


# Exit status 1 of a `harts bench` command: its records are written, some with an `error` field. The shell command
# of a measurement ends in `|| { test $? -eq 1 && echo "<UTC time> error rows in RECORD" >> FAILED; }`, so that
# the job succeeds (the reports show the error rows) and a line goes to the record's `.failed` file, whose
# line count is the job's param `failed_attempts`: it has changed at the next run, which therefore retries the
# case (Snakemake reruns a job whose params changed), and it stays as it was after a success. Any other failure
# fails the job.
def failures_file(record):
    return str(Path(record).with_suffix(".failed"))


def failed_attempts(record):
    """The failed attempts so far of the measurement writing `record` (lines of its `.failed` file). Its params
    take the record's path from the wildcards: Snakemake does not track a param computed from `output`."""
    path = Path(failures_file(record))
    return len(path.read_text(encoding="utf-8").splitlines()) if path.exists() else 0


def speedup_record(wildcards):
    return f"reports/raw/speedup/{wildcards.model}/{wildcards.parallel}/{wildcards.planner}/step_{wildcards.step}.json"


def fidelity_record(wildcards):
    return f"reports/raw/fidelity/{wildcards.model}/{wildcards.parallel}.json"


def planning_record(wildcards):
    return f"reports/raw/planning/{wildcards.dataset}.json"


def synth_config(wildcards):
    return config["datasets"][wildcards.dataset]["synth"]


def ingest_spec(dataset):
    return config["datasets"][dataset]["ingest"]


def step_file(dataset, step):
    return f"data/trees/{dataset}/step_{int(step):03d}.npz"


def world_size(parallel):
    return load_parallel_config(f"configs/parallel/{parallel}.yaml").world_size


def parallel_flag(wildcards):
    """`single` runs in the bench's own process (no --parallel); others spawn the config's ranks."""
    return "" if wildcards.parallel == "single" else f"--parallel configs/parallel/{wildcards.parallel}.yaml"


def gpus(section, wildcards):
    return world_size(wildcards.parallel) if config[section]["device"] == "cuda" else 0


def speedup_step_records(model, parallel):
    s = config["speedup"]
    return [f"reports/raw/speedup/{model}/{parallel}/{planner}/step_{step:03d}.json"
            for planner in s["planners"] for step in s["steps"]]


def speedup_records():
    s = config["speedup"]
    return [f"reports/raw/speedup/{model}/{parallel}.json" for model in s["models"] for parallel in s["parallel"]]


def fidelity_records():
    f = config["fidelity"]
    return [f"reports/raw/fidelity/{model}/{parallel}.json" for model in f["models"] for parallel in f["parallel"]]


def planning_records():
    return [f"reports/raw/planning/{dataset}.json" for dataset in config["planning"]["datasets"]]


def used_steps():
    """(dataset, step) of every step some measurement reads, and step 0 of every ingested dataset."""
    used = {(name, 0) for name in INGEST_DATASETS}
    used |= {(config["speedup"]["dataset"], step) for step in config["speedup"]["steps"]}
    used.add((config["fidelity"]["dataset"], config["fidelity"]["step"]))
    used |= {(dataset, step) for dataset in config["planning"]["datasets"] for step in config["planning"]["steps"]}
    return sorted(used)


def trees_records():
    return [f"reports/raw/trees/{dataset}/step_{step:03d}.json" for dataset, step in used_steps()]


def rl_config(name):
    return load_rl_config(f"configs/rl/{name}.yaml")


def rl_model_file(name):
    """The model YAML that configs/rl/NAME.yaml names: configs/models/MODEL.yaml, or its own YAML path."""
    model = rl_config(name).model
    return model if Path(model).suffix in (".yaml", ".yml") else f"configs/models/{model}.yaml"


def rl_records(name):
    """The records of every seed of configs/rl/NAME.yaml, one file per seed."""
    return [f"reports/raw/rl/{name}/seed_{seed:03d}.json" for seed in rl_config(name).seeds]


def comma(values):
    return ",".join(str(v) for v in values)
