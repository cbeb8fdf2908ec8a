"""Hostile and unlucky inputs against the real `harts` command, one process each.

Every case builds its files in an empty folder, beside a previous good output (`out.npz`, `plan.json`), runs
`python -m harts ...` and checks what a user sees: exit status 2, exactly one line `harts: error: ...` naming the
file, record and field (compared whole), no traceback, and every file of the folder byte for byte as before
(nothing written, nothing lost, no temporary or lock left). The cases of issue #39 and new ones; kills and full
disks of each writing command are in tests/test_files.py and tests/training/test_checkpoint.py.

`python -m tests.test_hostile` prints the table of cases (command, message, exit status, files intact).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shlex
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from harts.trees.io import write_step
from tests.trees.helpers import make_step, save_word_tokenizer

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = (REPO / "configs/models/tiny.yaml").read_text()
TINY_TREES = (REPO / "configs/trees/tiny.yaml").read_text()


@dataclass(frozen=True)
class Case:
    setup: Callable[[Path], None]
    """Writes the case's input files into the folder."""
    argv: str
    """The command after `harts`, `{d}` standing for the folder."""
    message: str
    """The whole error line after `harts: error: `, `{d}` standing for the folder."""


def _text(name: str, text: str) -> Callable[[Path], None]:
    return lambda d: (d / name).write_text(text)


