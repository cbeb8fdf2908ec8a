"""The Snakemake pipeline's config (configs/pipeline*.yaml) as the workflow receives it.

`coerce_strings(config, schema)` undoes what `snakemake --config` does to nested values: Snakemake
parses `--config 'speedup={capacity: 512, recompute: true}'` with YAML's base loader, so every scalar
inside a mapping or list arrives as a string ('512', 'true') and the schema's validation rejects it
("'512' is not of type 'integer'"). Where the JSON schema asks for an integer, a number or a boolean
and the config holds a string that spells one (512, -3, 1e-3, 0.5, true, false), the string is
replaced, in place; where it allows null (`type: [integer, "null"]`, or null in an `enum`), "null"
becomes None; any other string is left for the validation to reject with its own message.

`load_schema(path)` is the schema file with the execution knobs merged in: a section holding `x-execution-knobs:
{except: [NAMES]}` takes every field of harts.config.execution.ExecutionConfig but those as a property, made from the
field (`execution.json_schema`: type, choices, bounds, docstring, default), so that a new knob is a key of the
pipeline without an edit here or in the file. `validate(config, schema)` checks the config against it and fills its
defaults, as Snakemake's `validate` does with a schema file.

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

import copy
import re
from pathlib import Path
from typing import Any

from harts.config import load_yaml

_INTEGER = re.compile(r"[+-]?\d+")
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
_BOOLEAN = {"true": True, "false": False}
_NULL = ("null", "~")


KNOBS_KEY = "x-execution-knobs"


def load_schema(path: str | Path) -> dict:
    """The schema file at `path`, each section marked with `KNOBS_KEY` given the execution knobs' properties."""
    from harts.config import execution

    schema = load_yaml(Path(path).read_text(encoding="utf-8"), path)
    for name, section in schema.get("properties", {}).items():
        if not isinstance(section, dict) or KNOBS_KEY not in section:
            continue
        left_out = section.pop(KNOBS_KEY)["except"]
        unknown = set(left_out) - set(execution.FIELDS)
        if unknown:
            raise ValueError(f"{path}: {name}.{KNOBS_KEY}: {sorted(unknown)} are not execution knobs")
        properties = section.setdefault("properties", {})
        for knob in execution.FIELDS:
            if knob in left_out:
                continue
            if knob in properties:
                raise ValueError(f"{path}: {name}.properties.{knob} is an execution knob: the schema makes it")
            properties[knob] = execution.json_schema(knob, required=knob in section.get("required", ()))
    return schema


def validate(config: dict, schema: dict) -> None:
    """ValueError naming the key and what is wrong (jsonschema's best match, one line; its own error prints the whole
    schema) unless `config` is valid; fills in, in place, the defaults of the properties it lacks, in every object
    the validation visits (Snakemake's `validate(..., set_default=True)`)."""
    import jsonschema

    base = jsonschema.Draft202012Validator
    check_properties = base.VALIDATORS["properties"]

    def properties_with_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for key, sub in properties.items():
                if "default" in sub and key not in instance:
                    instance[key] = copy.deepcopy(sub["default"])
        yield from check_properties(validator, properties, instance, schema)

    validator = jsonschema.validators.extend(base, {"properties": properties_with_defaults})
    error = jsonschema.exceptions.best_match(validator(schema).iter_errors(config))
    if error is not None:
        key = ".".join(str(part) for part in error.absolute_path)
        raise ValueError(f"pipeline config: {f'key {key!r}' if key else 'top level'}: {error.message}")


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
