"""harts.report.records: loading and checking record files, provenance."""

from __future__ import annotations

import json

import pytest

from harts.report.records import load_records, provenance, provenance_lines

from .helpers import speedup_record, write


def test_load_json_and_jsonl(tmp_path):
    records = [speedup_record(step=0), speedup_record(step=1, error="RuntimeError: out of memory")]
    listed = write(tmp_path, "a.json", records)
    lines = write(tmp_path, "b.jsonl", records)
    assert load_records([listed, lines], "speedup") == records + records


BAD = {
    "not-a-list": ('{"benchmark": "speedup"}', "expected a JSON list"),
    "invalid-json": ("[{", "invalid JSON"),
    "not-an-object": ("[1]", "record 0: expected a JSON object"),
    "no-config": ('[{"benchmark": "speedup", "environment": {}, "results": {}}]', "field 'config'"),
    "other-benchmark": ('[{"benchmark": "planning", "config": {}, "environment": {}, "results": {}}]',
                        "field 'benchmark' is 'planning', expected 'speedup'"),
    "results-and-error": ('[{"benchmark": "speedup", "config": {}, "environment": {}, "results": {}, "error": "x"}]',
                          "exactly one of the fields 'results' and 'error'"),
    "neither": ('[{"benchmark": "speedup", "config": {}, "environment": {}}]', "exactly one of"),
    "results-not-object": ('[{"benchmark": "speedup", "config": {}, "environment": {}, "results": [1]}]',
                           "field 'results' is not an object"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_files_name_file_record_and_field(tmp_path, case):
    text, message = BAD[case]
    path = tmp_path / "records.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=str(path)) as error:
        load_records([path], "speedup")
    assert message in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("name, data, message", [
    ("records.jsonl", b'{"benchmark": "speedup"}\n\n{"benchmark": \n',
     "records.jsonl:3: invalid JSON (Expecting value at column 15)"),
    ("records.jsonl", b'{"benchmark": 1}\n{"benchmark": "caf\xe9"}\n',
     "records.jsonl:2: not UTF-8 text (byte 0xe9 at column 19: invalid continuation byte)"),
    ("records.json", b'[\n{"benchmark": "caf\xe9"}]',
     "records.json:2: not UTF-8 text (byte 0xe9 at column 19: invalid continuation byte)"),
], ids=["jsonl-line-3", "jsonl-not-utf8", "json-not-utf8"])
def test_unreadable_lines_are_named(tmp_path, name, data, message):
    """A JSONL error names its own line (json.loads of one line always said line 1); bytes that are not UTF-8 are a
    one-line error naming the file and line, not a UnicodeDecodeError."""
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(ValueError) as error:
        load_records([path], "speedup")
    assert str(error.value) == f"{tmp_path}/{message}"


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="no such records file"):
        load_records([tmp_path / "absent.json"], "speedup")


def test_provenance_collects_every_distinct_value():
    a, b = speedup_record(step=0), speedup_record(step=1)
    b["environment"] = json.loads(json.dumps(a["environment"]))
    a["environment"]["git"] = {"sha": "a" * 40, "dirty": False}
    b["environment"]["git"] = {"sha": "b" * 40, "dirty": True}
    b["environment"]["hardware"] = {**a["environment"]["hardware"], "gpus": ["NVIDIA H200"] * 2}
    a["environment"]["utc"], b["environment"]["utc"] = "2026-01-02T00:00:00+00:00", "2026-01-01T00:00:00+00:00"
    info = provenance([a, b])
    assert info["git_shas"] == ["a" * 40, "b" * 40] and info["git_dirty"] is True
    assert len(info["hardware"]) == 2 and "2 x NVIDIA H200" in info["hardware"][1]
    assert (info["utc_first"], info["utc_last"]) == ("2026-01-01T00:00:00+00:00", "2026-01-02T00:00:00+00:00")
    lines = provenance_lines([a, b])
    assert "aaaaaaaaaaaa, bbbbbbbbbbbb (uncommitted changes)" in lines[2]
