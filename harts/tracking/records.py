"""Benchmark records: one JSON object per measurement, with config, environment and results.

`make_record(benchmark, config, results)` adds the environment captured by an allow-list (never
API keys or tokens): git sha and dirty flag, Python/numpy/torch/triton/fla/megatron versions, the trainers' and
transformers' (and flash-attn-4's, the optional attention kernels) where importable *and already imported* (a
record never imports torch by itself), CPU model and
count, GPU names, hostname, UTC time. `write_records` appends to a JSONL file or writes a JSON
list. A failed case is a record with an `error` field, never a missing one; `sigterm_raises`
turns a SIGTERM (`timeout`, a scheduler) into the `Terminated` exception so that a stopped run
still writes its error row.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import signal
import socket
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from harts.files import atomic_open

# Environment variables worth recording; everything else (keys, tokens, paths) stays out.
ENV_ALLOW_LIST = (
    "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NCCL_NVLS_ENABLE",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "PYTORCH_CUDA_ALLOC_CONF", "WANDB_MODE", "SLURM_JOB_ID",
)
_PACKAGES = ("numpy", "torch", "triton", "fla", "megatron.core", "ortools", "pandas", "transformers", "trl", "verl",
             "accelerate", "datasets")
# Optional kernels whose modules carry no usable __version__: module -> distribution.
_DISTRIBUTIONS = {"flash_attn.cute": "flash-attn-4", "cutlass": "nvidia-cutlass-dsl"}


def git_state(root: str | Path | None = None) -> dict[str, Any]:
    """{"sha", "dirty"} of the checkout; `HARTS_SOURCE_SHA` overrides the sha for a copied working
    tree whose .git is not its source's (a remote machine's copy): then dirty is unknown (None)."""
    given = os.environ.get("HARTS_SOURCE_SHA")
    if given:
        return {"sha": given, "dirty": None, "from": "HARTS_SOURCE_SHA"}
    root = Path(root) if root else Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = bool(subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
            capture_output=True, text=True, check=True, timeout=10,
        ).stdout.strip())
        return {"sha": sha, "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"sha": None, "dirty": None}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "hostname": socket.gethostname(),
        "gpus": [],
    }
    try:
        with open("/proc/meminfo", encoding="utf-8") as handle:
            kib = int(handle.readline().split()[1])
        info["memory_gib"] = round(kib / 2**20, 1)
    except (OSError, ValueError, IndexError):
        info["memory_gib"] = None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def environment() -> dict[str, Any]:
    versions = {"python": platform.python_version()}
    for name in _PACKAGES:
        module = sys.modules.get(name)
        if module is not None:
            versions[name] = getattr(module, "__version__", None)
    for name, distribution in _DISTRIBUTIONS.items():
        if name in sys.modules:
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                versions[distribution] = importlib.metadata.version(distribution)
    torch = sys.modules.get("torch")
    if torch is not None:
        versions["cuda"] = torch.version.cuda
    return {
        "versions": versions,
        "env": {k: os.environ[k] for k in ENV_ALLOW_LIST if k in os.environ},
        "git": git_state(),
        "hardware": hardware(),
        "utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "argv": [os.path.basename(sys.argv[0]), *sys.argv[1:]],
    }


def make_record(benchmark: str, config: dict[str, Any], results: dict[str, Any] | None = None,
                error: str | None = None) -> dict[str, Any]:
    """One record; exactly one of `results` and `error` is given."""
    assert (results is None) != (error is None)
    record = {"benchmark": benchmark, "config": config, "environment": environment()}
    if error is not None:
        record["error"] = error
    else:
        record["results"] = results
    return record


def write_records(records: list[dict[str, Any]], path: str | Path) -> None:
    """Write records as a JSON list (`.json`) or one per line (`.jsonl`)."""
    path = Path(path)
    with atomic_open(path) as handle:
        if path.suffix == ".jsonl":
            for record in records:
                handle.write(json.dumps(record) + "\n")
        else:
            json.dump(records, handle, indent=2)
            handle.write("\n")


def error_message(error: BaseException) -> str:
    """An error row's message: the exception's type and the first line of its text."""
    text = str(error)
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


class Terminated(Exception):
    """SIGTERM arrived during a measurement (`sigterm_raises`)."""


@contextlib.contextmanager
def sigterm_raises():
    """Within the block the first SIGTERM raises `Terminated` (later ones are ignored, so that
    writing the error row and the records is not interrupted), so that a run stopped by `timeout`
    or a scheduler still writes its records."""
    received = []

    def handler(signum, frame) -> None:
        if not received:
            received.append(signum)
            raise Terminated("SIGTERM")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        # None: the previous handler was not installed from Python; restore the default.
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
