"""The Snakemake pipeline: lint, a dry run of every target in every profile (threads, runtime and memory from
the config, GPUs from the parallel configuration and the profile's pool), config checks; slow: the SLURM
profile's sbatch calls rendered by the executor plugin against stand-in SLURM commands, and the `tiny` profile
end to end: every report built, PDFs parsed, CSV columns, a failed case's error row and its retry, W&B offline
runs with live history and artifacts, the rerun recipe of one record, reruns of edited inputs, and
`snakemake --report`.

Every run works in a temporary directory holding a copy of configs/ and a link to data/samples, with the
repository's Snakefile, so nothing under the repository's data/ or reports/ is touched.
"""

from __future__ import annotations

import base64
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
TARGETS = ["reports/speedup.pdf", "reports/speedup.csv", "reports/planning.pdf", "reports/planning.csv",
           "reports/fidelity.pdf", "reports/fidelity.csv", "reports/summary.md"]
# profile -> (its pipeline config, the GPU pool it gives the jobs: its `--resources gpu`)
PROFILES = {"default": ("configs/pipeline.yaml", 0), "tiny": ("configs/pipeline-tiny.yaml", 0),
            "h200": ("configs/pipeline-h200.yaml", 1), "h200x2": ("configs/pipeline-h200x2.yaml", 2),
            "paper": ("configs/pipeline-paper.yaml", 8), "slurm": ("configs/pipeline.yaml", 0)}


@pytest.fixture
def workdir(tmp_path):
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "samples").symlink_to(REPO / "data" / "samples")
    return tmp_path


