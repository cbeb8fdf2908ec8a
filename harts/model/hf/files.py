"""safetensors checkpoint directories: reading their index and headers, cutting shards.

A checkpoint directory holds config.json and either model.safetensors or model-XXXXX-of-YYYYY.safetensors
shards listed by model.safetensors.index.json. `headers(root)` lists every stored tensor (file, shape, dtype)
without reading data and refuses an index that disagrees with the files; every error is a one-line ValueError
naming the file and the tensor. Tested in tests/model/test_hf.py (sharded and damaged directories).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000
SAFETENSORS_FLOATS = ("F64", "F32", "F16", "BF16")
DTYPE_NAMES = {torch.float64: "float64", torch.float32: "float32", torch.float16: "float16",
               torch.bfloat16: "bfloat16"}


def read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: cannot read ({error})") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: invalid JSON ({error})") from None


def weight_files(root: Path) -> tuple[Path, dict[Path, set[str]] | None]:
    """(what names the tensors' files, {file: names the index assigns to it} or None for one file)."""
    index_path = root / INDEX_FILE
    if not index_path.is_file():
        single = root / SINGLE_FILE
        if not single.is_file():
            raise ValueError(f"{root}: neither {INDEX_FILE} nor {SINGLE_FILE} found")
        return single, None
    index = read_json(index_path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index_path}: no 'weight_map' object of tensor names to file names")
    files: dict[Path, set[str]] = {}
    for name, file in weight_map.items():
        if not isinstance(file, str) or Path(file).name != file or not file.endswith(".safetensors"):
            raise ValueError(f"{index_path}: tensor '{name}' maps to {file!r}, not a .safetensors file of the directory")
        path = root / file
        if not path.is_file():
            raise ValueError(f"{index_path}: tensor '{name}' maps to {file}, which does not exist")
        files.setdefault(path, set()).add(name)
    return index_path, files


def headers(root: Path) -> tuple[Path, dict[str, tuple[Path, tuple[int, ...], str]]]:
    """Every stored tensor: name -> (file, shape, safetensors dtype), checked against the index."""
    from safetensors import safe_open

    source, files = weight_files(root)
    found: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    for path in files or [source]:
        try:
            with safe_open(path, "pt") as handle:
                header = [(name, handle.get_slice(name)) for name in handle.keys()]
                header = [(name, tuple(piece.get_shape()), piece.get_dtype()) for name, piece in header]
        except Exception as error:  # safetensors raises its own error types for damaged files
            raise ValueError(f"{path}: not a readable safetensors file ({error})") from None
        for name, shape, dtype in header:
            if name in found:
                raise ValueError(f"{path}: holds tensor '{name}', which {found[name][0].name} holds too")
            found[name] = (path, shape, dtype)
    if files is not None:
        # Where a tensor really is first, then what the index claims in vain.
        for name, (path, _, _) in found.items():
            if name not in files[path]:
                raise ValueError(f"{path}: holds tensor '{name}', which {INDEX_FILE} does not assign to it")
        for path, names in files.items():
            absent = sorted(name for name in names if name not in found)
            if absent:
                raise ValueError(f"{source}: lists tensor '{absent[0]}' in {path.name}, which does not hold it")
    return source, found


def check_dtype(dtype: torch.dtype | None, where: str) -> None:
    if dtype is not None and dtype not in DTYPE_NAMES:
        raise ValueError(f"{where}: dtype must be one of {list(DTYPE_NAMES.values())}, got {dtype}")


def cut_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names in order, cut greedily into shards of at most `max_shard_bytes` (a larger
    tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards
