"""Checkpoints of a training run: written atomically, read back without unpickling code.

A checkpoint is the directory `RUN/checkpoints/step_NNNNNN` (NNNNNN = optimizer steps done):
- `model.safetensors`: the model's state dict (parameters in their dtype, and buffers such as
  the MoE expert bias), through safetensors' `save_model`/`load_model` (tied weights once);
- `master.safetensors`: the fp32 master weights of the non-fp32 parameters (bf16 runs only);
- `state.pt`: the optimizer's and the LR scheduler's state dicts and the RNG states (torch's CPU
  generator, every CUDA device's when CUDA is used, numpy's and Python's global generators), saved
  with `torch.save` and read with `torch.load(weights_only=True)`: tensors, numbers, strings and
  containers only, never arbitrary objects;
- `trainer.json`: format version, the step index, the current epoch's data-step order, the torch
  thread count and versions;
- `config.json`: the resolved training config and model config.

`save_checkpoint` writes everything into a hidden sibling `.tmp-step_NNNNNN-PID`, fsyncs each
file, renames the directory into place (atomic on POSIX) and fsyncs the parent, so a checkpoint
directory exists complete or not at all: a crash mid-write leaves only a `.tmp-*` directory,
which `latest_checkpoint` ignores and `remove_stale` deletes. A damaged or mismatching file is a
ValueError naming it. Tested in tests/training/test_checkpoint.py (round trips, RNG restore,
atomicity, damaged files) and by the resume tests of tests/training/test_loop.py.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
from safetensors import SafetensorError
from torch import nn

from harts.training.optim import MasterWeightAdamW

FORMAT_VERSION = 1
CHECKPOINTS = "checkpoints"
CHECKPOINT_NAME = re.compile(r"step_(\d{6,})")
FILES = ("model.safetensors", "state.pt", "trainer.json", "config.json")


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def rng_state(cuda: bool) -> dict[str, Any]:
    """The global RNG states (CUDA's only when `cuda`: querying them initialises CUDA)."""
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(position),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        "python": random.getstate(),
    }
    if cuda:
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    numpy = state["numpy"]
    np.random.set_state((numpy["kind"], numpy["keys"].numpy().astype(np.uint32), numpy["pos"], numpy["has_gauss"],
                         numpy["cached_gaussian"]))
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: str | Path, step: int, *, model: nn.Module, optimizer: MasterWeightAdamW,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, trainer: dict[str, Any],
                    config: dict[str, Any], cuda: bool) -> Path:
    """Write the checkpoint of `step` (steps done) under RUN/checkpoints atomically; return its path."""
    directory = Path(run_dir) / CHECKPOINTS
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / checkpoint_name(step)
    if final.exists():
        raise ValueError(f"{final}: a checkpoint of step {step} already exists")
    temporary = directory / f".tmp-{final.name}-{os.getpid()}"
    if temporary.exists():
        shutil.rmtree(temporary)
    temporary.mkdir()
    safetensors.torch.save_model(model, str(temporary / "model.safetensors"))
    copies = optimizer.copies
    if copies:
        safetensors.torch.save_file({name: tensor.contiguous() for name, tensor in copies.items()},
                                    str(temporary / "master.safetensors"))
    torch.save({"optimizer": optimizer.optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "rng": rng_state(cuda)}, temporary / "state.pt")
    _write_json(temporary / "trainer.json", {"format_version": FORMAT_VERSION, "step": step, **trainer})
    _write_json(temporary / "config.json", config)
    for file in temporary.iterdir():
        _fsync(file)
    os.rename(temporary, final)
    _fsync(directory)
    return final


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint with the most steps under RUN/checkpoints, or None."""
    directory = Path(run_dir) / CHECKPOINTS
    if not directory.is_dir():
        return None
    found = [(int(m.group(1)), entry) for entry in directory.iterdir()
             if (m := CHECKPOINT_NAME.fullmatch(entry.name)) and entry.is_dir()]
    return max(found)[1] if found else None


def remove_stale(run_dir: str | Path) -> list[Path]:
    """Delete the `.tmp-*` directories a crash during a save left behind; return them."""
    directory = Path(run_dir) / CHECKPOINTS
    stale = sorted(directory.glob(".tmp-step_*")) if directory.is_dir() else []
    for entry in stale:
        shutil.rmtree(entry)
    return stale


def read_json(path: Path) -> dict[str, Any]:
    try:
        with path.open(encoding="utf-8") as handle:
            data = json.load(handle)
    except FileNotFoundError:
        raise ValueError(f"{path}: missing (an incomplete checkpoint?)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: damaged JSON ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def read_metadata(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(trainer.json, config.json) of the checkpoint at `path`, with the format version checked."""
    path = Path(path)
    trainer = read_json(path / "trainer.json")
    if trainer.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path / 'trainer.json'}: format_version {trainer.get('format_version')!r}, "
                         f"this harts reads {FORMAT_VERSION}")
    return trainer, read_json(path / "config.json")


def load_checkpoint(path: str | Path, *, model: nn.Module, optimizer: MasterWeightAdamW,
                    scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict[str, Any]:
    """Restore model, masters, optimizer, scheduler and RNGs from the checkpoint at `path`; return trainer.json."""
    path = Path(path)
    trainer, _ = read_metadata(path)
    device = next(model.parameters()).device
    model_file = path / "model.safetensors"
    try:
        missing, unexpected = safetensors.torch.load_model(model, str(model_file), strict=False, device=str(device))
    except (OSError, RuntimeError, SafetensorError) as error:
        raise ValueError(f"{model_file}: cannot load ({_first_line(error)})") from None
    if missing or unexpected:
        raise ValueError(f"{model_file}: does not match the model "
                         f"({'missing ' + sorted(missing)[0] if missing else 'unexpected ' + sorted(unexpected)[0]})")
    master_file = path / "master.safetensors"
    if optimizer.copies or master_file.exists():
        try:
            masters = safetensors.torch.load_file(str(master_file), device=str(device))
        except (OSError, SafetensorError) as error:
            raise ValueError(f"{master_file}: cannot load ({_first_line(error)})") from None
        optimizer.load_copies(masters, str(master_file))
    state_file = path / "state.pt"
    try:
        state = torch.load(state_file, map_location="cpu", weights_only=True)
        optimizer.optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
    except (OSError, RuntimeError, ValueError, KeyError, EOFError, pickle.UnpicklingError) as error:
        raise ValueError(f"{state_file}: cannot load ({_first_line(error)})") from None
    return trainer


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with path.open("w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=1)
        handle.write("\n")


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