def snakemake(cwd: Path, *args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """Snakemake on the repository's Snakefile in `cwd`, W&B in its default (offline) mode; `env` added to the
    environment."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    return subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env={**environ, **(env or {})})


def job_counts(output: str) -> dict[str, int]:
    table = output[output.index("Job stats:"):]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.MULTILINE)}


def test_lint_only_the_documented_exception(workdir):
    result = snakemake(workdir, "--lint")
    output = result.stdout + result.stderr
    messages = set(re.findall(r"^\s+\* (.+?):?$", output, re.MULTILINE))
    # Deliberate exception (docs/pipeline.md "Reruns and failures"): the jobs run in the environment harts is
    # installed in, not in a per-rule conda environment or container.
    assert messages == {"Specify a conda environment or container for each rule."}, output
    assert "Lints for snakefile" not in output


def job_resources(config: dict, rule: str) -> dict:
    """A rule's threads, runtime and mem_mb: the pipeline config's, else the schema's default."""
    schema = yaml.safe_load((REPO / "workflows/schemas/pipeline.schema.yaml").read_text(encoding="utf-8"))
    return config.get("resources", {}).get(rule) or schema["properties"]["resources"]["properties"][rule]["default"]


def jobs_of(output: str, rule: str) -> list[dict[str, str]]:
    """The dry run's printed jobs of `rule`: {"threads": ..., "resources": {name: value}}."""
    found = []
    for block in re.split(r"\n(?=\[[^\]]+\]\n)", output):
        if re.search(rf"^rule {rule}:$", block, re.MULTILINE):
            fields = dict(re.findall(r"^    (\w+): (.*)$", block, re.MULTILINE))
            found.append({"threads": fields.get("threads", "1"),
                          "resources": dict(re.findall(r"(\w+)=([^,]+)", fields.get("resources", "")))})
    return found


@pytest.mark.parametrize("profile", list(PROFILES), ids=list(PROFILES))
def test_dry_run_every_target(workdir, profile):
    from harts.parallel.config import load_parallel_config

    path, pool = PROFILES[profile]
    config = yaml.safe_load((REPO / path).read_text(encoding="utf-8"))
    model, parallel = config["speedup"]["models"][0], config["speedup"]["parallel"][-1]
    one_config = f"reports/raw/speedup/{model}/{parallel}.json"
    # --cores 64: threads are the config's, not capped at this machine's cores (a SLURM job's are never capped).
    result = snakemake(workdir, *TARGETS, one_config, "-n", "--cores", "64", "--workflow-profile", profile)
    assert result.returncode == 0, result.stderr[-3000:]
    counts = job_counts(result.stdout)
    s, f = config["speedup"], config["fidelity"]
    assert counts["speedup_step"] == len(s["models"]) * len(s["parallel"]) * len(s["planners"]) * len(s["steps"])
    assert counts["fidelity"] == len(f["models"]) * len(f["parallel"])
    assert counts["planning"] == len(config["planning"]["datasets"])
    assert counts["summary"] == counts["report_speedup"] == counts["report_planning"] == counts["report_fidelity"] == 1

    for rule in ("speedup_step", "fidelity", "planning", "synth_trees", "trees_record"):
        wanted = job_resources(config, rule)
        for job in jobs_of(result.stdout, rule):
            assert int(job["threads"]) == wanted["threads"], rule
            assert (int(job["resources"]["runtime"]), int(job["resources"]["mem_mb"])) == (
                wanted["runtime"], wanted["mem_mb"]), rule
    gpu = [int(job["resources"]["gpu"]) for job in jobs_of(result.stdout, "speedup_step")]
    worlds = [load_parallel_config(f"configs/parallel/{name}.yaml").world_size for name in s["parallel"]]
    assert sorted(gpu) == sorted(worlds * len(s["models"]) * len(s["planners"]) * len(s["steps"])
                                 if s["device"] == "cuda" else [0] * len(gpu))
    assert {int(job["resources"]["gpu_pool"]) for job in jobs_of(result.stdout, "speedup_step")} == {pool}

    alone = job_counts(snakemake(workdir, one_config, "-n", "--workflow-profile", profile).stdout)
    assert alone["speedup_step"] == len(s["planners"]) * len(s["steps"]) and alone["speedup_config"] == 1
    assert "fidelity" not in alone and "planning" not in alone


FAKE_SLURM = """#!{python}
# Stand-in SLURM command: records its call (argv and stdin) in $FAKE_SLURM_LOG and answers what the SLURM
# executor plugin asks; sbatch refuses every submission after recording it, so that nothing runs.
import json, os, sys
name = os.path.basename(sys.argv[0])
with open(os.environ["FAKE_SLURM_LOG"], "a") as log:
    log.write(json.dumps({{"command": name, "argv": sys.argv[1:],
                          "stdin": sys.stdin.read() if name == "sbatch" else ""}}) + "\\n")
if name == "sbatch":
    sys.exit("stand-in sbatch: submission recorded, not run")
print({{"sinfo": "cpu*\\ngpu", "scontrol": "MaxArraySize = 1001"}}.get(name, ""))
"""


@pytest.mark.slow  # two Snakemake runs through the SLURM plugin and a report: about 15 s (.ci/run runs it)
def test_slurm_job_scripts_for_the_speedup_target(workdir):
    """The SLURM profile through the real executor plugin: each job's sbatch call (partition, GPUs, CPUs, time,
    memory) and its job script (`--wrap`: Snakemake running that one job); the local rules run here."""
    from harts.tracking.records import make_record

    bin_dir = workdir / "fake-slurm"
    bin_dir.mkdir()
    stand_in = bin_dir / "stand_in.py"
    stand_in.write_text(FAKE_SLURM.format(python=sys.executable), encoding="utf-8")
    stand_in.chmod(0o755)
    for name in ("sbatch", "sinfo", "sacct", "squeue", "scontrol", "sacctmgr", "sshare", "srun"):
        (bin_dir / name).symlink_to(stand_in)
    # The step exists (newer than its configs), and one configuration's record too: its collecting rule is ready.
    step = workdir / "data" / "trees" / "paper-slice" / "step_000.npz"
    step.parent.mkdir(parents=True)
    step.touch()
    (step.parent / "synth").mkdir()
    (step.parent / "synth" / "step_000.json").touch()
    record = workdir / "reports/raw/speedup/h200/single/harts/step_000.json"
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps([make_record("speedup", {"model": "h200", "parallel": "single"}, error="x")]))
    log = workdir / "slurm-calls.jsonl"
    environ = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_SLURM_LOG": str(log),
               "WANDB_MODE": "disabled"}
    # The plugin's first status check waits 40 s by default; nothing is queued here.
    options = ("--workflow-profile", "slurm", "--slurm-init-seconds-before-status-checks", "1", "--configfile",
               "configs/pipeline-h200x2.yaml")
    result = snakemake(workdir, "reports/speedup.pdf", "reports/raw/speedup/h200/single.json",
                       "reports/raw/trees/paper-slice/step_000.json", *options, env=environ)
    assert result.returncode != 0 and "stand-in sbatch: submission recorded" in result.stdout + result.stderr
    calls = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    submitted = {}
    for call in calls:
        if call["command"] == "sbatch":
            argv = call["argv"]
            submitted[argv[argv.index("--comment") + 1]] = argv
    config = yaml.safe_load((workdir / "configs/pipeline-h200x2.yaml").read_text(encoding="utf-8"))
    speedup, record_job = job_resources(config, "speedup_step"), job_resources(config, "trees_record")
    worlds = {"dp2": 2, "tp2-sp": 2, "ep2": 2}
    assert set(submitted) == {f"rule_speedup_step_wildcards_h200_{p}_harts_000" for p in worlds} | {
        "rule_trees_record_wildcards_paper-slice_000"}, "the single record exists; local rules never go to sbatch"
    for parallel, world in worlds.items():
        argv = submitted[f"rule_speedup_step_wildcards_h200_{parallel}_harts_000"]
        flags = " ".join(argv[:-1])
        assert f"-p gpu -t {speedup['runtime']} --mem {speedup['mem_mb']}" in flags
        assert f"--cpus-per-task={speedup['threads']}" in flags and f"--gpus={world}" in flags
        assert "--nodes=1" in flags, "a job's ranks are spawned on its node"
        script = argv[-1]
        assert script.startswith("--wrap=") and "--executor slurm-jobstep" in script
        assert f"--target-jobs 'speedup_step:model=h200,parallel={parallel},planner=harts,step=000'" in script
        assert "--configfiles" in script and "pipeline-h200x2.yaml" in script
    flags = " ".join(submitted["rule_trees_record_wildcards_paper-slice_000"][:-1])
    assert f"-p cpu -t {record_job['runtime']} --mem {record_job['mem_mb']} --ntasks=1" in flags
    assert f"--cpus-per-task={record_job['threads']}" in flags and "--gpus" not in flags
    assert (workdir / "reports/raw/speedup/h200/single.json").is_file(), "speedup_config ran here (a local rule)"

    # Every record there: the collecting and report rules run here, nothing is submitted.
    for parallel in worlds:
        path = workdir / f"reports/raw/speedup/h200/{parallel}/harts/step_000.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps([make_record("speedup", {"model": "h200", "parallel": parallel}, error="x")]))
    log.unlink()
    result = snakemake(workdir, "reports/speedup.pdf", *options, env=environ)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not any(json.loads(line)["command"] == "sbatch" for line in log.read_text(encoding="utf-8").splitlines())
    assert (workdir / "reports/speedup.pdf").is_file()


