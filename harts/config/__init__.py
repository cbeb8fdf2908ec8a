"""Strict YAML configuration: a YAML mapping becomes a (nested) `@dataclass(kw_only=True)`.

`load_config(path, cls)` rejects unknown keys, missing required keys and values of the wrong
type with one line naming the file, the dotted key, the value's type and a bounded excerpt of it.
Every YAML HARTS reads goes through `load_yaml` (a safe loader): aliases (`*name`, the "billion laughs" bomb)
duplicate keys and nesting deeper than MAX_YAML_DEPTH are refused with their line, and integers are bounded by INT_LIMIT as the flags are. `config_to_dict` is the inverse, used
to write the full resolved configuration into result records.

`shipped_config_path(name_or_path, folder)` is the one place a config NAME becomes a file: the
shipped configs are package data of `harts.configs` (the repository's configs/ folder, mapped by
pyproject's package-dir), read through importlib.resources, so an editable install and a wheel
find the same files; an argument with a suffix is a path and stays one. Tested in
tests/test_config.py, and against a built wheel in tests/test_packaging.py.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import reprlib
import types
import typing
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


INT_LIMIT = 1 << 62
"""Counts and sizes meet int64 arrays (token counts, capacities): integers of this size or more are refused."""

MAX_YAML_DEPTH = 64
"""The deepest nesting of collections a YAML file may have (HARTS's configs nest four levels)."""

_EXCERPT = reprlib.Repr()
_EXCERPT.maxlevel, _EXCERPT.maxstring, _EXCERPT.maxother, _EXCERPT.maxlong = 2, 60, 60, 40
_EXCERPT.maxdict = _EXCERPT.maxlist = _EXCERPT.maxtuple = _EXCERPT.maxset = 4


def excerpt(value: Any) -> str:
    """The value's type and a bounded repr of it, for error messages (a huge or deeply nested value stays short)."""
    return f"{type(value).__name__} {_EXCERPT.repr(value)}"


class _StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader without aliases, duplicate keys or integers beyond INT_LIMIT (each a YAMLError with its line)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.MarkedYAMLError(None, None, f"YAML aliases (*{event.anchor}) are not accepted",
                                       event.start_mark)
        # The composer recurses once per level: a deep document would end in a RecursionError traceback.
        self._depth = getattr(self, "_depth", 0) + 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise yaml.MarkedYAMLError(None, None, f"nested deeper than {MAX_YAML_DEPTH} levels",
                                           self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) or key is None:
                if key in seen:
                    raise yaml.MarkedYAMLError(None, None, f"duplicate key {_EXCERPT.repr(key)}", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        value = super().construct_yaml_int(node)
        if abs(value) >= INT_LIMIT:
            raise yaml.MarkedYAMLError(None, None, f"integer {_EXCERPT.repr(value)} is too large (at most 2^62 - 1)",
                                       node.start_mark)
        return value


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_yaml_int)


def load_yaml(stream: Any, where: str | Path) -> Any:
    """YAML text or a text stream through the strict loader; ValueError `WHERE: invalid YAML (line N: ...)`."""
    try:
        return yaml.load(stream, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark
        line = f"line {mark.line + 1}: " if mark is not None else ""
        raise ValueError(f"{where}: invalid YAML ({line}{error.problem})") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{where}: invalid YAML ({str(error).splitlines()[0]})") from None


SHIPPED_FOLDERS = {"models": "model", "parallel": "parallel config", "rl": "RL config", "trees": "trees config"}
"""Folders of `harts.configs` and what their configs are called in messages."""


def load_yaml_mapping(path: str | Path | Traversable) -> dict[str, Any]:
    source = Path(path) if isinstance(path, str) else path
    try:
        with source.open(encoding="utf-8") as handle:
            data = load_yaml(handle, path)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such config file") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return data


def shipped_configs(folder: str) -> dict[str, Traversable]:
    """The shipped configs of `folder` ("models", "parallel" or "trees") by name."""
    assert folder in SHIPPED_FOLDERS, folder
    directory = _configs_root() / folder
    return {entry.name.removesuffix(".yaml"): entry for entry in directory.iterdir() if entry.name.endswith(".yaml")}


def _configs_root() -> Path | Traversable:
    """`harts.configs` of an installed harts (wheel or editable: the package maps the repository's
    configs/ folder); a source checkout put on PYTHONPATH without installing has no such package
    and reads that configs/ folder beside the harts package directly."""
    try:
        return importlib.resources.files("harts.configs")
    except ModuleNotFoundError:
        checkout = Path(__file__).resolve().parents[2] / "configs"
        if not checkout.is_dir():
            raise
        return checkout


def shipped_config_path(name_or_path: str, folder: str) -> Path | Traversable:
    """A path as given (it has a suffix), or the shipped `folder/NAME.yaml` for a bare name (an
    unknown name is a ValueError listing the shipped ones)."""
    path = Path(name_or_path)
    if path.suffix:
        return path
    shipped = shipped_configs(folder)
    if name_or_path not in shipped:
        known = ", ".join(sorted(shipped))
        raise ValueError(
            f"unknown {SHIPPED_FOLDERS[folder]} {name_or_path!r} (known: {known}; or give a path)"
        )
    return shipped[name_or_path]


def load_config(path: str | Path | Traversable, cls: type[T], **overrides: Any) -> T:
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
            raise ValueError(f"{where}: key '{key}': expected true or false, got {excerpt(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: key '{key}': expected an integer, got {excerpt(value)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: key '{key}': expected a number, got {excerpt(value)}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{where}: key '{key}': expected a string, got {excerpt(value)}")
        return value
    if origin is typing.Literal:
        if value not in typing.get_args(hint):
            raise ValueError(f"{where}: key '{key}': expected one of {typing.get_args(hint)}, got {excerpt(value)}")
        return value
    raise TypeError(f"unsupported config type {hint!r} for {key}")


def config_to_dict(config: Any) -> dict[str, Any]:
    """The resolved configuration as plain data (for records and W&B)."""
    return dataclasses.asdict(config)
