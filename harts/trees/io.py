"""Reading and writing steps: JSONL (plain or gzip, one file or a directory) and `.npz`.

JSONL record, one trajectory per line (docs/inputs.md "Trajectory input"):

    {"id": str, "tree": str, "tokens": [int >= 0], "loss_mask": [0|1], "advantage": float | [float],
     "reward": float, "old_logprobs": [float], "ref_logprobs": [float]}

`id` and `tokens` are required. Defaults: tree = the trajectory's own id; loss_mask = 0 for
token 0 and 1 for every other token; advantage = 0.0; reward = 0.0; old_logprobs/ref_logprobs
absent (then absent for the whole step: a field given on some lines and not on others is an
error). Per-token lists have the length of `tokens`; `loss_mask[0]` must be 0 (DESIGN §5).

The `.npz` form holds the same fields as flat arrays (`Step`'s attributes) and loads without
pickle. A directory is one step: every `*.jsonl`, `*.jsonl.gz` and `*.npz` in it, by name (an
entry with such a name that is not a readable file, e.g. a dangling symbolic link, is an error).

Every malformed input raises `TrajectoryFormatError` (a ValueError) whose message is one line
naming the file, the line (or trajectory) and the field. Nothing is dropped or coerced: a JSON
object that gives a key twice, a number that does not fit the float32 it is stored in, invalid
UTF-8, a corrupt or truncated gzip stream and a damaged `.npz` archive are all refused.
`read_lines`, `read_text`, `parse_json`, `float_field` and `input_files` are shared with
`harts.trees.ingest`. Tested against hand-made bad inputs (tests/data/bad_inputs, tests/trees).
"""

from __future__ import annotations

import errno
import gzip
import io
import json
import math
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from harts.files import atomic_open
from harts.trees.step import LOGPROB_FLOOR, TOKEN_DTYPE, Step, check_name

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
NPZ_SUFFIX = ".npz"
NPZ_FORMAT_VERSION = 1
FIELDS = ("id", "tree", "tokens", "loss_mask", "advantage", "reward", "old_logprobs", "ref_logprobs")
OPTIONAL_TOKEN_FIELDS = ("old_logprobs", "ref_logprobs")
FLOAT32_MAX = float(np.finfo(np.float32).max)
INT64_MAX = int(np.iinfo(np.int64).max)


MAX_LINE_BYTES = 256 << 20
"""The longest JSONL line read: about 3 million tokens with every per-token field; a longer line (a gzip bomb
of one line expands 1,000-fold) is refused before it is held in memory."""


class TrajectoryFormatError(ValueError):
    """A malformed trajectory input; the message names file, line or record, and field."""


def step_files(path: str | Path) -> list[Path]:
    """The files that make up the step at `path` (a file, or a directory of them)."""
    return input_files(Path(path), (*JSONL_SUFFIXES, NPZ_SUFFIX))


def input_files(path: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """`path` itself, or every entry of the directory `path` whose name ends in one of `suffixes`.

    An entry with such a name that is not a regular file (a dangling symbolic link, a directory)
    is an error rather than skipped: a step or log set that silently lost a file looks complete.
    """
    expected = ", ".join(f"*{suffix}" for suffix in suffixes)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.name.endswith(suffixes))
        if not files:
            raise TrajectoryFormatError(f"{path}: directory holds no {expected} file")
        for file in files:
            if not file.is_file():
                raise TrajectoryFormatError(f"{file}: {_not_a_file(file)}")
        return files
    if not path.exists():
        raise TrajectoryFormatError(f"{path}: {_not_a_file(path)}")
    if not path.name.endswith(suffixes):
        raise TrajectoryFormatError(f"{path}: unknown file type (expected {expected})")
    if not path.is_file():
        raise TrajectoryFormatError(f"{path}: {_not_a_file(path)}")
    return [path]


def _not_a_file(path: Path) -> str:
    if path.is_symlink() and not path.exists():
        try:
            path.resolve(strict=True)
        except RuntimeError:  # pathlib's "Symlink loop"
            return f"symbolic link loop (through {str(path.readlink())!r})"
        except OSError as error:
            if error.errno == errno.ELOOP:
                return f"symbolic link loop (through {str(path.readlink())!r})"
        return f"dangling symbolic link (its target {str(path.readlink())!r} does not exist)"
    if not path.exists():
        return "no such file or directory"
    if path.is_dir():
        return "a directory, not a file"
    return "not a regular file"