@pytest.mark.parametrize("profile", list(PROFILES), ids=list(PROFILES))
def test_dry_run_rl_report(workdir, profile):
    """reports/rl.pdf: one rl_seed job per seed of the pipeline config's RL config (CUDA jobs ask for a GPU);
    not part of `all`."""
    from harts.rl.config import load_rl_config

    name = yaml.safe_load((REPO / PROFILES[profile][0]).read_text(encoding="utf-8")).get("rl", {}).get("config", "cpu")
    rl = load_rl_config(REPO / "configs" / "rl" / f"{name}.yaml")
    result = snakemake(workdir, "-n", "--workflow-profile", profile, "reports/rl.pdf")
    assert result.returncode == 0, result.stderr[-3000:]
    counts = job_counts(result.stdout)
    assert counts["rl_seed"] == len(rl.seeds) and counts["report_rl_default"] == 1
    for seed in rl.seeds:
        assert f"reports/raw/rl/{name}/seed_{seed:03d}.json" in result.stdout
    assert ("gpu=1" in result.stdout) == (rl.device == "cuda")
    # A changed model YAML reruns the seeds: it is an input of each, beside the RL config.
    inputs = [re.search(r"^    input: (.*)$", block, re.MULTILINE).group(1).split(", ")
              for block in re.split(r"\n(?=\[[^\]]+\]\n)", result.stdout) if re.search(r"^rule rl_seed:$", block, re.MULTILINE)]
    assert inputs == [[f"configs/rl/{name}.yaml", f"configs/models/{rl.model}.yaml"]] * len(rl.seeds), inputs
    assert "rl_seed" not in job_counts(snakemake(workdir, "-n", "--workflow-profile", profile).stdout)


