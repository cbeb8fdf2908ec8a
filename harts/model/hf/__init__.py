"""Hugging Face checkpoints of HARTS's models: `config.json` + safetensors, sharded or not, both ways.

One module per architecture holds its layout (harts.model.hf.kimi: Kimi-Linear; harts.model.hf.bailing:
BailingHybrid, Ling-3; harts.model.hf.qwen3_next and qwen3_5_moe: Qwen3-Next and Qwen3.5-MoE's text model, the
Gated DeltaNet family); this package reads and writes any of them. A model config names its layout
(`ModelConfig.hf_layout`, set by loading and by the shipped configs: `architecture_for`); a config.json by its
model_type:
- `load_hf_checkpoint(path, dtype=None, device=None) -> (HybridModel, ModelConfig)`: a checkpoint
  directory (config.json and model.safetensors, or model-XXXXX-of-YYYYY.safetensors shards listed
  by model.safetensors.index.json) into a model built on the meta device, allocated once in `dtype`
  (default fp32) on `device` (default the CPU) and filled one stored tensor at a time;
  `load_hf_config(path)`: its `ModelConfig` alone;
- `save_hf_checkpoint(model, path, max_shard_bytes=..., dtype=None)`: the inverse, into a new
  directory (one file, or shards + index when the tensors exceed `max_shard_bytes`);
  `save_hf_state(config, state, dtypes, path, ...)` the same from model tensors read on demand;
- `hf_tensors(model, dtype=None)`: (name, tensor) in the layout one at a time, a rollout engine's
  weight-sync stream, and `hf_state_dict(model, dtype=None)` as a dict: what the saver writes;
- `model_config_from_hf(hf_config, where)` and `hf_config_from_model(config)`: config.json <->
  `ModelConfig` (the architecture chosen by config.json's model_type, or for a model by `architecture_for`);
  `check_exportable(config)`; `hf_tensor_shapes(config)`: every tensor of the layout.

Invariant: every tensor of a layout fills its own regions of one model tensor (`Slot`), so loading then saving
(or the reverse) reproduces every parameter bitwise. Tested in tests/model/test_hf.py (round trips, bf16 loading
without an fp32 copy, the weight-sync stream against the files, one check per refused or malformed input) and
against transformers' own classes in tests/model/test_hf_reference.py.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from harts.files import atomic_path, write_text
from harts.model.config import HF_LAYOUTS, ModelConfig
from harts.model.hf import bailing, kimi, qwen3_5_moe, qwen3_next
from harts.model.hf.files import (
    DEFAULT_MAX_SHARD_BYTES, INDEX_FILE, SAFETENSORS_FLOATS, SINGLE_FILE, check_dtype, cut_shards, headers,
    read_json,
)
from harts.model.hf.kimi import FP32_SUFFIXES, KIMI_TINY
from harts.model.hf.schema import Slot, read_slot, write_slot
from harts.model.model import HybridModel, unwrap_model

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES", "FP32_SUFFIXES", "KIMI_TINY", "ARCHITECTURES", "architecture_for", "check_exportable",
    "empty_model", "hf_config_from_model", "hf_state_dict", "hf_tensor_shapes", "hf_tensors", "load_hf_checkpoint",
    "load_hf_config", "model_config_from_hf", "save_hf_checkpoint", "save_hf_state",
]

ARCHITECTURES: dict[str, ModuleType] = {kimi.MODEL_TYPE: kimi, bailing.MODEL_TYPE: bailing,
                                        qwen3_next.MODEL_TYPE: qwen3_next, qwen3_5_moe.MODEL_TYPE: qwen3_5_moe}
"""config.json's model_type -> the module of its layout."""
assert set(ARCHITECTURES) == set(HF_LAYOUTS), (set(ARCHITECTURES), HF_LAYOUTS)


def architecture_for(config: ModelConfig) -> ModuleType:
    """The layout a model of `config` is saved in: the one its `hf_layout` names (ModelConfig resolves None to its
    family's default: Kimi-Linear's for KDA/MLA, Qwen3-Next's for GDN / gated GQA)."""
    return ARCHITECTURES[config.hf_layout]


