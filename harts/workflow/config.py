"""The Snakemake pipeline's config (configs/pipeline*.yaml) as the workflow receives it.

`coerce_strings(config, schema)` undoes what `snakemake --config` does to nested values: Snakemake
parses `--config 'speedup={capacity: 512, recompute: true}'` with YAML's base loader, so every scalar
inside a mapping or list arrives as a string ('512', 'true') and the schema's validation rejects it
("'512' is not of type 'integer'"). Where the JSON schema asks for an integer, a number or a boolean
and the config holds a string that spells one (512, -3, 1e-3, 0.5, true, false), the string is
replaced, in place; where it allows null (`type: [integer, "null"]`, or null in an `enum`), "null"
becomes None; any other string is left for the validation to reject with its own message.

`check_config_files(paths)` refuses a config file that is not plain data (an alias, a duplicate key: the strict
loader of harts.config) or asks Snakemake for YAML templating (`__use_yte__`): the
pipeline's configs are data, checked against the schema. Snakemake evaluates such a file's Python expressions
when it reads `--configfile`, before the Snakefile runs, so this refusal stops the run but cannot undo what the
expressions did: config files and profiles are code to Snakemake
(docs/pipeline.md "Config files and profiles are code to Snakemake").

Tested in tests/workflow/test_config.py against hand-written configs and in
tests/workflow/test_workflow.py by dry runs with nested `--config` values and with a templated config file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from harts.config import load_yaml

_INTEGER = re.compile(r"[+-]?\d+")
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
_BOOLEAN = {"true": True, "false": False}
_NULL = ("null", "~")


def load_schema(path: str | Path) -> dict:
    return load_yaml(Path(path).read_text(encoding="utf-8"), path)


def coerce_strings(config: dict, schema: dict) -> dict:
    """`config` with the strings that spell the schema's integers, numbers and booleans converted."""
    return _coerce(config, schema, schema)


def _resolve(schema: dict, root: dict) -> dict:
    while "$ref" in schema:
        node: Any = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            node = node[part]
        schema = node
    return schema


def _coerce(value: Any, schema: dict, root: dict) -> Any:
    schema = _resolve(schema, root)
    if isinstance(value, dict):
        extra = schema.get("additionalProperties")
        for key, inner in value.items():
            sub = schema.get("properties", {}).get(key, extra if isinstance(extra, dict) else None)
            if sub is not None:
                value[key] = _coerce(inner, sub, root)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        value[:] = [_coerce(inner, schema["items"], root) for inner in value]
    elif isinstance(value, str):
        kinds = schema.get("type")
        kinds = list(kinds) if isinstance(kinds, list) else [kinds]
        if None in schema.get("enum", ()):
            kinds.append("null")
        for kind in kinds:
            converted = _scalar(value, kind)
            if converted is not _UNCHANGED:
                return converted
    return value


_UNCHANGED = object()


def _scalar(text: str, kind: str | None) -> Any:
    if kind == "integer" and _INTEGER.fullmatch(text):
        return int(text)
    if kind == "number" and _NUMBER.fullmatch(text):
        return int(text) if _INTEGER.fullmatch(text) else float(text)
    if kind == "boolean" and text.lower() in _BOOLEAN:
        return _BOOLEAN[text.lower()]
    if kind == "null" and text in _NULL:
        return None
    return _UNCHANGED


def check_config_files(paths: list[str | Path]) -> None:
    """ValueError naming the first of `paths` that is templated (`__use_yte__` at its top) or not plain data to
    HARTS's strict YAML loader (an alias, a duplicate key, an integer beyond 2^62: harts.config.load_yaml), before
    anything walks the config Snakemake built from it (an alias bomb shares its nodes: walking them is exponential)."""
    for path in paths:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError:
            continue  # Snakemake reports a config file it cannot read
        if re.search(r"^[\"']?__use_yte__[\"']?\s*:", text, flags=re.M):
            raise ValueError(f"{path}: a templated config (__use_yte__): the pipeline's config files are data. "
                             "Snakemake has already evaluated its expressions (config files are code to it: "
                             "docs/pipeline.md 'Config files and profiles are code to Snakemake'); give plain YAML")
        load_yaml(text, path)