BAD_CONFIGS = {
    "unknown-key": ({"speedup": {"warmup": 3}}, "Additional properties are not allowed ('warmup' was unexpected)"),
    "unknown-planner": ({"planning": {"planners": ["harts", "magic"]}}, "'magic' is not one of"),
    "missing-model": ({"speedup": {"models": ["nope"]}}, "no file configs/models/nope.yaml"),
    "missing-parallel": ({"fidelity": {"parallel": ["dp16"]}}, "no file configs/parallel/dp16.yaml"),
    "unknown-dataset": ({"fidelity": {"dataset": "elsewhere"}}, "fidelity.dataset 'elsewhere' is not in datasets"),
    "missing-synth-config": ({"datasets": {"tiny": {"synth": "configs/trees/nope.yaml"}}},
                             "datasets.tiny.synth: no file or directory configs/trees/nope.yaml"),
    "missing-ingest-input": ({"datasets": {"swe-agent": {"ingest": {"input": "data/nope", "format": "messages",
                                                                     "tokenizer": "byte"}}}},
                             "datasets.swe-agent.ingest.input: no file or directory data/nope"),
    "resources-missing-field": ({"resources": {"planning": {"threads": 2}}}, "'runtime' is a required property"),
    "resources-zero-threads": ({"resources": {"speedup_step": {"threads": 0, "runtime": 5, "mem_mb": 100}}},
                               "0 is less than the minimum of 1"),
    "missing-rl-config": ({"rl": {"config": "nope"}}, "rl.config: no file configs/rl/nope.yaml"),
    "unknown-attention-backend": ({"speedup": {"attention_backend": "fa9"}}, "'fa9' is not one of"),
    "unknown-experts-backend": ({"speedup": {"experts_backend": "fused"}}, "'fused' is not one of"),
    "recompute-blocks-without-recompute": ({"speedup": {"recompute": False, "recompute_blocks": 2}},
                                           "pipeline config: speedup: --recompute-blocks needs --recompute"),
    "compact-blocks-without-recompute": ({"speedup": {"recompute": False, "compact_recompute_blocks": 2}},
                                         "pipeline config: speedup: --compact-recompute-blocks needs --recompute"),
    "auto-blocks-on-cpu": ({"speedup": {"recompute": True, "recompute_blocks": "auto"}},
                           "--recompute-blocks auto searches one GPU's memory: it needs --device cuda"),
    "auto-compact-blocks-in-parallel": ({"speedup": {"recompute": True, "compact_recompute_blocks": "auto",
                                                     "device": "cuda", "parallel": ["single", "dp2"]}},
                                        "--compact-recompute-blocks auto searches one GPU's memory"),
    "within-baseline-compact-blocks-on-cpu": (
        {"speedup": {"recompute": True, "compact_recompute_blocks": "within-baseline"}},
        "--compact-recompute-blocks within-baseline searches one GPU's memory: it needs --device cuda"),
    "within-baseline-for-the-baseline": ({"speedup": {"recompute": True, "recompute_blocks": "within-baseline"}},
                                         "'within-baseline' does not match '^auto$'"),
    "unknown-compact-blocks-word": ({"speedup": {"recompute": True, "compact_recompute_blocks": "most"}},
                                    "'most' does not match '^(auto|within-baseline)$'"),
    "by-rows-without-blocks": ({"speedup": {"recompute": True, "recompute_by_rows": True}},
                               "--recompute-by-rows scales the blocks --recompute-blocks keeps"),
    "keep-attention-without-recompute": ({"speedup": {"recompute": False, "keep_attention": True}},
                                         "pipeline config: speedup: --keep-attention needs --recompute"),
    "keep-attention-with-flex": ({"speedup": {"recompute": True, "keep_attention": True,
                                              "attention_backend": "flex"}},
                                   "pipeline config: speedup: --keep-attention needs an attention backend among"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS), ids=list(BAD_CONFIGS))
