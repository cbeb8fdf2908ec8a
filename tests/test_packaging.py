"""A built wheel holds every module and the shipped configs, and runs from outside the repository.

The wheel is built from a copy of the sources (so that the checkout gets no build/ folder) without
build isolation (setuptools from the venv, no network) and installed with `pip install --target`
into a temporary folder; commands run with that folder first on PYTHONPATH (torch and the other
dependencies come from the venv) and a working directory outside the repository, where the
repository's configs/ cannot be reached by a relative path. The venv's editable install of this
checkout can also answer `import harts.configs` (its finder maps the name to configs/), so every
check also asserts that harts and its configs were imported from the installed wheel. A slow test installs the
wheel with its core dependencies alone into an empty venv (versions from .ci/requirements.lock) and runs the library
and `harts rl --config tiny` from an empty directory.
"""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STEP = REPO / "data/samples/tiny-step.jsonl.gz"
SHIPPED_FOLDERS = ("models", "parallel", "rl", "trees")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, Path]:
    """The wheel built from a copy of the sources, and the folder it is installed into."""
    root = tmp_path_factory.mktemp("packaging")
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for name in ("harts", "configs"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(root / "dist"),
                    str(source)], check=True, capture_output=True, text=True)
    (wheel,) = (root / "dist").glob("harts-*.whl")
    target = root / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, text=True)
    workdir = root / "elsewhere"
    workdir.mkdir()
    return {"wheel": wheel, "target": target, "workdir": workdir}


def _run_installed(installed, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(installed["target"]), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=installed["workdir"], env=env, capture_output=True,
                          text=True, timeout=300)


def test_wheel_holds_every_module_and_the_shipped_configs(installed):
    with zipfile.ZipFile(installed["wheel"]) as wheel:
        names = set(wheel.namelist())
    modules = {path.relative_to(REPO).as_posix() for path in (REPO / "harts").rglob("*.py")}
    assert modules <= names, sorted(modules - names)
    # The PEP 561 marker: type checkers of a user's code read harts' annotations.
    assert "harts/py.typed" in names
    # configs/pipeline*.yaml are the Snakemake workflow's: repository only.
    configs = {f"harts/configs/{path.relative_to(REPO / 'configs').as_posix()}"
               for folder in SHIPPED_FOLDERS for path in (REPO / "configs" / folder).glob("*.yaml")}
    assert configs and {name for name in names if name.startswith("harts/configs/")} == configs | {
        "harts/configs/__init__.py"}


def test_installed_resolver_lists_the_shipped_names(installed):
    code = (
        "import json, harts, harts.configs\n"
        "from harts.config import shipped_configs\n"
        "print(json.dumps({'harts': harts.__file__, 'configs': harts.configs.__file__,\n"
        f"                  'names': {{f: sorted(shipped_configs(f)) for f in {SHIPPED_FOLDERS!r}}}}}))\n"
    )
    result = _run_installed(installed, "-c", code)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout)
    target = str(installed["target"])
    assert out["harts"].startswith(target) and out["configs"].startswith(target), out
    for folder in SHIPPED_FOLDERS:
        assert out["names"][folder] == sorted(p.stem for p in (REPO / "configs" / folder).glob("*.yaml")), folder


def test_installed_cli_resolves_a_model_name(installed):
    result = _run_installed(installed, "-m", "harts", "verify", "--model", "tiny", "--trees", str(STEP),
                            "--capacity", "1024", "--on-policy", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["semantic_tokens"] == 1971 and report["compact_tokens"] == 920
    assert report["logit_cosine_min"] >= 0.99999
    result = _run_installed(installed, "-m", "harts", "verify", "--model", "nope", "--trees", str(STEP))
    assert result.returncode == 2
    known = ("bailing-tiny, cpu-small, gdn-h200, gdn-tiny, h200, kimi-tiny, ling3-tiny, ling3-tiny-8l, ling3-tiny-mtp, "
             "ling3-tiny-shape, tiny")
    assert f"unknown model 'nope' (known: {known};" in result.stderr


def _locked_versions() -> str:
    """.ci/requirements.lock as pip constraints (name==version; constraints take no hashes)."""
    lines = (REPO / ".ci/requirements.lock").read_text().splitlines()
    return "\n".join(line.split(" ")[0] for line in lines if line and not line.startswith("#")) + "\n"


@pytest.mark.slow
def test_wheel_in_an_empty_venv_has_the_lean_core_and_runs_rl_by_config_name(installed, tmp_path):
    """`pip install harts` pulls the core alone (no pipeline, W&B, OR-Tools, plots or test references), and the
    shipped RL config runs by name from a directory with nothing in it."""
    import torch

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(_locked_versions())
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "-c", str(constraints)]
    # torch first, the build this suite runs on (the lock's CPU build on CI), so that no other build is pulled.
    subprocess.run([*pip, f"torch=={torch.__version__}"], check=True, capture_output=True, text=True, timeout=900)
    subprocess.run([*pip, str(installed["wheel"])], check=True, capture_output=True, text=True, timeout=900)
    listed = subprocess.run([python, "-m", "pip", "list", "--format=json", "--disable-pip-version-check"],
                            check=True, capture_output=True, text=True)
    names = {package["name"].lower() for package in json.loads(listed.stdout)}
    for heavy in ("snakemake", "wandb", "ortools", "matplotlib", "pandas", "pyarrow", "megatron-core",
                  "transformers", "pytest"):
        assert heavy not in names, heavy
    assert {"harts", "torch", "numpy", "pyyaml", "tqdm", "safetensors", "tokenizers", "fla-core"} <= names
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    code = ("import sys\nfrom harts import api\n"
            "print(sorted(m for m in ('triton', 'wandb', 'matplotlib') if m in sys.modules))")
    imported = subprocess.run([python, "-c", code], cwd=empty, env=env, capture_output=True, text=True, timeout=300)
    assert imported.returncode == 0 and imported.stdout.strip() == "[]", imported.stderr[-2000:]
    harts = str(venv / "bin" / "harts")
    ran = subprocess.run([harts, "rl", "--config", "tiny", "--seeds", "0", "--num-steps", "1", "--no-progress",
                          "--out", "rl.json", "--json"], cwd=empty, env=env, capture_output=True, text=True,
                         timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    records = json.loads((empty / "rl.json").read_text())
    assert [(r["config"]["name"], r["config"]["execution"]) for r in records] == [("tiny", "compact"),
                                                                                ("tiny", "baseline")]
    assert sorted(path.name for path in empty.iterdir()) == ["rl.json"]
    missing = subprocess.run([harts, "plan", "microbatches", str(STEP), "--capacity", "4096", "--dp", "1",
                              "--planner", "treetrain-ortools"], cwd=empty, env=env, capture_output=True, text=True,
                             timeout=300)
    assert missing.returncode == 2 and missing.stderr == (
        "harts: error: the TreeTrain planner (CP-SAT) needs ortools, which is not installed: "
        "pip install 'harts[bench]'\n")