def _lines(name: str, *records: object) -> Callable[[Path], None]:
    return _text(name, "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))


def _model(**replace: str) -> Callable[[Path], None]:
    """The tiny model config with whole lines replaced (`key: value` lines, matched by their start)."""
    def setup(d: Path) -> None:
        lines = TINY_MODEL.splitlines()
        for start, line in replace.items():
            lines = [line if old.startswith(start) else old for old in lines]
        (d / "model.yaml").write_text("\n".join(lines) + "\n")
        _step(d)
    return setup


def _step(d: Path) -> None:
    (d / "step.jsonl").write_text("".join(json.dumps({"id": f"t{k}", "tokens": [1, 2, 3, k]}) + "\n" for k in range(3)))


def _npz_with(edit: Callable[[list[tuple[str, bytes]]], list[tuple[str, bytes]]]) -> Callable[[Path], None]:
    """A good two-trajectory step.npz whose (name, bytes) members `edit` rewrites."""
    def setup(d: Path) -> None:
        write_step(make_step([[1, 2, 3], [1, 2, 4]]), d / "step.npz")
        with zipfile.ZipFile(d / "step.npz") as archive:
            members = [(info.filename, archive.read(info)) for info in archive.infolist()]
        with zipfile.ZipFile(d / "step.npz", "w") as archive:
            for name, data in edit(members):
                archive.writestr(name, data)
    return setup


def _huge_tokens_header(members: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    """tokens.npy's header declares 2^40 elements (4 TiB of int32), its data stays 6 elements."""
    def edit(data: bytes) -> bytes:
        length = int.from_bytes(data[8:10], "little")
        header = data[10:10 + length].decode("latin1").replace("'shape': (6,)", f"'shape': ({2**40},)")
        return data[:10] + (header.rstrip("\n").ljust(length - 1) + "\n").encode("latin1") + data[10 + length:]
    return [(name, edit(data) if name == "tokens.npy" else data) for name, data in members]


def _second_tokens(members: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    return [*members, next(m for m in members if m[0] == "tokens.npy")]


def _gzip_bomb(d: Path) -> None:
    """One line of 257 MiB in a 260 KB gzip file."""
    with gzip.open(d / "step.jsonl.gz", "wb", compresslevel=1) as handle:
        handle.write(b'{"id": "a", "tokens": [')
        chunk = b"1, " * (1 << 20)
        for _ in range(86):
            handle.write(chunk)


def _chat(name: str, *messages_or_records: dict) -> Callable[[Path], None]:
    return _lines(name, *messages_or_records)


def _tokenizer(vocab: dict[str, int], unk: str | None) -> Callable[[Path], None]:
    def setup(d: Path) -> None:
        save_word_tokenizer(d / "tokenizer.json", vocab, unk)
        _chat("logs.jsonl", {"messages": [{"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": "yo zz"}]})(d)
    return setup


ROLE_WORDS = {"system": 0, "user": 1, "assistant": 2, "tool": 3, "hi": 4, "yo": 5}
HI = [{"role": "user", "content": "hi"}]
PLAN = "plan microbatches {d}/step.jsonl --capacity 64 --dp 1 --out {d}/plan.json"
INGEST = "trees ingest --format messages --tokenizer byte {d}/logs.jsonl {d}/out.npz"
TRAIN_STEP = "train-step --model {d}/model.yaml --trees {d}/step.jsonl --capacity 64 --execution compact"

CASES: dict[str, Case] = {
    # Issue #39: outputs that are inputs.
    "ingest-over-its-logs": Case(
        _chat("logs.jsonl", {"messages": HI}),
        "trees ingest --format messages --tokenizer byte {d}/logs.jsonl {d}/logs.jsonl",
        "harts trees ingest: output {d}/logs.jsonl is its input {d}/logs.jsonl (it would be overwritten)"),
    "plan-over-its-step": Case(
        _step, "plan microbatches {d}/step.jsonl --capacity 64 --dp 1 --out {d}/step.jsonl",
        "harts plan microbatches: output {d}/step.jsonl is its input {d}/step.jsonl (it would be overwritten)"),
    "bench-over-its-step": Case(
        _step, "bench speedup --model tiny --trees {d}/step.jsonl --out {d}/step.jsonl",
        "harts bench speedup: output {d}/step.jsonl is its input {d}/step.jsonl (it would be overwritten)"),
    # Issue #39: YAML.
    "yaml-alias-bomb": Case(
        _text("trees.yaml", "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
            f"{chr(98 + k)}: &{chr(98 + k)} [{', '.join([f'*{chr(97 + k)}'] * 9)}]\n" for k in range(8))),
        "trees synth --config {d}/trees.yaml --out {d}/steps",
        "{d}/trees.yaml: invalid YAML (line 2: YAML aliases (*a) are not accepted)"),
    "yaml-duplicate-key": Case(
        _text("trees.yaml", TINY_TREES + "num_tasks: 3\n"), "trees synth --config {d}/trees.yaml --out {d}/steps",
        "{d}/trees.yaml: invalid YAML (line 19: duplicate key 'num_tasks')"),
    "yaml-huge-integer": Case(
        _text("trees.yaml", TINY_TREES.replace("num_tasks: 2", f"num_tasks: {2**70}")),
        "trees synth --config {d}/trees.yaml --out {d}/steps",
        "{d}/trees.yaml: invalid YAML (line 3: integer 1180591620717411303424 is too large (at most 2^62 - 1))"),
    "yaml-python-tag": Case(
        _text("trees.yaml", "num_tasks: !!python/object/apply:os.system ['touch pwned']\n"),
        "trees synth --config {d}/trees.yaml --out {d}/steps",
        "{d}/trees.yaml: invalid YAML (line 1: could not determine a constructor for the tag "
        "'tag:yaml.org,2002:python/object/apply:os.system')"),
    # Issue #39: sizes and tokenizers.
    "npz-declaring-4-TiB": Case(
        _npz_with(_huge_tokens_header), "trees validate {d}/step.npz",
        "{d}/step.npz: field 'tokens': the array header declares int32 [1099511627776] (4,398,046,511,104 bytes), "
        "the member holds 36 bytes"),
    "ingest-million-character-id": Case(
        _chat("logs.jsonl", {"id": "x" * 1_000_000, "messages": HI}), INGEST,
        "{d}/logs.jsonl:1: field 'id': 1,000,000 characters (at most 1024)"),
    "dp-near-2^62": Case(
        _step, "plan microbatches {d}/step.jsonl --capacity 64 --dp 4611686018427387903 --out {d}/plan.json",
        "dp must be between 1 and 1,048,576, got 4,611,686,018,427,387,903"),
    "lone-surrogate": Case(
        _chat("logs.jsonl", {"messages": [{"role": "user", "content": "hi \ud800"}]}), INGEST,
        "{d}/logs.jsonl:1: message 0: field 'content': '\\ud800' at character 3 is a lone surrogate, not text"),
    "tokenizer-without-unk": Case(
        _tokenizer(ROLE_WORDS, None),
        "trees ingest --format messages --tokenizer {d}/tokenizer.json {d}/logs.jsonl {d}/out.npz",
        "{d}/logs.jsonl:1: message 1: field 'content': the tokenizer failed "
        "(WordLevel error: Missing [UNK] token from the vocabulary)"),
    "tokenizer-id-beyond-int32": Case(
        _tokenizer({**ROLE_WORDS, "[UNK]": 6, "far": 2**31 + 5}, "[UNK]"),
        "trees ingest --format messages --tokenizer {d}/tokenizer.json {d}/logs.jsonl {d}/out.npz",
        "{d}/tokenizer.json: token 'far' has id 2,147,483,653, more than a step's int32 tokens hold"),
    # Issue #39: numeric and format sanity.
    "ref-logprob-minus-3e38": Case(
        _lines("step.jsonl", {"id": "a", "tokens": [1, 2, 3], "ref_logprobs": [0.0, -3e38, -1.0]}), PLAN,
        "{d}/step.jsonl:1: field 'ref_logprobs': log-probabilities must be in [-10000, 0], got -3e+38 "
        "at index 1"),
    "npz-member-twice": Case(
        _npz_with(_second_tokens), "trees validate {d}/step.npz",
        "{d}/step.npz: field 'tokens': the archive holds it twice"),
    "id-with-nul": Case(
        _lines("step.jsonl", {"id": "a\u0000", "tokens": [1, 2]}), PLAN,
        "{d}/step.jsonl:1: field 'id': control character '\\x00' in 'a\\x00'"),
    "model-zero-heads": Case(
        _model(**{"kda:": "kda: {num_heads: 0, head_dim: 16, conv_size: 4, gate_rank: 16, chunk_size: 16}"}),
        TRAIN_STEP, "{d}/model.yaml: kda.num_heads must be a positive integer, got 0"),
    "model-nan-epsilon": Case(
        _model(**{"name:": "name: tiny\nnorm_eps: .nan"}), TRAIN_STEP,
        "{d}/model.yaml: model.norm_eps must be a finite number in (0, 1), got nan"),
    # New: nesting, sizes and bombs.
    "yaml-nested-100k-deep": Case(
        _text("trees.yaml", "a: " + "[" * 100_000 + "]" * 100_000 + "\n"),
        "trees synth --config {d}/trees.yaml --out {d}/steps",
        "{d}/trees.yaml: invalid YAML (line 1: nested deeper than 64 levels)"),
    "json-nested-200k-deep": Case(
        _lines("step.jsonl", '{"id": "a", "tokens": ' + "[" * 200_000 + "]" * 200_000 + "}"), PLAN,
        "{d}/step.jsonl:1: invalid JSON (nested too deeply)"),
    "json-5000-digit-token": Case(
        _lines("step.jsonl", '{"id": "a", "tokens": [1, ' + "9" * 5000 + "]}"), PLAN,
        "{d}/step.jsonl:1: invalid JSON (Exceeds the limit (4300 digits) for integer string conversion: "
        "value has 5000 digits)"),
    "gzip-bomb-one-line": Case(
        _gzip_bomb, "trees validate {d}/step.jsonl.gz",
        "{d}/step.jsonl.gz:1: line longer than 256 MiB (a trajectory's line holds a few bytes per token)"),
    "synth-2^52-tokens": Case(
        _text("trees.yaml", TINY_TREES.replace("num_tasks: 2", "num_tasks: 1000000000000")),
        "trees synth --config {d}/trees.yaml --out {d}/steps",
        "{d}/trees.yaml: num_tasks × max_branches_per_task × max_tokens = 4,096,000,000,000,000 tokens a step may "
        "hold, more than 17,179,869,184 (2^34)"),
    # New: paths.
    "output-under-a-file": Case(
        _step, "plan microbatches {d}/step.jsonl --capacity 64 --dp 1 --out {d}/out.npz/plan.json",
        "{d}/out.npz/plan.json: cannot be written: {d}/out.npz is a file, not a folder"),
    "output-is-a-folder": Case(
        lambda d: (_step(d), (d / "folder").mkdir()),
        "plan microbatches {d}/step.jsonl --capacity 64 --dp 1 --out {d}/folder",
        "{d}/folder: could not write (Is a directory)"),
    "symlink-loop": Case(
        lambda d: ((d / "a.jsonl").symlink_to("b.jsonl"), (d / "b.jsonl").symlink_to("a.jsonl")),
        "trees validate {d}/a.jsonl", "{d}/a.jsonl: symbolic link loop (through 'b.jsonl')"),
    "fifo-input": Case(
        lambda d: os.mkfifo(d / "step.jsonl"), "trees validate {d}/step.jsonl", "{d}/step.jsonl: not a regular file"),
    "stdout-on-a-full-disk": Case(
        _step, "plan microbatches {d}/step.jsonl --capacity 64 --dp 1 --json >/dev/full",
        "could not write to standard output (No space left on device)"),
}


def _digests(folder: Path) -> dict[str, str]:
    """Every entry of the folder (links and FIFOs by what they are, files by their sha256)."""
    result = {}
    for path in sorted(folder.rglob("*")):
        if path.is_symlink():
            result[str(path.relative_to(folder))] = f"link to {os.readlink(path)}"
        elif path.is_file():
            result[str(path.relative_to(folder))] = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        else:
            result[str(path.relative_to(folder))] = "folder" if path.is_dir() else "special"
    return result


def run_case(name: str, folder: Path) -> tuple[str, subprocess.CompletedProcess, dict, dict]:
    """(command line, the finished process, the folder's digests before and after)."""
    case = CASES[name]
    write_step(make_step([[5, 6, 7]]), folder / "out.npz")
    (folder / "plan.json").write_text('{"previous": "output"}\n')
    case.setup(folder)
    before = _digests(folder)
    command = "harts " + case.argv.format(d=folder)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("HARTS_DEBUG", None)
    shell = f"{shlex.quote(sys.executable)} -m {command.replace('{', '{{')}"
    process = subprocess.run(shell, shell=True, cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    return command, process, before, _digests(folder)


@pytest.mark.filterwarnings("ignore:Duplicate name")  # zipfile's, while the npz-member-twice case is made
@pytest.mark.parametrize("name", CASES)
def test_hostile_input_is_one_line_and_changes_nothing(name, tmp_path):
    command, process, before, after = run_case(name, tmp_path)
    assert "Traceback" not in process.stderr, process.stderr[-3000:]
    assert process.stderr == f"harts: error: {CASES[name].message.format(d=tmp_path)}\n"
    assert process.returncode == 2
    assert after == before
    assert not (tmp_path / "pwned").exists()


def _table() -> str:
    import tempfile

    rows = ["| case | command | what it prints | exit | files before = after |", "| --- | --- | --- | --- | --- |"]
    for name in CASES:
        with tempfile.TemporaryDirectory() as folder:
            command, process, before, after = run_case(name, Path(folder))
            shown = process.stderr.strip().replace(folder, "D").replace("|", "\\|")
            command = command.replace(folder, "D").replace("|", "\\|")
            if len(command) > 110:
                command = command[:107] + "..."
            intact = f"{len(before)} entries, sha256 equal" if before == after else "CHANGED"
            rows.append(f"| {name} | `{command}` | `{shown}` | {process.returncode} | {intact} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(_table())
