"""Loading benchmark records for reports, and the provenance every report prints.

`load_records(paths, benchmark)` reads the JSON records that `harts bench ...` writes
(`harts.tracking.records`: a JSON list, or one record per line for `.jsonl`) and checks the fields a
report relies on; a malformed file or record is a ValueError naming the file, the record index and
the field. `provenance(records)` collects the hardware, package versions, git sha(s), dirty flag
and time range of the records, so that a report names how and where its figures were measured;
`provenance_lines` formats it.

Cells: a report never prints a number it did not read from a record. A value the records do not
hold is written as `NOT_MEASURED`, a case whose record carries an `error` as `ERROR`, and a figure
the paper does not give as `NOT_REPORTED`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from harts.trees.io import read_lines, read_text

NOT_MEASURED = "not measured"
ERROR = "error"
NOT_REPORTED = "not reported"


def load_records(paths: list[str | Path] | tuple[str | Path, ...], benchmark: str) -> list[dict[str, Any]]:
    """All records of `paths` (in order), each checked to be a `benchmark` record."""
    records = []
    for path in paths:
        records.extend(_check(record, path, i, benchmark) for i, record in enumerate(_read(Path(path))))
    return records


def _read(path: Path) -> list[Any]:
    """The file's records; its text is read as steps are (`harts.trees.io`: invalid UTF-8 named by line and column)."""
    if not path.exists():
        raise ValueError(f"{path}: no such records file")
    if path.suffix == ".jsonl":
        records = []
        for number, line in read_lines(path):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}:{number}: invalid JSON ({error.msg} at column {error.colno})") from None
        return records
    try:
        data = json.loads(read_text(path))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: invalid JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of records")
    return data


def _check(record: Any, path: str | Path, index: int, benchmark: str) -> dict[str, Any]:
    where = f"{path}: record {index}"
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object")
    for field, kind in (("benchmark", str), ("config", dict), ("environment", dict)):
        if not isinstance(record.get(field), kind):
            raise ValueError(f"{where}: field '{field}' missing or not a {kind.__name__}")
    if record["benchmark"] != benchmark:
        raise ValueError(f"{where}: field 'benchmark' is {record['benchmark']!r}, expected {benchmark!r}")
    if ("results" in record) == ("error" in record):
        raise ValueError(f"{where}: exactly one of the fields 'results' and 'error' is required")
    if "results" in record and not isinstance(record["results"], dict):
        raise ValueError(f"{where}: field 'results' is not an object")
    return record


def provenance(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Hardware, versions, git state and time range of `records` (each distinct value once)."""
    hardware, versions, shas, times = [], {}, [], []
    dirty = False
    for record in records:
        env = record["environment"]
        hw = env.get("hardware", {})
        described = describe_hardware(hw)
        if described not in hardware:
            hardware.append(described)
        for name, version in env.get("versions", {}).items():
            if version is not None and version not in versions.setdefault(name, []):
                versions[name].append(version)
        git = env.get("git", {})
        if git.get("sha") and git["sha"] not in shas:
            shas.append(git["sha"])
        dirty = dirty or bool(git.get("dirty"))
        if env.get("utc"):
            times.append(env["utc"])
    return {"hardware": hardware, "versions": versions, "git_shas": shas, "git_dirty": dirty,
            "utc_first": min(times) if times else None, "utc_last": max(times) if times else None}


def describe_hardware(hw: dict[str, Any]) -> str:
    gpus = hw.get("gpus") or []
    if gpus:
        names = sorted(set(gpus))
        device = ", ".join(f"{gpus.count(n)} x {n}" for n in names)
    else:
        device = "no GPU"
    return (f"{hw.get('cpu', '?')} ({hw.get('cpu_count', '?')} CPUs, {hw.get('memory_gib', '?')} GiB), {device}, "
            f"host {hw.get('hostname', '?')}")


def provenance_lines(records: list[dict[str, Any]]) -> list[str]:
    info = provenance(records)
    versions = ", ".join(f"{name} {'/'.join(map(str, v))}" for name, v in sorted(info["versions"].items()))
    shas = ", ".join(sha[:12] for sha in info["git_shas"]) or "unknown"
    return [
        "hardware: " + ("; ".join(info["hardware"]) or "unknown"),
        f"versions: {versions or 'unknown'}",
        f"git: {shas}{' (uncommitted changes)' if info['git_dirty'] else ''}; measured "
        f"{info['utc_first'] or '?'} .. {info['utc_last'] or '?'} UTC",
    ]


def get(data: dict[str, Any] | None, *keys: str) -> Any:
    """data[k0][k1]...; None when any level is missing."""
    for key in keys:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def format_value(value: Any, spec: str = ".4g", unit: str = "") -> str:
    """A table cell: a finite number formatted with `spec` (and `unit`), anything else as text."""
    return format(value, spec) + unit if is_number(value) else str(value)
