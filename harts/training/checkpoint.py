"""Checkpoints of a training run: written atomically, read back without unpickling code.

A checkpoint is the directory `RUN/checkpoints/step_NNNNNN` (NNNNNN = optimizer steps done):
- `model.safetensors`: the model's state dict (parameters in their dtype, and buffers such as
  the MoE expert bias), through safetensors' `save_model`/`load_model` (tied weights once);
- `master.safetensors`: the fp32 master weights of the non-fp32 parameters (bf16 runs only);
- `state.pt`: the optimizer's and the LR scheduler's state dicts and the RNG states (torch's CPU
  generator, every CUDA device's when CUDA is used, numpy's and Python's global generators), saved
  with `torch.save` and read with `torch.load(weights_only=True)`: tensors, numbers, strings and
  containers only, never arbitrary objects;
- `trainer.json`: format version, the step index (equal to the directory's), the current epoch's
  data-step order, the torch thread count, versions, and the sha256 of every data step
  (harts.training.data.StepSource.digests) when the run recorded them;
- `config.json`: the resolved training config and model config.

`save_checkpoint` writes everything into a hidden sibling `.tmp-step_NNNNNN-PID`, fsyncs each
file, renames the directory into place (atomic on POSIX) and fsyncs the parent, so a checkpoint
directory exists complete or not at all: a crash mid-write leaves only a `.tmp-*` directory,
which `latest_checkpoint` ignores and `remove_stale` deletes; a failed write (a full disk) removes
it and is an OSError naming the checkpoint. Reading validates before it trusts: `trainer.json`'s
keys and types, `state.pt`'s structure, every tensor's dtype and shape against the model's (no
silent cast); a damaged or mismatching file is a ValueError naming it and the key. Tested in tests/training/test_checkpoint.py (round trips, RNG restore,
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
from safetensors import SafetensorError, safe_open
from torch import nn

from harts.config import excerpt
from harts.files import fsync_directory, fsync_file
from harts.optim.adamw import MasterWeightAdamW

FORMAT_VERSION = 1
CHECKPOINTS = "checkpoints"
CHECKPOINT_NAME = re.compile(r"step_(\d{6,})")
FILES = ("model.safetensors", "state.pt", "trainer.json", "config.json")
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


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
    try:
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
            fsync_file(file)
        os.rename(temporary, final)
    except (OSError, RuntimeError, SafetensorError) as error:
        # torch.save and safetensors report a full disk as RuntimeError/SafetensorError, without the path.
        shutil.rmtree(temporary, ignore_errors=True)
        raise OSError(f"{final}: could not write the checkpoint ({_first_line(error)})") from None
    fsync_directory(directory)
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
    """(trainer.json, config.json) of the checkpoint at `path`, validated (a ValueError names the file and key)."""
    path = Path(path)
    where = path / "trainer.json"
    trainer = read_json(where)
    if trainer.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{where}: format_version {trainer.get('format_version')!r}, this harts reads {FORMAT_VERSION}")
    for key in ("step", "epoch_order", "torch_threads"):
        if key not in trainer:
            raise ValueError(f"{where}: missing key {key!r}")
    step = trainer["step"]
    if not _is_int(step) or step < 0:
        raise ValueError(f"{where}: 'step' must be a non-negative integer, got {excerpt(step)}")
    named = CHECKPOINT_NAME.fullmatch(path.name)
    if named and int(named.group(1)) != step:
        raise ValueError(f"{where}: 'step' is {step} but the directory is {path.name}")
    order = trainer["epoch_order"]
    if not isinstance(order, list) or not all(_is_int(i) for i in order) or sorted(order) != list(range(len(order))):
        raise ValueError(f"{where}: 'epoch_order' must be a permutation of 0..M-1, got {excerpt(order)}")
    if not _is_int(trainer["torch_threads"]) or trainer["torch_threads"] < 1:
        raise ValueError(f"{where}: 'torch_threads' must be a positive integer, got {excerpt(trainer['torch_threads'])}")
    digests = trainer.get("data_sha256")
    if digests is not None and not (isinstance(digests, list) and all(isinstance(d, str) for d in digests)):
        raise ValueError(f"{where}: 'data_sha256' must be a list of strings, got {excerpt(digests)}")
    config = read_json(path / "config.json")
    for key in ("train", "model"):
        if not isinstance(config.get(key), dict):
            raise ValueError(f"{path / 'config.json'}: {key!r} must be an object, got {excerpt(config.get(key))}")
    return trainer, config


def load_checkpoint(path: str | Path, *, model: nn.Module, optimizer: MasterWeightAdamW,
                    scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict[str, Any]:
    """Restore model, masters, optimizer, scheduler and RNGs from the checkpoint at `path`; return trainer.json."""
    path = Path(path)
    trainer, _ = read_metadata(path)
    device = next(model.parameters()).device
    model_file = path / "model.safetensors"
    try:
        _check_tensors(model_file, model.state_dict())
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
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as error:
        raise ValueError(f"{state_file}: cannot load ({_first_line(error)})") from None
    if not isinstance(state, dict):
        raise ValueError(f"{state_file}: expected a dict, got {type(state).__name__}")
    for key, kind in (("optimizer", dict), ("scheduler", dict), ("rng", dict)):
        if not isinstance(state.get(key), kind):
            raise ValueError(f"{state_file}: {key!r} must be a dict, got {type(state.get(key)).__name__}")
    try:
        optimizer.optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
    # Whatever the state's values make torch's and Python's loaders raise is a damaged file, not a bug here.
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError, IndexError, AssertionError) as error:
        raise ValueError(f"{state_file}: cannot load ({type(error).__name__}: {_first_line(error)})") from None
    return trainer


def _check_tensors(file: Path, expected: dict[str, torch.Tensor]) -> None:
    """ValueError unless each tensor of the safetensors `file` has the dtype and shape of `expected`'s (the
    loaders would cast a bf16 copy of fp32 weights silently)."""
    with safe_open(str(file), framework="pt") as handle:
        for name in handle.keys():
            if name not in expected:
                continue  # reported as unexpected by the loader
            tensor, stored = expected[name], handle.get_slice(name)
            dtype, shape = stored.get_dtype(), list(stored.get_shape())
            if dtype != SAFETENSORS_DTYPES.get(tensor.dtype) or shape != list(tensor.shape):
                raise ValueError(f"{file}: tensor {name!r} is {dtype} {shape}, the model's is "
                                 f"{SAFETENSORS_DTYPES.get(tensor.dtype, tensor.dtype)} {list(tensor.shape)}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with path.open("w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=1)
        handle.write("\n")