def read_step(path: str | Path, *, vocab_size: int | None = None) -> Step:
    """Read and validate one step from a file or a directory."""
    parts = [
        _read_npz(f) if f.name.endswith(NPZ_SUFFIX) else _read_jsonl(f)
        for f in step_files(path)
    ]
    step = parts[0] if len(parts) == 1 else _concatenate(parts, str(path))
    if vocab_size is not None:
        check_vocabulary(step, vocab_size)
    return step


def check_vocabulary(step: Step, vocab_size: int) -> None:
    """Raise if any token id is >= vocab_size, naming the first offending trajectory."""
    bad = np.flatnonzero(step.tokens >= vocab_size)
    if len(bad):
        k = int(np.searchsorted(step.offsets, bad[0], side="right") - 1)
        i = int(bad[0] - step.offsets[k])
        raise TrajectoryFormatError(
            f"{step.source}: trajectory {step.ids[k]!r}: field 'tokens': token {int(step.tokens[bad[0]])} "
            f"at position {i} is >= the vocabulary size {vocab_size}"
        )


def read_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text without its line break) of every line of a UTF-8 file, gunzipped when
    the name ends in .gz.

    Lines are decoded one by one, so invalid UTF-8 is reported with its line; a corrupt or truncated
    gzip stream is reported with the first line that could not be read.
    """
    line_number = 0
    try:
        with gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb") as handle:
            while raw := handle.readline(MAX_LINE_BYTES + 1):
                line_number += 1
                if len(raw) > MAX_LINE_BYTES:
                    raise TrajectoryFormatError(
                        f"{path}:{line_number}: line longer than {MAX_LINE_BYTES >> 20} MiB (a trajectory's line "
                        "holds a few bytes per token)"
                    )
                yield line_number, _decode(raw.rstrip(b"\r\n"), path, line_number)
    except EOFError:
        raise TrajectoryFormatError(
            f"{path}:{line_number + 1}: truncated gzip data (the file ends before the end-of-stream marker)"
        ) from None
    except (gzip.BadGzipFile, zlib.error) as error:
        raise TrajectoryFormatError(f"{path}:{line_number + 1}: corrupt gzip data ({error})") from None
    except OSError as error:
        raise TrajectoryFormatError(f"{path}: cannot read ({error.strerror or error})") from None


def read_text(path: Path) -> str:
    """The whole UTF-8 file; invalid UTF-8 is reported with its line."""
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise TrajectoryFormatError(f"{path}: cannot read ({error.strerror or error})") from None
    return _decode(raw, path, 1)


def _decode(raw: bytes, path: Path, first_line: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = first_line + raw.count(b"\n", 0, error.start)
        column = error.start - raw.rfind(b"\n", 0, error.start)
        raise TrajectoryFormatError(
            f"{path}:{line}: not UTF-8 text (byte 0x{raw[error.start]:02x} at column {column}: {error.reason})"
        ) from None


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    record = dict(pairs)
    if len(record) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return record


def parse_json(text: str, path: Path | str, line: int = 1) -> object:
    """`text` (starting on `line` of `path`) as JSON; a key given twice in one object is an error.

    Python's json keeps the last of duplicate keys without a word, so a record with two `reward`s
    would lose one silently.
    """
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as error:
        raise TrajectoryFormatError(
            f"{path}:{line + error.lineno - 1}: invalid JSON ({error.msg} at column {error.colno})"
        ) from None
    except _DuplicateKey as duplicate:
        raise TrajectoryFormatError(
            f"{path}:{line}: field '{duplicate.key}': duplicate key (a JSON object gives it twice)"
        ) from None
    except RecursionError:
        raise TrajectoryFormatError(f"{path}:{line}: invalid JSON (nested too deeply)") from None
    except ValueError as error:  # an integer literal beyond Python's int/str conversion limit
        raise TrajectoryFormatError(f"{path}:{line}: invalid JSON ({str(error).split(';')[0]})") from None


def float_field(value: object, where: str, name: str) -> float:
    """A JSON number stored as float32: finite and within the float32 range (no silent inf)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TrajectoryFormatError(f"{where}: field '{name}': expected a number")
    if isinstance(value, float) and not math.isfinite(value):
        raise TrajectoryFormatError(f"{where}: field '{name}': non-finite value {value}")
    if abs(value) > FLOAT32_MAX:
        raise TrajectoryFormatError(f"{where}: field '{name}': {_describe(value)} is outside the float32 range")
    return float(value)