def model_config_from_hf(hf: dict, where: str) -> ModelConfig:
    """The `ModelConfig` of a config.json (`where` names it in errors), read by the layout of its model_type."""
    if not isinstance(hf, dict):
        raise ValueError(f"{where}: expected a JSON object")
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        shown = json.dumps(model_type) if "model_type" in hf else "missing"
        raise ValueError(f"{where}: field 'model_type' = {shown} is not supported (supported: "
                         f"{', '.join(ARCHITECTURES)})")
    return ARCHITECTURES[model_type].model_config_from_hf(hf, where)


def hf_config_from_model(config: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """config.json for `config` (tensors stored in `dtype`); a ValueError names any feature its layout cannot
    express (`check_exportable`)."""
    return architecture_for(config).hf_config_from_model(config, dtype)


def check_exportable(config: ModelConfig) -> None:
    """ValueError naming every field of `config` its layout cannot express, and the settings to train with instead."""
    architecture_for(config).check_exportable(config)


def _layout(config: ModelConfig) -> dict[str, Slot]:
    return architecture_for(config).layout(config)


def _layout_name(name: str, config: ModelConfig) -> str:
    return architecture_for(config).layout_name(name, config)


def hf_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the checkpoint of `config`, in file order."""
    return {name: slot.shape for name, slot in _layout(config).items()}


def load_hf_config(path: str | Path) -> ModelConfig:
    """The `ModelConfig` of the checkpoint directory `path` (its config.json alone)."""
    root = Path(path)
    config_path = root / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{root}: no config.json (not a Hugging Face checkpoint directory)")
    return model_config_from_hf(read_json(config_path), str(config_path))


def empty_model(config: ModelConfig, *, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> HybridModel:
    """A `HybridModel` of `config` with uninitialised tensors of `dtype` on `device`, built on the meta device:
    no other copy of the model is ever allocated (a CPU fp32 build then a cast would hold both)."""
    with torch.device("meta"):
        model = HybridModel(config)
    model.to(dtype=dtype)
    model.to_empty(device=device)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed.weight  # to_empty gives the two names their own tensors
    return model


def load_hf_checkpoint(
    path: str | Path, *, dtype: torch.dtype | None = None, device: str | torch.device | None = None,
) -> tuple[HybridModel, ModelConfig]:
    """The `HybridModel` (on `device`, default the CPU, in `dtype`, default float32, as `HybridModel.to(dtype)`
    leaves it: the MoE expert biases stay fp32) and its `ModelConfig` of a checkpoint directory in
    one of the `ARCHITECTURES`' layouts (for Kimi-Linear: Moonshot's or transformers' own).

    The model is built on the meta device and then allocated once in `dtype` on `device`; the tensors are read
    one at a time and copied (cast) into their place, so the only other memory is one stored tensor. Every tensor
    name, shape and dtype is checked before any data is read; a missing, extra or mis-shaped tensor, a bad index or
    an unsupported config value is a one-line ValueError naming the file and the tensor or field.

    >>> model, config = load_hf_checkpoint("Kimi-Linear-48B-A3B-Instruct", dtype=torch.bfloat16,
    ...                                    device="cuda")  # doctest: +SKIP
    """
    from safetensors import safe_open

    check_dtype(dtype, "load_hf_checkpoint")
    device = torch.device("cpu" if device is None else device)
    if device.type == "meta":
        raise ValueError("load_hf_checkpoint: device 'meta' cannot hold the weights")
    root = Path(path)
    config = load_hf_config(root)
    config_path = root / "config.json"
    slots = _layout(config)
    source, stored = headers(root)
    names: dict[str, str] = {}  # layout name -> stored name
    for name, (file, shape, stored_dtype) in stored.items():
        layout_name = _layout_name(name, config)
        slot = slots.get(layout_name)
        if slot is None:
            raise ValueError(f"{file}: unexpected tensor '{name}' (not in the {architecture_for(config).MODEL_TYPE} layout of "
                             f"{config_path})")
        if layout_name in names:
            raise ValueError(f"{file}: holds tensor '{name}' and '{names[layout_name]}', two names of one tensor")
        if shape != slot.shape:
            raise ValueError(f"{file}: tensor '{name}' has shape {list(shape)}, expected {list(slot.shape)} "
                             f"from {config_path}")
        if stored_dtype not in SAFETENSORS_FLOATS:
            raise ValueError(f"{file}: tensor '{name}' has dtype {stored_dtype}, expected a floating type "
                             f"({', '.join(SAFETENSORS_FLOATS)})")
        names[layout_name] = name
    # Tied embeddings may omit the head (Moonshot's and vLLM's readers tie it; transformers' needs it).
    missing = [name for name in slots if name not in names
               and not (config.tie_embeddings and name == "lm_head.weight")]
    if missing:
        raise ValueError(f"{source}: missing tensor '{missing[0]}' ({len(missing)} missing in all)")
    if config.tie_embeddings and "lm_head.weight" in names:
        _check_tied_head(stored, names, config_path, architecture_for(config))

    model = empty_model(config, dtype=dtype or torch.float32, device=device)
    _check_coverage(model, slots)
    targets = model.state_dict(keep_vars=True)
    by_file: dict[Path, list[str]] = {}
    for layout_name, name in names.items():
        if not (config.tie_embeddings and layout_name == "lm_head.weight"):
            by_file.setdefault(stored[name][0], []).append(layout_name)
    with torch.no_grad():
        for file, layout_names in by_file.items():
            with safe_open(file, "pt") as handle:
                for layout_name in layout_names:
                    slot = slots[layout_name]
                    write_slot(slot, targets[slot.target], handle.get_tensor(names[layout_name]))
    return model, config


def _check_tied_head(stored: dict, names: dict[str, str], config_path: Path, architecture: ModuleType) -> None:
    """ValueError unless the stored lm_head.weight equals the embedding that tie_word_embeddings says it is:
    transformers would compute with the one, tying readers with the other."""
    from safetensors import safe_open

    def read(layout_name: str) -> torch.Tensor:
        with safe_open(stored[names[layout_name]][0], "pt") as handle:
            return handle.get_tensor(names[layout_name])

    embedding = architecture.EMBEDDING
    if not torch.equal(read("lm_head.weight"), read(embedding)):
        file = stored[names["lm_head.weight"]][0]
        raise ValueError(f"{file}: tensor 'lm_head.weight' differs from '{names[embedding]}', but "
                         f"{config_path} sets tie_word_embeddings (set it false if lm_head.weight is the head)")


# ---------------------------------------------------------------------------------------------
# Saving




def _check_coverage(model: HybridModel, slots: dict[str, Slot]) -> None:
    """Internal invariant: the layout's regions tile every model tensor exactly."""
    covered: dict[str, int] = {}
    for slot in slots.values():
        covered[slot.target] = covered.get(slot.target, 0) + int(torch.Size(slot.shape).numel())
    expected = {name: t.numel() for name, t in model.state_dict().items()}
    assert covered == expected, sorted(set(covered.items()) ^ set(expected.items()))[:4]


def _stored_dtype(config: ModelConfig, name: str, own: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """`dtype` (None: `own`), except for the tensors the layout keeps in their own dtype (its FP32_SUFFIXES)."""
    return own if dtype is None or name.endswith(architecture_for(config).FP32_SUFFIXES) else dtype


def _hf_items(config: ModelConfig, state: Mapping[str, torch.Tensor], dtype: torch.dtype | None,
              names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, a new tensor) of every layout tensor (or of `names`), each taken from the model tensors `state`
    (HARTS names; read once per name) and stored in `dtype` (None: its own; FP32_SUFFIXES keep their own)."""
    slots = _layout(config)
    for name in slots if names is None else names:
        slot = slots[name]
        source = state[slot.target].detach()
        region = read_slot(slot, source)
        assert tuple(region.shape) == slot.shape, (name, tuple(region.shape), slot.shape)
        stored = _stored_dtype(config, name, source.dtype, dtype)
        yield name, torch.empty(slot.shape, dtype=stored, device=source.device).copy_(region)


def hf_tensors(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of `model` in its layout, one new tensor at a time on the model's device: the
    weight-sync stream of a rollout engine (vLLM's and SGLang's `load_weights` take these names), equal to what
    `save_hf_checkpoint(model, dtype=dtype)` writes. Refuses a model the layout cannot express (ValueError)."""
    model = unwrap_model(model)
    check_dtype(dtype, "hf_tensors")
    check_exportable(model.config)
    _check_coverage(model, _layout(model.config))
    return _hf_items(model.config, model.state_dict(), dtype)


def hf_state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """`hf_tensors` as a dict (every tensor held at once)."""
    return dict(hf_tensors(model, dtype))


def save_hf_checkpoint(
    model: nn.Module,
    path: str | Path,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: torch.dtype | None = None,
) -> list[Path]:
    """Write `model` as a checkpoint in its layout (`architecture_for`) into the new directory `path`; return the files.

    The tensors keep the model's dtype (bitwise round trip), or are cast to `dtype` (e.g.
    torch.bfloat16) except the fp32 ones of `FP32_SUFFIXES`. One model.safetensors when everything
    fits in `max_shard_bytes`, else model-XXXXX-of-YYYYY.safetensors shards and
    model.safetensors.index.json. Refuses a directory that already holds a checkpoint, and a model
    the layout cannot express (ValueError naming the fields).
    """
    model = unwrap_model(model)
    state = model.state_dict()
    return save_hf_state(model.config, state, {name: t.dtype for name, t in state.items()}, path,
                         max_shard_bytes=max_shard_bytes, dtype=dtype)


def save_hf_state(
    config: ModelConfig,
    state: Mapping[str, torch.Tensor],
    dtypes: Mapping[str, torch.dtype],
    path: str | Path,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: torch.dtype | None = None,
) -> list[Path]:
    """`save_hf_checkpoint` of the model tensors `state` (HARTS's state-dict names and shapes, of `dtypes`; each
    read when its shard is written, so `state` may read them from files on demand) of a model of `config`.

    Each file is written atomically (harts.files) and config.json last, so a directory an interrupted save left
    behind is not a checkpoint; a failed save removes what it wrote.
    """
    from safetensors.torch import save_file

    if max_shard_bytes < 1:
        raise ValueError(f"save_hf_checkpoint: max_shard_bytes must be >= 1, got {max_shard_bytes}")
    check_dtype(dtype, "save_hf_checkpoint")
    root = Path(path)
    if root.exists() and not root.is_dir():
        raise ValueError(f"{root}: exists and is not a directory")
    existing = [p.name for p in (root.glob("*.safetensors") if root.is_dir() else [])]
    existing += [name for name in ("config.json", INDEX_FILE) if (root / name).exists()]
    if existing:
        raise ValueError(f"{root}: already holds a checkpoint ({sorted(existing)[0]}); save into a new directory")
    hf_config = hf_config_from_model(config, dtype or dtypes["embed.weight"])
    slots = _layout(config)
    stored = {name: _stored_dtype(config, name, dtypes[slot.target], dtype) for name, slot in slots.items()}
    sizes = {name: torch.Size(slot.shape).numel() * stored[name].itemsize for name, slot in slots.items()}
    shards = cut_shards(sizes, max_shard_bytes)
    files = ([root / SINGLE_FILE] if len(shards) == 1 else
             [root / f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    created = [p for p in (root, *root.parents) if not p.exists()]
    written: list[Path] = []
    try:
        root.mkdir(parents=True, exist_ok=True)
        with torch.no_grad():
            for file, names in zip(files, shards):
                tensors = {name: tensor.cpu() for name, tensor in _hf_items(config, state, dtype, names)}
                with atomic_path(file) as temporary:
                    save_file(tensors, str(temporary), metadata={"format": "pt"})
                written.append(file)
                del tensors
        if len(files) > 1:
            index = {"metadata": {"total_size": sum(sizes.values())},
                     "weight_map": {name: file.name for file, names in zip(files, shards) for name in names}}
            write_text(root / INDEX_FILE, json.dumps(index, indent=2) + "\n")
            written.append(root / INDEX_FILE)
        write_text(root / "config.json", json.dumps(hf_config, indent=2) + "\n")
    except BaseException:
        for file in written:
            file.unlink(missing_ok=True)
        for folder in created:
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    return [root / "config.json", *written]
