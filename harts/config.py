"""Strict YAML configuration: a YAML mapping becomes a (nested) `@dataclass(kw_only=True)`.

`load_config(path, cls)` rejects unknown keys, missing required keys and values of the wrong
type with one line naming the file and the dotted key. `config_to_dict` is the inverse, used
to write the full resolved configuration into result records.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


def load_yaml_mapping(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such config file") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: invalid YAML ({str(error).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return data


def shipped_config_path(name_or_path: str, config_dir: Path, kind: str) -> Path:
    """A YAML path as given, or `config_dir/NAME.yaml` for a bare name (an unknown name is a
    ValueError listing the shipped ones; `kind` names them in the message)."""
    path = Path(name_or_path)
    if path.suffix:
        return path
    path = config_dir / f"{name_or_path}.yaml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in config_dir.glob("*.yaml")))
        raise ValueError(f"unknown {kind} {name_or_path!r} (known: {known}; or give a YAML path)")
    return path


def load_config(path: str | Path, cls: type[T], **overrides: Any) -> T:
    """Load `path` strictly into `cls`; `overrides` replace top-level keys."""
    data = load_yaml_mapping(path)
    data.update(overrides)
    return from_dict(cls, data, str(path))


def from_dict(cls: type[T], data: Any, where: str, prefix: str = "") -> T:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: {prefix or 'config'}: expected a mapping")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(
            f"{where}: unknown key '{prefix}{unknown[0]}' (allowed: {', '.join(sorted(fields))})"
        )
    values = {}
    for name, field in fields.items():
        key = f"{prefix}{name}"
        if name not in data:
            if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                raise ValueError(f"{where}: missing required key '{key}'")
            continue
        values[name] = _convert(hints[name], data[name], where, key)
    try:
        return cls(**values)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def _convert(hint: Any, value: Any, where: str, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, where, key)
            except ValueError as error:
                errors.append(str(error))
        raise ValueError(errors[0])
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, where, prefix=f"{key}.")
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise ValueError(f"{where}: key '{key}': expected a list")
        (item,) = typing.get_args(hint)[:1] or (Any,)
        items = [_convert(item, v, where, f"{key}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: key '{key}': expected a mapping")
        return dict(value)
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: key '{key}': expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: key '{key}': expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: key '{key}': expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{where}: key '{key}': expected a string, got {value!r}")
        return value
    if origin is typing.Literal:
        if value not in typing.get_args(hint):
            raise ValueError(f"{where}: key '{key}': expected one of {typing.get_args(hint)}, got {value!r}")
        return value
    raise TypeError(f"unsupported config type {hint!r} for {key}")


def config_to_dict(config: Any) -> dict[str, Any]:
    """The resolved configuration as plain data (for records and W&B)."""
    return dataclasses.asdict(config)
