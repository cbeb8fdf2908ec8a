"""`export_checkpoint`: a `harts train` checkpoint as a Hugging Face checkpoint (`harts export`).

The source is a checkpoint directory (RUN/checkpoints/step_NNNNNN, harts.training.checkpoint) or a run
directory, whose last checkpoint is taken. The model config is the checkpoint's own (config.json's "model",
resolved when the run started); the weights are its model.safetensors, each non-fp32 parameter of a bf16 run
replaced by its fp32 master from master.safetensors (the parameter is that master rounded). They are written
by `harts.model.hf.save_hf_state` in the Hub layout of the config's hf_layout, in `dtype` (default the run's: "fp32" or
"bf16"; the decay and router tensors stay fp32), one stored tensor read at a time: memory holds a shard and a
tensor or two, never the model. Every name, shape and dtype of the checkpoint is checked against the model of
its config before anything is written; a model config the layout cannot express (a KDA output-gate bias, RoPE
MLA: the shipped configs other than kimi-tiny) is refused naming each field and the setting to train with.
Tested in tests/training/test_export.py against a model loaded from the checkpoint and saved directly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from harts.config import from_dict
from harts.model.config import ModelConfig
from harts.model.hf import DEFAULT_MAX_SHARD_BYTES, check_exportable, empty_model, save_hf_state
from harts.training.checkpoint import SAFETENSORS_DTYPES, latest_checkpoint, read_metadata

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def find_checkpoint(path: str | Path) -> Path:
    """`path` if it is a checkpoint directory (it has trainer.json), else the last checkpoint of the run `path`."""
    path = Path(path)
    if (path / "trainer.json").is_file():
        return path
    if not path.is_dir():
        raise ValueError(f"{path}: no such run or checkpoint directory")
    checkpoint = latest_checkpoint(path)
    if checkpoint is None:
        raise ValueError(f"{path}: neither a checkpoint (no trainer.json) nor a run directory with one "
                         "(no checkpoints/step_NNNNNN)")
    return checkpoint


class _CheckpointTensors(Mapping):
    """The model tensors of a training checkpoint by state-dict name, read from its files on demand (the last two
    kept: the layout reads the experts' gate/up and down stacks in turn), fp32 masters first. Construction checks
    every stored name, shape and dtype against `expected` (the state dict of the run's model, on the meta device)."""

    def __init__(self, checkpoint: Path, expected: dict[str, torch.Tensor], tied: bool) -> None:
        self.model_file, self.master_file = checkpoint / "model.safetensors", checkpoint / "master.safetensors"
        stored = _header(self.model_file)
        self.names = {name: name for name in expected}
        if tied and "lm_head.weight" not in stored:  # safetensors' save_model keeps embed.weight alone
            self.names["lm_head.weight"] = "embed.weight"
        for name, source in self.names.items():
            if source not in stored:
                raise ValueError(f"{self.model_file}: missing tensor {name!r} of the model of its config.json")
            _check(self.model_file, source, stored[source], expected[name])
        unexpected = sorted(set(stored) - set(self.names.values()))
        if unexpected:
            raise ValueError(f"{self.model_file}: unexpected tensor {unexpected[0]!r} (not in the model of its "
                             "config.json)")
        self.masters = _header(self.master_file) if self.master_file.exists() else {}
        for name, (dtype, shape) in self.masters.items():
            if name not in expected or expected[name].dtype == torch.float32:
                raise ValueError(f"{self.master_file}: unexpected master weight {name!r} (not a non-fp32 parameter "
                                 "of the model)")
            _check(self.master_file, name, (dtype, shape), expected[name].float())
        self.dtypes = {name: torch.float32 if name in self.masters else tensor.dtype
                       for name, tensor in expected.items()}
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._cache:
            file, key = (self.master_file, name) if name in self.masters else (self.model_file, self.names[name])
            try:
                with safe_open(str(file), "pt") as handle:
                    self._cache[name] = handle.get_tensor(key)
            except (OSError, SafetensorError) as error:
                raise ValueError(f"{file}: cannot read tensor {key!r} ({error})") from None
            while len(self._cache) > 2:
                self._cache.popitem(last=False)
        return self._cache[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def _header(file: Path) -> dict[str, tuple[str, list[int]]]:
    try:
        with safe_open(str(file), "pt") as handle:
            return {name: (handle.get_slice(name).get_dtype(), list(handle.get_slice(name).get_shape()))
                    for name in handle.keys()}
    except (OSError, SafetensorError) as error:
        raise ValueError(f"{file}: cannot read ({str(error).strip().splitlines()[0] if str(error).strip() else error})"
                         ) from None


def _check(file: Path, name: str, stored: tuple[str, list[int]], expected: torch.Tensor) -> None:
    dtype, shape = stored
    want = SAFETENSORS_DTYPES.get(expected.dtype, str(expected.dtype))
    if dtype != want or shape != list(expected.shape):
        raise ValueError(f"{file}: tensor {name!r} is {dtype} {shape}, the model of its config.json has "
                         f"{want} {list(expected.shape)}")


def export_checkpoint(source: str | Path, out: str | Path, *, dtype: str | None = None,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> tuple[Path, list[Path]]:
    """Write the checkpoint `source` (or the last of the run `source`) as a Hugging Face checkpoint into the new
    directory `out`, its tensors in `dtype` ("fp32" or "bf16"; None: the run's); return (the checkpoint, the
    files written)."""
    checkpoint = find_checkpoint(source)
    _, saved = read_metadata(checkpoint)
    where = str(checkpoint / "config.json")
    config = from_dict(ModelConfig, saved["model"], where, prefix="model.")
    check_exportable(config)
    run_dtype = saved["train"].get("dtype")
    if run_dtype not in DTYPES:
        raise ValueError(f"{where}: 'train.dtype' must be one of {list(DTYPES)}, got {run_dtype!r}")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"export: dtype must be one of {list(DTYPES)}, got {dtype!r}")
    expected = empty_model(config, dtype=DTYPES[run_dtype], device="meta").state_dict()
    tensors = _CheckpointTensors(checkpoint, expected, config.tie_embeddings)
    files = save_hf_state(config, tensors, tensors.dtypes, out, max_shard_bytes=max_shard_bytes,
                          dtype=DTYPES[dtype or run_dtype])
    return checkpoint, files