def _describe(value: object) -> str:
    """A number for a message; huge integers by their digit count."""
    if isinstance(value, int) and abs(value) >= 10**20:
        return f"an integer of {len(str(abs(value)))} digits"
    return f"{value:g}" if isinstance(value, float) else repr(value)


class _Collector:
    """Accumulates validated records of one JSONL file into flat arrays."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.ids: list[str] = []
        self.trees: list[str] = []
        self.lengths: list[int] = []
        self.tokens: list[np.ndarray] = []
        self.loss_mask: list[np.ndarray] = []
        self.rewards: list[float] = []
        self.advantages: list[float | np.ndarray] = []
        self.optional: dict[str, list[np.ndarray]] = {}
        self.optional_first_line: dict[str, int] = {}
        self.seen: dict[str, int] = {}


def _read_jsonl(path: Path) -> Step:
    acc = _Collector(str(path))
    for line_number, line in read_lines(path):
        if not line.strip():
            raise TrajectoryFormatError(f"{path}:{line_number}: empty line")
        _parse_record(acc, line, line_number)
    if not acc.ids:
        raise TrajectoryFormatError(f"{path}: no trajectories")
    for name, first in acc.optional_first_line.items():
        if len(acc.optional[name]) != len(acc.ids):
            raise TrajectoryFormatError(
                f"{path}: field '{name}' is given on line {first} but not on every line "
                "(give it for every trajectory of the step or for none)"
            )
    return _build_step(acc)


def _parse_record(acc: _Collector, line: str, line_number: int) -> None:
    where = f"{acc.where}:{line_number}"
    record = parse_json(line, acc.where, line_number)
    if not isinstance(record, dict):
        raise TrajectoryFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")
    unknown = sorted(set(record) - set(FIELDS))
    if unknown:
        raise TrajectoryFormatError(
            f"{where}: field '{unknown[0]}': unknown field (allowed: {', '.join(FIELDS)})"
        )
    may_hold_bools = "true" in line or "false" in line

    trajectory_id = record.get("id")
    if trajectory_id is None:
        raise TrajectoryFormatError(f"{where}: field 'id': missing")
    if not isinstance(trajectory_id, str) or not trajectory_id:
        raise TrajectoryFormatError(f"{where}: field 'id': expected a non-empty string")
    name_field(trajectory_id, where, "id")
    if trajectory_id in acc.seen:
        raise TrajectoryFormatError(
            f"{where}: field 'id': duplicate id {trajectory_id!r} (first on line {acc.seen[trajectory_id]})"
        )
    tree = record.get("tree", trajectory_id)
    if not isinstance(tree, str) or not tree:
        raise TrajectoryFormatError(f"{where}: field 'tree': expected a non-empty string")
    name_field(tree, where, "tree")

    if "tokens" not in record:
        raise TrajectoryFormatError(f"{where}: field 'tokens': missing")
    tokens = _int_array(record["tokens"], where, "tokens", may_hold_bools)
    if len(tokens) == 0:
        raise TrajectoryFormatError(f"{where}: field 'tokens': empty")
    if tokens.min() < 0:
        raise TrajectoryFormatError(f"{where}: field 'tokens': negative token {int(tokens.min())}")
    if tokens.max() > np.iinfo(TOKEN_DTYPE).max:
        raise TrajectoryFormatError(f"{where}: field 'tokens': token {int(tokens.max())} exceeds int32")
    length = len(tokens)

    if "loss_mask" in record:
        loss_mask = _int_array(record["loss_mask"], where, "loss_mask", may_hold_bools)
        _check_length(loss_mask, length, where, "loss_mask")
        if ((loss_mask != 0) & (loss_mask != 1)).any():
            raise TrajectoryFormatError(f"{where}: field 'loss_mask': values must be 0 or 1")
        if loss_mask[0] != 0:
            raise TrajectoryFormatError(
                f"{where}: field 'loss_mask': loss_mask[0] must be 0 (nothing predicts the first token)"
            )
        loss_mask = loss_mask.astype(np.uint8)
    else:
        loss_mask = np.ones(length, dtype=np.uint8)
        loss_mask[0] = 0

    advantage = record.get("advantage", 0.0)
    if isinstance(advantage, list):
        advantage = _float_array(advantage, where, "advantage", may_hold_bools)
        _check_length(advantage, length, where, "advantage")
    else:
        advantage = float_field(advantage, where, "advantage")
    reward = float_field(record.get("reward", 0.0), where, "reward")

    for name in OPTIONAL_TOKEN_FIELDS:
        if name in record:
            values = _float_array(record[name], where, name, may_hold_bools)
            _check_length(values, length, where, name)
            outside = np.flatnonzero((values > 0) | (values < LOGPROB_FLOOR))
            if len(outside):
                raise TrajectoryFormatError(f"{where}: field '{name}': log-probabilities must be in "
                                            f"[{LOGPROB_FLOOR:g}, 0], got {values[outside[0]]:g} at index {outside[0]}")
            acc.optional_first_line.setdefault(name, line_number)
            if len(acc.optional.setdefault(name, [])) != len(acc.ids):
                raise TrajectoryFormatError(
                    f"{where}: field '{name}': given here but missing on an earlier line "
                    "(give it for every trajectory of the step or for none)"
                )
            acc.optional[name].append(values)
        elif name in acc.optional:
            raise TrajectoryFormatError(
                f"{where}: field '{name}': missing here but given on line {acc.optional_first_line[name]} "
                "(give it for every trajectory of the step or for none)"
            )

    acc.seen[trajectory_id] = line_number
    acc.ids.append(trajectory_id)
    acc.trees.append(tree)
    acc.lengths.append(length)
    acc.tokens.append(tokens.astype(TOKEN_DTYPE))
    acc.loss_mask.append(loss_mask)
    acc.rewards.append(reward)
    acc.advantages.append(advantage)


def _int_array(values: object, where: str, name: str, may_hold_bools: bool) -> np.ndarray:
    if not isinstance(values, list):
        raise TrajectoryFormatError(f"{where}: field '{name}': expected a list of integers")
    if may_hold_bools and any(type(v) is bool for v in values):
        raise TrajectoryFormatError(f"{where}: field '{name}': booleans are not integers")
    try:
        array = np.asarray(values)
    except (ValueError, OverflowError):
        raise TrajectoryFormatError(f"{where}: field '{name}': expected a flat list of integers") from None
    if array.ndim != 1:
        raise TrajectoryFormatError(f"{where}: field '{name}': expected a flat list of integers")
    if len(values) and (array.dtype.kind not in "iu" or (array.dtype.kind == "u" and array.max() > INT64_MAX)):
        # numpy stores integers beyond int64 as uint64, float64 or objects: find the culprit.
        k, value = next(
            (k, v) for k, v in enumerate(values) if type(v) is not int or not -INT64_MAX - 1 <= v <= INT64_MAX
        )
        if type(value) is int:
            raise TrajectoryFormatError(
                f"{where}: field '{name}': {_describe(value)} at position {k} is outside the int64 range"
            )
        raise TrajectoryFormatError(
            f"{where}: field '{name}': non-integer value {value!r} at position {k} (expected integers)"
        )
    return array.astype(np.int64, copy=False)


def _float_array(values: object, where: str, name: str, may_hold_bools: bool) -> np.ndarray:
    if not isinstance(values, list):
        raise TrajectoryFormatError(f"{where}: field '{name}': expected a list of numbers")
    if may_hold_bools and any(type(v) is bool for v in values):
        raise TrajectoryFormatError(f"{where}: field '{name}': booleans are not numbers")
    try:
        array = np.asarray(values, dtype=np.float64)
    except OverflowError:  # an integer beyond the float64 range
        k, value = next((k, v) for k, v in enumerate(values) if type(v) is int and abs(v) > FLOAT32_MAX)
        raise TrajectoryFormatError(
            f"{where}: field '{name}': {_describe(value)} at position {k} is outside the float32 range"
        ) from None
    except (ValueError, TypeError):
        raise TrajectoryFormatError(f"{where}: field '{name}': expected a flat list of numbers") from None
    if array.ndim != 1:
        raise TrajectoryFormatError(f"{where}: field '{name}': expected a flat list of numbers")
    bad = ~np.isfinite(array)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise TrajectoryFormatError(f"{where}: field '{name}': non-finite value {array[k]} at position {k}")
    bad = np.abs(array) > FLOAT32_MAX
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise TrajectoryFormatError(
            f"{where}: field '{name}': {_describe(values[k])} at position {k} is outside the float32 range"
        )
    return array.astype(np.float32)


def _check_length(array: np.ndarray, length: int, where: str, name: str) -> None:
    if array.ndim != 1:
        raise TrajectoryFormatError(f"{where}: field '{name}': expected a flat list")
    if len(array) != length:
        raise TrajectoryFormatError(
            f"{where}: field '{name}': length {len(array)} does not match tokens' length {length}"
        )


def _build_step(acc: _Collector) -> Step:
    offsets = np.zeros(len(acc.ids) + 1, dtype=np.int64)
    np.cumsum(acc.lengths, out=offsets[1:])
    if all(not isinstance(a, np.ndarray) for a in acc.advantages):
        per_trajectory = np.asarray(acc.advantages, dtype=np.float32)
        per_token = None
    else:
        per_trajectory = None
        per_token = np.concatenate([
            a if isinstance(a, np.ndarray) else np.full(n, a, dtype=np.float32)
            for a, n in zip(acc.advantages, acc.lengths)
        ])
    optional = {name: np.concatenate(values) for name, values in acc.optional.items()}
    return Step(
        ids=tuple(acc.ids),
        trees=tuple(acc.trees),
        offsets=offsets,
        tokens=np.concatenate(acc.tokens),
        loss_mask=np.concatenate(acc.loss_mask),
        rewards=np.asarray(acc.rewards, dtype=np.float32),
        advantage_per_trajectory=per_trajectory,
        advantage_per_token=per_token,
        old_logprobs=optional.get("old_logprobs"),
        ref_logprobs=optional.get("ref_logprobs"),
        source=acc.where,
    )


def _concatenate(parts: list[Step], source: str) -> Step:
    seen: dict[str, str] = {}
    for part in parts:
        for trajectory_id in part.ids:
            if trajectory_id in seen:
                raise TrajectoryFormatError(
                    f"{part.source}: field 'id': duplicate id {trajectory_id!r} (also in {seen[trajectory_id]})"
                )
            seen[trajectory_id] = part.source
    for name in OPTIONAL_TOKEN_FIELDS:
        present = [getattr(p, name) is not None for p in parts]
        if any(present) and not all(present):
            with_field = parts[present.index(True)].source
            without = parts[present.index(False)].source
            raise TrajectoryFormatError(
                f"{without}: field '{name}': missing here but given in {with_field} "
                "(give it for every trajectory of the step or for none)"
            )
    lengths = np.concatenate([p.lengths for p in parts])
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    scalar_advantages = all(p.advantage_per_trajectory is not None for p in parts)

    def joined(name: str) -> np.ndarray | None:
        values = [getattr(p, name) for p in parts]
        return None if values[0] is None else np.concatenate(values)

    return Step(
        ids=tuple(i for p in parts for i in p.ids),
        trees=tuple(t for p in parts for t in p.trees),
        offsets=offsets,
        tokens=np.concatenate([p.tokens for p in parts]),
        loss_mask=np.concatenate([p.loss_mask for p in parts]),
        rewards=np.concatenate([p.rewards for p in parts]),
        advantage_per_trajectory=joined("advantage_per_trajectory") if scalar_advantages else None,
        advantage_per_token=None if scalar_advantages else np.concatenate([p.advantages() for p in parts]),
        old_logprobs=joined("old_logprobs"),
        ref_logprobs=joined("ref_logprobs"),
        source=source,
    )


_NPZ_ARRAYS = {
    "offsets": (np.int64, "N+1"),
    "tokens": (TOKEN_DTYPE, "S"),
    "loss_mask": (np.uint8, "S"),
    "rewards": (np.float32, "N"),
    "advantage_per_trajectory": (np.float32, "N"),
    "advantage_per_token": (np.float32, "S"),
    "old_logprobs": (np.float32, "S"),
    "ref_logprobs": (np.float32, "S"),
}


# What a damaged zip archive raises while numpy opens it or reads a member (zipfile raises
# RuntimeError for a member flagged as encrypted, NotImplementedError for an unknown compression).
_NPZ_READ_ERRORS = (
    OSError, ValueError, EOFError, zipfile.BadZipFile, NotImplementedError, RuntimeError, zlib.error
)
_PER_TOKEN = ("tokens", "loss_mask", "advantage_per_token", "old_logprobs", "ref_logprobs")


def name_field(value: str, where: str, field: str) -> None:
    """`check_name` raising TrajectoryFormatError."""
    try:
        check_name(value, where, field)
    except ValueError as error:
        raise TrajectoryFormatError(str(error)) from None


def _open_npz(path: Path) -> np.lib.npyio.NpzFile:
    """The archive, after checking that the file is a zip archive at all.

    np.load guesses the format from the first bytes and falls back to unpickling, so a text file
    would be reported as "pickled data" and a renamed .npy would load as a bare array.
    """
    try:
        with open(path, "rb") as handle:
            magic = handle.read(6)
    except OSError as error:
        raise TrajectoryFormatError(f"{path}: cannot read ({error.strerror or error})") from None
    if not magic:
        raise TrajectoryFormatError(f"{path}: empty file (expected an .npz archive)")
    if magic.startswith(b"\x93NUMPY"):
        raise TrajectoryFormatError(
            f"{path}: a single .npy array, not an .npz archive (an .npz step holds named arrays: ids, tokens, ...)"
        )
    if not magic.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        raise TrajectoryFormatError(
            f"{path}: not an .npz archive (an .npz file is a zip archive; this file starts with {magic!r})"
        )
    try:
        return np.load(path, allow_pickle=False)
    except _NPZ_READ_ERRORS as error:
        raise TrajectoryFormatError(f"{path}: truncated or corrupt .npz archive ({error})") from None


DEFLATE_MAX_RATIO = 1032
"""Deflate expands a compressed byte into at most 1,032 bytes; a member claiming more is not deflate output."""


def _npz_member_problem(archive: np.lib.npyio.NpzFile, name: str) -> str | None:
    """Why the member cannot be read safely: its array header or zip entry declares more bytes than it holds.

    numpy allocates the array its header declares before reading any data, so a 30 KB file whose header
    says 4 TiB would be a MemoryError; here the header must describe exactly the member's uncompressed
    bytes, and those must be reachable from its compressed bytes (numpy writes stored or deflated members).
    """
    info = archive.zip.getinfo(f"{name}.npy")
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        return f"compression method {info.compress_type} (numpy writes stored or deflated members)"
    limit = info.compress_size * (1 if info.compress_type == zipfile.ZIP_STORED else DEFLATE_MAX_RATIO)
    if info.file_size > limit:
        return (
            f"the zip entry declares {info.file_size:,} bytes from {info.compress_size:,} compressed bytes "
            f"(at most {limit:,})"
        )
    with archive.zip.open(info) as member:
        version = np.lib.format.read_magic(member)
        if version not in ((1, 0), (2, 0)):
            return f".npy format version {version[0]}.{version[1]} (numpy writes 1.0 or 2.0 for these arrays)"
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read_header(member)
        data_size = info.file_size - member.tell()
    declared = math.prod(shape) * dtype.itemsize
    if declared != data_size:
        return (
            f"the array header declares {dtype.name} {list(shape)} ({declared:,} bytes), "
            f"the member holds {data_size:,} bytes"
        )
    return None


def _npz_array(archive: np.lib.npyio.NpzFile, name: str, where: str) -> np.ndarray:
    try:
        problem = _npz_member_problem(archive, name)
        if problem is None:
            return archive[name]
    except _NPZ_READ_ERRORS as error:
        raise TrajectoryFormatError(f"{where}: field '{name}': cannot read the array ({error})") from None
    raise TrajectoryFormatError(f"{where}: field '{name}': {problem}")


def _read_npz(path: Path) -> Step:
    where = str(path)
    with _open_npz(path) as archive:
        repeated = sorted({name for name in archive.files if archive.files.count(name) > 1})
        if repeated:
            raise TrajectoryFormatError(f"{where}: field '{repeated[0]}': the archive holds it twice")
        names = set(archive.files)
        unknown = sorted(names - set(_NPZ_ARRAYS) - {"ids", "trees", "format_version"})
        if unknown:
            raise TrajectoryFormatError(f"{where}: field '{unknown[0]}': unknown array")
        for required in ("format_version", "ids", "trees", "offsets", "tokens", "loss_mask", "rewards"):
            if required not in names:
                raise TrajectoryFormatError(f"{where}: field '{required}': missing")
        version = _npz_array(archive, "format_version", where)
        ids = _npz_array(archive, "ids", where)
        trees = _npz_array(archive, "trees", where)
        arrays = {name: _npz_array(archive, name, where) for name in _NPZ_ARRAYS if name in names}
    if version.shape != () or version.dtype.kind not in "iu":
        raise TrajectoryFormatError(
            f"{where}: field 'format_version': expected an integer scalar, "
            f"got {version.dtype.name} {list(version.shape)}"
        )
    if int(version) != NPZ_FORMAT_VERSION:
        raise TrajectoryFormatError(f"{where}: field 'format_version': {int(version)} is not {NPZ_FORMAT_VERSION}")
    for name, array in (("ids", ids), ("trees", trees)):
        if array.dtype.kind != "U" or array.ndim != 1:
            raise TrajectoryFormatError(f"{where}: field '{name}': expected a 1-D string array")
    num = len(ids)
    if len(trees) != num:
        raise TrajectoryFormatError(f"{where}: field 'trees': {len(trees)} entries for {num} ids")
    offsets = arrays["offsets"]
    if offsets.dtype != np.int64 or offsets.shape != (num + 1,):
        raise TrajectoryFormatError(
            f"{where}: field 'offsets': expected int64 [N+1] with N+1 = {num + 1}, "
            f"got {offsets.dtype.name} {list(offsets.shape)}"
        )
    if num and offsets[0] != 0:
        raise TrajectoryFormatError(f"{where}: field 'offsets': offsets[0] = {offsets[0]}, expected 0")
    lengths = np.diff(offsets)
    if (lengths <= 0).any():
        k = int(np.flatnonzero(lengths <= 0)[0])
        raise TrajectoryFormatError(
            f"{where}: field 'offsets': offsets[{k + 1}] = {offsets[k + 1]} is not greater than "
            f"offsets[{k}] = {offsets[k]} (trajectory {str(ids[k])!r} would have no tokens)"
        )
    size = int(offsets[-1]) if num else 0
    shapes = {arrays[name].shape for name in _PER_TOKEN if name in arrays}
    if len(shapes) == 1 and len(next(iter(shapes))) == 1 and shapes != {(size,)}:
        # Every per-token array agrees on S: the offsets are what is wrong.
        raise TrajectoryFormatError(
            f"{where}: field 'offsets': offsets[-1] = {size} but the per-token arrays hold {shapes.pop()[0]} tokens"
        )
    sizes = {"N": num, "N+1": num + 1, "S": size}
    for name, array in arrays.items():
        dtype, symbol = _NPZ_ARRAYS[name]
        if array.dtype != dtype or array.shape != (sizes[symbol],):
            raise TrajectoryFormatError(
                f"{where}: field '{name}': expected {np.dtype(dtype).name} [{symbol}] with {symbol} = {sizes[symbol]}, "
                f"got {array.dtype.name} {list(array.shape)}"
            )
    if ("advantage_per_trajectory" in arrays) == ("advantage_per_token" in arrays):
        raise TrajectoryFormatError(
            f"{where}: field 'advantage_per_trajectory': give exactly one of it and 'advantage_per_token'"
        )
    if num == 0:
        raise TrajectoryFormatError(f"{where}: no trajectories")
    id_list = [str(i) for i in ids]
    if len(set(id_list)) != num:
        counts: dict[str, int] = {}
        for k, trajectory_id in enumerate(id_list):
            if trajectory_id in counts:
                raise TrajectoryFormatError(
                    f"{where}: trajectory {k}: field 'id': duplicate id {trajectory_id!r} (first at {counts[trajectory_id]})"
                )
            counts[trajectory_id] = k
    if "" in id_list:
        raise TrajectoryFormatError(f"{where}: trajectory {id_list.index('')}: field 'id': empty")
    for k, (trajectory_id, tree) in enumerate(zip(id_list, trees)):
        name_field(trajectory_id, f"{where}: trajectory {k}", "id")
        name_field(str(tree), f"{where}: trajectory {k}", "tree")
    tokens = arrays["tokens"]
    loss_mask = arrays["loss_mask"]
    _check_npz_values(where, id_list, offsets, tokens < 0, "tokens", "negative token")
    _check_npz_values(where, id_list, offsets, loss_mask > 1, "loss_mask", "values must be 0 or 1")
    first = loss_mask[offsets[:-1]] != 0
    if first.any():
        k = int(np.flatnonzero(first)[0])
        raise TrajectoryFormatError(
            f"{where}: trajectory {id_list[k]!r}: field 'loss_mask': loss_mask[0] must be 0"
        )
    for name in ("rewards", "advantage_per_trajectory"):
        if name in arrays and not np.isfinite(arrays[name]).all():
            k = int(np.flatnonzero(~np.isfinite(arrays[name]))[0])
            raise TrajectoryFormatError(
                f"{where}: trajectory {id_list[k]!r}: field '{name}': non-finite value {arrays[name][k]}"
            )
    for name in ("advantage_per_token", *OPTIONAL_TOKEN_FIELDS):
        if name in arrays:
            _check_npz_values(where, id_list, offsets, ~np.isfinite(arrays[name]), name, "non-finite value")
    for name in OPTIONAL_TOKEN_FIELDS:
        if name in arrays:
            _check_npz_values(where, id_list, offsets, (arrays[name] > 0) | (arrays[name] < LOGPROB_FLOOR), name,
                              f"log-probabilities must be in [{LOGPROB_FLOOR:g}, 0]")
    return Step(
        ids=tuple(id_list),
        trees=tuple(str(t) for t in trees),
        offsets=offsets,
        tokens=tokens,
        loss_mask=loss_mask,
        rewards=arrays["rewards"],
        advantage_per_trajectory=arrays.get("advantage_per_trajectory"),
        advantage_per_token=arrays.get("advantage_per_token"),
        old_logprobs=arrays.get("old_logprobs"),
        ref_logprobs=arrays.get("ref_logprobs"),
        source=where,
    )


def _check_npz_values(
    where: str, ids: list[str], offsets: np.ndarray, bad: np.ndarray, name: str, problem: str
) -> None:
    if bad.any():
        position = int(np.flatnonzero(bad)[0])
        k = int(np.searchsorted(offsets, position, side="right") - 1)
        raise TrajectoryFormatError(
            f"{where}: trajectory {ids[k]!r}: field '{name}': {problem} (position {position - int(offsets[k])})"
        )


def write_npz(step: Step, path: str | Path) -> None:
    """Write `step` in the binary form (uncompressed: loading is a memory copy)."""
    for k, (trajectory_id, tree) in enumerate(zip(step.ids, step.trees)):
        name_field(trajectory_id, f"{path}: trajectory {k}", "id")
        name_field(tree, f"{path}: trajectory {k}", "tree")
    arrays = {
        "format_version": np.asarray(NPZ_FORMAT_VERSION),
        "ids": np.asarray(step.ids, dtype=str),
        "trees": np.asarray(step.trees, dtype=str),
    }
    for name in _NPZ_ARRAYS:
        value = step.offsets if name == "offsets" else getattr(step, name)
        if value is not None:
            arrays[name] = value
    with atomic_open(path, "wb") as handle:
        np.savez(handle, **arrays)


def iter_jsonl_records(step: Step):
    """The step's trajectories as JSONL records (dicts), in batch order."""
    for k, trajectory_id in enumerate(step.ids):
        lo, hi = step.offsets[k], step.offsets[k + 1]
        record: dict[str, object] = {
            "id": trajectory_id,
            "tree": step.trees[k],
            "tokens": step.tokens[lo:hi].tolist(),
            "loss_mask": step.loss_mask[lo:hi].tolist(),
            "advantage": (
                float(step.advantage_per_trajectory[k]) if step.advantage_per_trajectory is not None
                else step.advantage_per_token[lo:hi].tolist()
            ),
            "reward": float(step.rewards[k]),
        }
        for name in OPTIONAL_TOKEN_FIELDS:
            values = getattr(step, name)
            if values is not None:
                record[name] = values[lo:hi].tolist()
        yield record


def write_jsonl(step: Step, path: str | Path) -> None:
    """Write `step` as JSONL (gzip-compressed when the name ends in .gz)."""
    path = Path(path)
    with atomic_open(path, "wb") as raw:
        # No name or time in the gzip header: the same step gives the same bytes.
        binary = gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) if path.name.endswith(".gz") else raw
        text = io.TextIOWrapper(binary, encoding="utf-8")
        for record in iter_jsonl_records(step):
            text.write(json.dumps(record, separators=(",", ":")) + "\n")
        text.flush()
        text.detach()
        if binary is not raw:
            binary.close()  # the gzip trailer; the file itself is closed by atomic_open


def write_step(step: Step, path: str | Path) -> None:
    """Write `step` in the form its file name asks for (.npz, .jsonl or .jsonl.gz)."""
    name = Path(path).name
    if name.endswith(NPZ_SUFFIX):
        write_npz(step, path)
    elif name.endswith(JSONL_SUFFIXES):
        write_jsonl(step, path)
    else:
        raise ValueError(f"{path}: unknown output type (expected .npz, .jsonl or .jsonl.gz)")