def test_bad_config_fails_with_a_clear_message(workdir, case):
    change, message = BAD_CONFIGS[case]
    config = yaml.safe_load((REPO / "configs" / "pipeline-tiny.yaml").read_text(encoding="utf-8"))
    for section, values in change.items():
        config.setdefault(section, {}).update(values)
    (workdir / "bad.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    result = snakemake(workdir, "-n", "--configfile", "bad.yaml")
    assert result.returncode != 0
    assert message in result.stdout + result.stderr


def test_a_templated_config_file_is_refused_after_snakemake_evaluated_it(workdir):
    """docs/pipeline.md's statement ("Config files and profiles are code to Snakemake"), shown: Snakemake
    evaluates a `__use_yte__` config file's expressions while it reads
    `--configfile`, before the Snakefile runs (here they create a file, under `-n`); the Snakefile then refuses the
    file, so the run stops and no job is planned."""
    config = (REPO / "configs" / "pipeline-tiny.yaml").read_text(encoding="utf-8")
    marker = workdir / "evaluated"
    (workdir / "templated.yaml").write_text(
        "__use_yte__: true\n" + config + f"\n?if open({str(marker)!r}, 'w').close() is None:\n  extra: 1\n",
        encoding="utf-8")
    result = snakemake(workdir, "-n", "--workflow-profile", "tiny", "--configfile", "templated.yaml")
    assert marker.exists()  # code in a config file runs: config files are code to Snakemake
    assert result.returncode != 0
    assert "templated.yaml: a templated config (__use_yte__): the pipeline's config files are data" in (
        result.stdout + result.stderr)
    assert "Job stats:" not in result.stdout and not (workdir / "reports").exists()


def test_an_alias_bomb_config_file_is_refused_in_a_moment(workdir):
    from tests.test_config import BOMB

    (workdir / "bomb.yaml").write_text((REPO / "configs" / "pipeline-tiny.yaml").read_text(encoding="utf-8")
                                       + "extra:\n" + "".join(f"  {line}\n" for line in BOMB.splitlines()))
    start = time.perf_counter()
    result = snakemake(workdir, "-n", "--workflow-profile", "tiny", "--configfile", "bomb.yaml")
    assert result.returncode != 0 and "bomb.yaml: invalid YAML (line " in result.stdout + result.stderr
    assert "YAML aliases (*a) are not accepted" in result.stdout + result.stderr
    assert time.perf_counter() - start < 30  # Snakemake's own start is most of it


def test_nested_config_values_on_the_command_line(workdir):
    # Snakemake hands nested --config values over as strings ('512'); they must reach the jobs as numbers.
    target = "reports/raw/speedup/tiny/single.json"
    result = snakemake(workdir, target, "-n", "-p", "--workflow-profile", "tiny",
                       "--config", "speedup={capacity: 300, recompute: true, repeats: 2, steps: [1]}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--capacity 300" in result.stdout
    assert "--recompute --kda-calls separate --gdn-kernel gdn --logprob-grad-precision fp32 --repeats 2" in result.stdout
    assert "step_001.json" in result.stdout and "step_000.json" not in result.stdout
    assert "--logprob-grad-precision fp32" in result.stdout
    assert "--attention-backend" not in result.stdout and "--recompute-blocks" not in result.stdout
    assert "--experts-backend" not in result.stdout and "--keep-attention" not in result.stdout
    assert "--compact-recompute-blocks" not in result.stdout and "--recompute-by-rows" not in result.stdout
    assert "--logprob-chunk-rows" not in result.stdout


def test_speedup_execution_settings_reach_the_jobs(workdir):
    """The pipeline's opt-in execution settings (every knob key of the section: harts.bench.speedup.cli's
    PIPELINE_KEYS) become the bench's flags of the same names (on CUDA: varlen is refused on the CPU)."""
    result = snakemake(workdir, "reports/raw/speedup/tiny/single.json", "-n", "-p", "--workflow-profile", "tiny",
                       "--config", "speedup={device: cuda, dtype: bf16, recompute: true, attention_backend: varlen, "
                       "logprob_grad_precision: input, recompute_blocks: 2, experts_backend: lean, keep_attention: true, "
                       "compact_recompute_blocks: 1, recompute_by_rows: true, logprob_chunk_rows: 2048, "
                       "kda_backend: fla, gdn_kernel: kda, keep_kda_intermediates: true, "
                       "mtp_loss_scaling_factor: 0.25}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("--recompute --recompute-blocks 2 --recompute-by-rows --keep-attention --keep-kda-intermediates "
            "--attention-backend varlen --kda-backend fla --kda-calls separate --gdn-kernel kda --experts-backend lean "
            "--logprob-chunk-rows 2048 --logprob-grad-precision input --mtp-loss-scaling-factor 0.25 "
            "--compact-recompute-blocks 1"
            ) in result.stdout


def test_auto_recompute_blocks_reach_the_gpu_jobs(workdir):
    result = snakemake(workdir, "reports/raw/speedup/tiny/single.json", "-n", "-p", "--workflow-profile", "tiny",
                       "--config", "speedup={device: cuda, dtype: bf16, parallel: [single], recompute: true, "
                       "recompute_blocks: auto, compact_recompute_blocks: within-baseline}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--recompute-blocks auto" in result.stdout and "--device cuda" in result.stdout
    assert "--compact-recompute-blocks within-baseline" in result.stdout


def _pdf_text(path: Path) -> tuple[int, str]:
    from pypdf import PdfReader

    reader = PdfReader(str(path))
    return len(reader.pages), "\n".join(page.extract_text() or "" for page in reader.pages)


def _columns(path: Path) -> list[str]:
    with open(path, newline="", encoding="utf-8") as handle:
        return next(csv.reader(handle))


def _failed_lines(workdir: Path, record: str) -> list[str]:
    path = workdir / Path(record).with_suffix(".failed")
    return path.read_text(encoding="utf-8").splitlines() if path.exists() else []


def _report_contents(html: str) -> tuple[dict, dict[str, list[str]]]:
    """What a `snakemake --report` HTML file embeds: its results ({path: {..., "data_uri"}}) and categories
    ({category: [path, ...]}, over the subcategories)."""
    results = json.loads(re.search(r"var results = (\{.*?\});\n", html, re.DOTALL).group(1))
    categories = json.loads(re.search(r"var categories = (\{.*?\});\n", html, re.DOTALL).group(1))
    return results, {name: [p for files in sub.values() for p in files] for name, sub in categories.items()}


def _speedup_steps(output: str) -> list[str]:
    """The records of the dry run's speedup_step jobs."""
    return re.findall(r"^rule speedup_step:\n(?:    .*\n)*?    output: (\S+)", output, re.MULTILINE)


@pytest.mark.slow
def test_tiny_profile_end_to_end(workdir):
    from harts.report.fidelity import FIDELITY_COLUMNS
    from harts.report.planning import PLANNING_COLUMNS
    from harts.report.speedup import SPEEDUP_COLUMNS
    from harts.tracking.records import git_state
    from tests.tracking.test_wandb_log import read_offline_run

    # One job that fails (a model config with an unknown key) beside the pipeline: the others finish.
    model = yaml.safe_load((workdir / "configs" / "models" / "tiny.yaml").read_text(encoding="utf-8"))
    (workdir / "configs" / "models" / "broken.yaml").write_text(
        yaml.safe_dump({**model, "name": "broken", "attention_sinks": 4}), encoding="utf-8")
    broken = "reports/raw/fidelity/broken/single.json"
    # One case that fails inside its measurement (8 pipeline stages of a 4-layer model): an error row.
    (workdir / "configs" / "parallel" / "pp8.yaml").write_text("name: pp8\npp: 8\n", encoding="utf-8")
    pipeline = workdir / "configs" / "pipeline-tiny.yaml"
    shipped = pipeline.read_text(encoding="utf-8")
    config = yaml.safe_load(shipped)
    config["speedup"]["parallel"].append("pp8")
    pipeline.write_text(yaml.safe_dump(config), encoding="utf-8")
    failing = "reports/raw/speedup/tiny/pp8/harts/step_000.json"

    result = snakemake(workdir, "--workflow-profile", "tiny", "all", broken, timeout=900)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "Error in rule fidelity" in output
    assert not (workdir / broken).exists()
    assert "attention_sinks" in (workdir / "reports/logs/fidelity/broken/single.log").read_text(encoding="utf-8")

    reports = workdir / "reports"
    for name, pages, expected in (("speedup", 4, ["5.62x", "4.81x", "tiny / single / harts", "tiny / dp2 / harts"]),
                                  ("planning", 2, ["Planning quality: HARTS vs OR-Tools", "77,581,958"]),
                                  ("fidelity", 5, ["Replay ablation by handoff depth", "split-rerun", "tiny / dp2",
                                                   "Where a path departs from the baseline"])):
        count, text = _pdf_text(reports / f"{name}.pdf")
        assert count == pages, name
        for snippet in expected:
            assert snippet in text, (name, snippet)
    assert _columns(reports / "speedup.csv") == SPEEDUP_COLUMNS
    assert _columns(reports / "planning.csv") == PLANNING_COLUMNS
    assert _columns(reports / "fidelity.csv") == FIDELITY_COLUMNS
    with open(reports / "speedup.csv", newline="", encoding="utf-8") as handle:
        (row,) = [row for row in csv.DictReader(handle) if row["parallel"] == "pp8"]
    assert row["fbg_speedup"] == "error" and "num_layers (4) < pp (8)" in row["error"]
    assert len(_failed_lines(workdir, failing)) == 1
    summary = (reports / "summary.md").read_text(encoding="utf-8")
    for section in ("## Provenance", "## Datasets", "## Speedup", "## Planning quality", "## Fidelity",
                    "## Pipeline jobs", "## Pipeline config", git_state()["sha"], "data/trees/swe-agent/step_000.npz"):
        assert section in summary, section

    # W&B: a run per record (trees 3, planning 2 steps x 2 planners, speedup 3, fidelity 2) and per report (3),
    # each record's run with its live rows (warm-ups, then the timed repeat) and the record as an artifact.
    runs = {}
    for run_dir in (reports / "wandb" / "wandb").glob("offline-run-*"):
        run = read_offline_run(run_dir)
        runs[run["run"].display_name] = run
    assert len(runs) == 15, sorted(runs)
    single = runs["speedup/tiny/single/harts/step0"]
    assert [row["repeat"] for row in single["history"]] == [0, 0, 1, 1]
    assert single["artifacts"]["speedup-tiny-single-harts-step0"][0] == "benchmark-record"
    assert runs["speedup/tiny/pp8/harts/step0"]["summary"]["failed"] == 1
    assert sorted(runs["report/speedup"]["artifacts"]["report-speedup"][1]) == ["speedup.csv", "speedup.pdf"]

    # The next run retries the failed case, and a case with a failed attempt recorded since its last run (planted
    # here), each with what reads its record, and nothing else.
    retried = "reports/raw/speedup/tiny/single/harts/step_000.json"
    (workdir / Path(retried).with_suffix(".failed")).write_text("2026-01-01T00:00:00Z error rows in it\n")
    dry = snakemake(workdir, "-n", "--workflow-profile", "tiny").stdout
    assert sorted(_speedup_steps(dry)) == sorted([failing, retried]) and "Params have changed" in dry
    assert job_counts(dry) == {"speedup_step": 2, "speedup_config": 2, "report_speedup": 1, "summary": 1, "all": 1,
                               "total": 7}
    quiet = {"WANDB_MODE": "disabled"}  # W&B was checked above; later runs skip its start-up time
    assert snakemake(workdir, "--workflow-profile", "tiny", timeout=300, env=quiet).returncode == 0
    assert len(_failed_lines(workdir, failing)) == 2 and len(_failed_lines(workdir, retried)) == 1
    assert _speedup_steps(snakemake(workdir, "-n", "--workflow-profile", "tiny").stdout) == [failing], (
        "a success after a failure is done; the failing case is retried again")

    # The rerun recipe of one record (docs/pipeline.md "Reruns and failures"): --forcerun names it; it and what
    # reads it are redone, no other record.
    pipeline.write_text(shipped, encoding="utf-8")  # pp8 leaves the config
    one = "reports/raw/speedup/tiny/dp2/harts/step_000.json"
    dry = snakemake(workdir, "-n", "--workflow-profile", "tiny", "--forcerun", one).stdout
    assert _speedup_steps(dry) == [one]
    assert job_counts(dry) == {"speedup_step": 1, "speedup_config": 1, "report_speedup": 1, "summary": 1, "all": 1,
                               "total": 5}
    records = sorted((reports / "raw").rglob("*.json"))
    before = {p: p.stat().st_mtime_ns for p in records}
    assert snakemake(workdir, "--workflow-profile", "tiny", "--forcerun", one, timeout=300, env=quiet).returncode == 0
    changed = {str(p.relative_to(workdir)) for p in records if p.stat().st_mtime_ns != before[p]}
    assert changed == {one, "reports/raw/speedup/tiny/dp2.json"}

    # Nothing to redo (a touched but unchanged input included); an edited parallel config reruns only its own
    # jobs and what reads their records.
    dp2 = workdir / "configs" / "parallel" / "dp2.yaml"
    os.utime(dp2)
    assert "Nothing to be done" in snakemake(workdir, "-n", "--workflow-profile", "tiny").stdout
    before = {p: p.stat().st_mtime_ns for p in records}
    dp2.write_text(dp2.read_text(encoding="utf-8") + "# edited\n", encoding="utf-8")
    counts = job_counts(snakemake(workdir, "-n", "--workflow-profile", "tiny").stdout)
    assert counts["speedup_step"] == 1 and counts["fidelity"] == 1 and counts["speedup_config"] == 1
    assert "planning" not in counts and "synth_trees" not in counts and "trees_record" not in counts
    assert {p: p.stat().st_mtime_ns for p in records} == before

    # snakemake --report: one HTML file with the PDFs, CSVs and summary under their categories.
    dp2.write_text(dp2.read_text(encoding="utf-8").replace("# edited\n", ""), encoding="utf-8")
    result = snakemake(workdir, "--workflow-profile", "tiny", "--report", "reports/report.html")
    assert result.returncode == 0, result.stderr[-3000:]
    results, categories = _report_contents((reports / "report.html").read_text(encoding="utf-8"))
    assert {category: sorted(files) for category, files in categories.items()} == {
        "Speedup": ["reports/speedup.csv", "reports/speedup.pdf"],
        "Planning": ["reports/planning.csv", "reports/planning.pdf"],
        "Fidelity": ["reports/fidelity.csv", "reports/fidelity.pdf"], "Summary": ["reports/summary.md"]}
    assert sorted(results) == sorted(path for files in categories.values() for path in files)
    for path, result in results.items():
        assert base64.b64decode(result["data_uri"].split("base64,", 1)[1]) == (workdir / path).read_bytes(), path


def _gdn_pipeline(workdir: Path) -> Path:
    """The tiny profile's config with the Gated DeltaNet family's tiny model beside `tiny` (speedup, fidelity) and
    its RL config."""
    config = yaml.safe_load((REPO / "configs" / "pipeline-tiny.yaml").read_text(encoding="utf-8"))
    config["speedup"]["models"], config["fidelity"]["models"] = ["tiny", "gdn-tiny"], ["tiny", "gdn-tiny"]
    config["rl"]["config"] = "gdn-tiny"
    path = workdir / "gdn.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_dry_run_takes_the_gdn_models(workdir):
    """Model names are configs/models files: gdn-tiny's speedup, fidelity and RL jobs are planned beside tiny's."""
    config = _gdn_pipeline(workdir)
    result = snakemake(workdir, *TARGETS, "reports/rl.pdf", "-n", "-p", "--workflow-profile", "tiny",
                       "--configfile", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    counts = job_counts(result.stdout)
    assert counts["speedup_step"] == 2 * 2 and counts["fidelity"] == 2 * 2, counts
    assert "--model configs/models/gdn-tiny.yaml" in result.stdout or "--model gdn-tiny" in result.stdout
    assert "configs/rl/gdn-tiny.yaml" in result.stdout


@pytest.mark.slow  # one speedup configuration of gdn-tiny through the pipeline: about 30 s
def test_gdn_tiny_speedup_record_through_the_pipeline(workdir):
    config = _gdn_pipeline(workdir)
    target = "reports/raw/speedup/gdn-tiny/single.json"
    result = snakemake(workdir, target, "--workflow-profile", "tiny", "--configfile", str(config), "--cores", "2",
                       timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (record,) = json.loads((workdir / target).read_text())
    assert record["config"]["model"] == "gdn-tiny" and record["results"]["compression"] > 1
