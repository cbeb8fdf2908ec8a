"""Pieces every Hugging Face layout of harts.model.hf is written with.

- `Slot`: where one checkpoint tensor lives in the model (a region of one model tensor, in the checkpoint's
  shape and orientation, or several regions of it stacked along the checkpoint tensor's first dim), the views
  that cut the usual regions (`rows`, `columns_t`, `expert_columns_t`, `expert_t`, `row_blocks`), and
  `read_slot` / `write_slot`, which read and fill a slot's regions;
- `Fields`: typed reads of a config.json's fields, every error naming the file and the field; `type_list`
  (transformers' per-layer lists) and `agree` (two keys of one config that must describe one model).
Tested through every layout (tests/model/test_hf.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor lives in the model: `view(model tensor target)` is the region, in the
    checkpoint's shape and orientation, or a tuple of regions whose concatenation along dim 0 is the checkpoint
    tensor (Qwen3-Next's in_proj_qkvz interleaves q, k, v and z rows per key head)."""

    target: str
    shape: tuple[int, ...]
    view: Callable[[torch.Tensor], torch.Tensor | tuple[torch.Tensor, ...]]


def read_slot(slot: Slot, target: torch.Tensor) -> torch.Tensor:
    """The checkpoint tensor of `slot` in model tensor `target` (a view, or a new tensor for several regions)."""
    region = slot.view(target)
    return torch.cat(region) if isinstance(region, tuple) else region


def write_slot(slot: Slot, target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy the checkpoint tensor `value` of `slot` into its regions of model tensor `target`."""
    region = slot.view(target)
    if not isinstance(region, tuple):
        region.copy_(value)
        return
    for part, piece in zip(region, value.split([part.shape[0] for part in region]), strict=True):
        part.copy_(piece)


def whole(t: torch.Tensor) -> torch.Tensor:
    return t


def rows(lo: int, hi: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t[lo:hi]


def columns_t(lo: int, hi: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t[:, lo:hi].T


def expert_columns_t(expert: int, lo: int, hi: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t[expert, :, lo:hi].T


def expert_t(expert: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t[expert].T


def row_blocks(blocks: list[tuple[int, int]]) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    """The rows [lo, hi) of each block, stacked in this order along the checkpoint tensor's first dim."""
    return lambda t: tuple(t[lo:hi] for lo, hi in blocks)


class Fields:
    """Typed reads of config.json's fields, each error naming the file and the field."""

    def __init__(self, data: dict, where: str) -> None:
        self.data, self.where = data, where

    def fail(self, field: str, message: str) -> ValueError:
        return ValueError(f"{self.where}: field '{field}' {message}")

    def get(self, field: str, kind: type | tuple[type, ...], default=None, *, required: bool = False):
        """The field's value (`default` when absent or null, unless `required`), type-checked."""
        value = self.data.get(field)
        if value is None:
            if required:
                raise ValueError(f"{self.where}: missing field '{field}'")
            return default
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise self.fail(field, f"must be {kind_name(kinds)}, got {value!r}")
        return value

    def require(self, field: str, kind: type | tuple[type, ...]):
        return self.get(field, kind, required=True)

    def read_harts_fields(self, data: dict, allowed: dict[str, tuple[str, ...]]) -> None:
        """Set into `data` (a ModelConfig dict) the HARTS training fields of config.json's "harts" object, whose
        keys are "section.field" or "field" (the top level); a field `allowed` does not list for its section is
        refused, naming the key."""
        for key, value in self.get("harts", dict, {}).items():
            section, _, field = key.rpartition(".") if "." in key else ("", "", key)
            if field not in allowed.get(section, ()):
                raise self.fail(f"harts.{key}", "is not a HARTS training field")
            (data[section] if section else data)[field] = value

    def expect(self, field: str, value, default, reason: str) -> None:
        """Refuse any value of `field` other than `value` (absent means `default`; a field without
        a default must be present)."""
        if field not in self.data and default is None:
            raise ValueError(f"{self.where}: missing field '{field}'")
        actual = self.data.get(field, default)
        if actual != value:
            raise self.fail(field, f"= {json.dumps(actual)} is not supported ({reason})")


def kind_name(kinds: tuple[type, ...]) -> str:
    return " or ".join({int: "an integer", float: "a number", bool: "true or false", str: "a string",
                        dict: "a mapping", list: "a list"}[k] for k in kinds)


def type_list(fields: Fields, key: str, kinds: tuple[str, str], num_layers: int) -> list[str] | None:
    """transformers' per-layer list `key` (each entry one of `kinds`), or None when absent."""
    values = fields.get(key, list)
    if values is not None and (len(values) != num_layers or any(v not in kinds for v in values)):
        raise fields.fail(key, f"must list {num_layers} entries, each {kinds[0]!r} or {kinds[1]!r}, got {values!r}")
    return values


def agree(fields: Fields, field: str, value, other_field: str, other) -> None:
    """Refuse a config.json whose Moonshot and transformers keys describe different models: each reader
    would build another one."""
    if value != other:
        raise fields.fail(field, f"= {json.dumps(value)} disagrees with '{other_field}' = {json.dumps(other)}")
