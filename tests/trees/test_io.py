import gzip
import json

import numpy as np
import pytest

from harts.cli.main import main
from harts.trees.io import TrajectoryFormatError, read_step, write_step

from .helpers import BAD_INPUTS, assert_message, cli_error, make_step

GOOD = {"id": "a", "tokens": [1, 2, 3]}


def _write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _record(**fields):
    record = dict(GOOD)
    record.update(fields)
    return json.dumps({k: v for k, v in record.items() if v is not _DROP})


_DROP = object()

BAD_LINES = {
    # name: (second line, expected message fragment)
    "bad-json": ('{"id": "b", "tokens": [1, 2', "invalid JSON"),
    "not-object": ("[1, 2, 3]", "expected a JSON object"),
    "missing-id": (_record(id=_DROP), "field 'id': missing"),
    "duplicate-id": (_record(), "duplicate id 'a'"),
    "empty-id": (_record(id=""), "field 'id'"),
    "missing-tokens": (_record(id="b", tokens=_DROP), "field 'tokens': missing"),
    "empty-tokens": (_record(id="b", tokens=[]), "field 'tokens': empty"),
    "float-token": (_record(id="b", tokens=[1, 2.5]), "field 'tokens': non-integer"),
    "string-token": (_record(id="b", tokens=[1, "x"]), "field 'tokens': non-integer"),
    "bool-token": (_record(id="b", tokens=[1, True]), "field 'tokens': booleans"),
    "nested-tokens": (_record(id="b", tokens=[[1], [2]]), "field 'tokens'"),
    "negative-token": (_record(id="b", tokens=[1, -4]), "field 'tokens': negative token -4"),
    "mask-length": (_record(id="b", loss_mask=[0, 1]), "field 'loss_mask': length 2 does not match tokens' length 3"),
    "mask-value": (_record(id="b", loss_mask=[0, 2, 1]), "field 'loss_mask': values must be 0 or 1"),
    "mask-first": (_record(id="b", loss_mask=[1, 1, 1]), "loss_mask[0] must be 0"),
    "advantage-length": (_record(id="b", advantage=[0.1]), "field 'advantage': length 1"),
    "advantage-type": (_record(id="b", advantage="high"), "field 'advantage': expected a number"),
    "reward-nan": ('{"id": "b", "tokens": [1], "reward": NaN}', "field 'reward': non-finite"),
    "logprob-positive": (_record(id="b", old_logprobs=[0.0, 0.5, -1.0]), "must be in [-10000, 0]"),
    "logprob-huge-negative": (_record(id="b", ref_logprobs=[0.0, -3e38, -1.0]),
                              "field 'ref_logprobs': log-probabilities must be in [-10000, 0]"),
    "id-with-nul": (_record(id="b\u0000"), "field 'id': control character '\\x00'"),
    "id-too-long": (_record(id="b" * 1_000_000), "field 'id': 1,000,000 characters (at most 1024)"),
    "tree-with-newline": (_record(id="b", tree="t\nu"), "field 'tree': control character '\\n'"),
    "unknown-field": (_record(id="b", extra=1), "field 'extra': unknown field"),
    "empty-line": ("", "empty line"),
    "tree-type": (_record(id="b", tree=3), "field 'tree'"),
}


@pytest.mark.parametrize("case", BAD_LINES)
def test_bad_input_names_file_line_and_field(tmp_path, case, capsys):
    line, fragment = BAD_LINES[case]
    path = _write_lines(tmp_path / "step.jsonl", [json.dumps(GOOD), line])
    with pytest.raises(TrajectoryFormatError) as error:
        read_step(path)
    message = str(error.value)
    assert fragment in message
    assert f"{path}:2" in message
    assert "\n" not in message
    # The CLI prints the same line and exits non-zero without a traceback.
    assert main(["trees", "validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("harts: error: ") and fragment in err and "Traceback" not in err


# name: (file or directory under tests/data/bad_inputs/reader, the exact message; see assert_message)
BAD_FILES = {
    "corrupt-gzip": ("corrupt.jsonl.gz", "{path}:1: corrupt gzip data (...)"),
    "truncated-gzip": (
        "truncated.jsonl.gz", "{path}:1: truncated gzip data (the file ends before the end-of-stream marker)"
    ),
    "huge-int-reward": (
        "huge-int-reward.jsonl", "{path}:2: field 'reward': an integer of 400 digits is outside the float32 range"
    ),
    "huge-int-advantage": (
        "huge-int-advantage.jsonl",
        "{path}:2: field 'advantage': an integer of 400 digits is outside the float32 range",
    ),
    "float32-overflow-reward": (
        "float32-overflow-reward.jsonl", "{path}:2: field 'reward': 1e+39 is outside the float32 range"
    ),
    "huge-int-old-logprob": (
        "huge-int-old-logprob.jsonl",
        "{path}:1: field 'old_logprobs': an integer of 400 digits at position 2 is outside the float32 range",
    ),
    "float32-overflow-ref-logprob": (
        "float32-overflow-ref-logprob.jsonl",
        "{path}:1: field 'ref_logprobs': -1e+300 at position 1 is outside the float32 range",
    ),
    "infinite-ref-logprob": (
        "infinite-ref-logprob.jsonl", "{path}:1: field 'ref_logprobs': non-finite value -inf at position 2"
    ),
    "nan-advantage-list": (
        "nan-advantage-list.jsonl", "{path}:1: field 'advantage': non-finite value nan at position 1"
    ),
    "bool-old-logprob": ("bool-old-logprob.jsonl", "{path}:1: field 'old_logprobs': booleans are not numbers"),
    "bool-reward": ("bool-reward.jsonl", "{path}:1: field 'reward': expected a number"),
    "float-loss-mask": (
        "float-loss-mask.jsonl", "{path}:1: field 'loss_mask': non-integer value 1.0 at position 1 (expected integers)"
    ),
    "uint64-token": (
        "uint64-token.jsonl", "{path}:1: field 'tokens': 18446744073709551615 at position 0 is outside the int64 range"
    ),
    "huge-int-token": (
        "huge-int-token.jsonl",
        "{path}:1: field 'tokens': an integer of 400 digits at position 2 is outside the int64 range",
    ),
    "int-digit-limit": (
        "int-digit-limit.jsonl",
        "{path}:1: invalid JSON (Exceeds the limit (4300 digits) for integer string conversion: value has 5000 digits)",
    ),
    "invalid-utf8": (
        "invalid-utf8.jsonl", "{path}:2: not UTF-8 text (byte 0xe9 at column 25: invalid continuation byte)"
    ),
    "duplicate-key": ("duplicate-key.jsonl", "{path}:2: field 'reward': duplicate key (a JSON object gives it twice)"),
    "empty-jsonl": ("empty.jsonl", "{path}: no trajectories"),
    "dangling-link": (
        "dangling-link", "{path}/b.jsonl: dangling symbolic link (its target 'missing.jsonl' does not exist)"
    ),
    "npz-format-version-array": (
        "npz-format-version-array.npz",
        "{path}: field 'format_version': expected an integer scalar, got int64 [2]",
    ),
    "npz-renamed-npy": (
        "npz-renamed-npy.npz",
        "{path}: a single .npy array, not an .npz archive (an .npz step holds named arrays: ids, tokens, ...)",
    ),
    "npz-truncated": ("npz-truncated.npz", "{path}: truncated or corrupt .npz archive (...)"),
    "npz-bit-flipped": ("npz-bit-flipped.npz", "{path}: field 'tokens': cannot read the array (...)"),
    "npz-encrypted-flag": ("npz-encrypted-flag.npz", "{path}: field 'tokens': cannot read the array (...)"),
    "npz-text": (
        "npz-text.npz",
        "{path}: not an .npz archive (an .npz file is a zip archive; this file starts with b'hello,')",
    ),
    "npz-empty": ("npz-empty.npz", "{path}: empty file (expected an .npz archive)"),
    "npz-offsets-not-increasing": (
        "npz-offsets-not-increasing.npz",
        "{path}: field 'offsets': offsets[2] = 3 is not greater than offsets[1] = 3 "
        "(trajectory 't1' would have no tokens)",
    ),
    "npz-offsets-beyond-tokens": (
        "npz-offsets-beyond-tokens.npz",
        "{path}: field 'offsets': offsets[-1] = 10 but the per-token arrays hold 8 tokens",
    ),
    "npz-infinite-reward": (
        "npz-infinite-reward.npz", "{path}: trajectory 't1': field 'rewards': non-finite value inf"
    ),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_bad_file_is_refused_in_one_line(case, capsys):
    name, expected = BAD_FILES[case]
    path = BAD_INPUTS / "reader" / name
    with pytest.raises(ValueError) as error:
        read_step(path)
    assert_message(str(error.value), expected, path)
    for command in ("validate", "stats"):
        assert_message(cli_error(["trees", command, str(path)], capsys), f"harts: error: {expected}", path)


def test_line_by_line_decoding_reads_crlf_utf8_and_gzip(tmp_path):
    """The reader decodes each line on its own: CRLF line ends, multi-byte UTF-8 and gzip still read."""
    path = tmp_path / "s.jsonl.gz"
    with gzip.open(path, "wb") as handle:
        handle.write((json.dumps({"id": "é", "tokens": [1, 2]}, ensure_ascii=False) + "\r\n").encode())
        handle.write((json.dumps({"id": "b", "tree": "日本", "tokens": [3]}, ensure_ascii=False) + "\r\n").encode())
    step = read_step(path)
    assert step.ids == ("é", "b") and step.trees == ("é", "日本")


def test_vocabulary_bound(tmp_path):
    path = _write_lines(tmp_path / "step.jsonl", [json.dumps(GOOD), _record(id="b", tokens=[5, 300])])
    read_step(path)
    with pytest.raises(TrajectoryFormatError, match=r"trajectory 'b': field 'tokens': token 300 at position 1 is >= the vocabulary size 256"):
        read_step(path, vocab_size=256)


def test_optional_field_on_some_lines_only(tmp_path):
    path = _write_lines(tmp_path / "s.jsonl", [_record(old_logprobs=[0.0, -1.0, -2.0]), _record(id="b")])
    with pytest.raises(TrajectoryFormatError, match=r"s.jsonl:2: field 'old_logprobs': missing here but given on line 1"):
        read_step(path)
    path = _write_lines(tmp_path / "t.jsonl", [_record(), _record(id="b", ref_logprobs=[0.0, -1.0, -2.0])])
    with pytest.raises(TrajectoryFormatError, match=r"t.jsonl:2: field 'ref_logprobs': given here but missing"):
        read_step(path)


def test_defaults(tmp_path):
    step = read_step(_write_lines(tmp_path / "s.jsonl", [json.dumps(GOOD)]))
    assert step.trees == ("a",)
    assert step.loss_mask.tolist() == [0, 1, 1]
    assert step.advantages().tolist() == [0.0, 0.0, 0.0]
    assert step.rewards.tolist() == [0.0]
    assert step.old_logprobs is None and step.ref_logprobs is None


def _full_step():
    step = make_step([[1, 2, 3], [1, 2, 4, 5], [7]])
    rng = np.random.default_rng(42)
    return type(step)(
        ids=step.ids, trees=("x", "x", "y"), offsets=step.offsets, tokens=step.tokens,
        loss_mask=np.array([0, 1, 0, 0, 1, 1, 0, 0], dtype=np.uint8),
        rewards=np.array([1.0, 0.0, 0.5], dtype=np.float32),
        advantage_per_token=rng.standard_normal(8).astype(np.float32),
        old_logprobs=-rng.random(8).astype(np.float32),
        ref_logprobs=-rng.random(8).astype(np.float32),
    )


@pytest.mark.parametrize("suffix", ["jsonl", "jsonl.gz", "npz"])
def test_round_trip(tmp_path, suffix):
    step = _full_step()
    path = tmp_path / f"step.{suffix}"
    write_step(step, path)
    again = read_step(path)
    assert again.ids == step.ids and again.trees == step.trees
    for name in ("offsets", "tokens", "loss_mask", "rewards", "advantage_per_token", "old_logprobs", "ref_logprobs"):
        np.testing.assert_array_equal(getattr(again, name), getattr(step, name), err_msg=name)


def test_directory_is_one_step(tmp_path):
    step = _full_step()
    write_step(step.subset(np.array([0, 1])), tmp_path / "a.jsonl.gz")
    write_step(step.subset(np.array([2])), tmp_path / "b.npz")
    again = read_step(tmp_path)
    assert again.ids == step.ids
    np.testing.assert_array_equal(again.tokens, step.tokens)
    np.testing.assert_array_equal(again.advantages(), step.advantages())


def test_directory_duplicate_ids(tmp_path):
    step = _full_step()
    write_step(step, tmp_path / "a.jsonl")
    write_step(step, tmp_path / "b.jsonl")
    with pytest.raises(TrajectoryFormatError, match="duplicate id 't0'"):
        read_step(tmp_path)


def test_gzip_input(tmp_path):
    path = tmp_path / "s.jsonl.gz"
    with gzip.open(path, "wt") as handle:
        handle.write(json.dumps(GOOD) + "\n" + _record(id="b", tokens=[1, -1]) + "\n")
    with pytest.raises(TrajectoryFormatError, match=r"s.jsonl.gz:2: field 'tokens': negative"):
        read_step(path)


NPZ_BREAKAGE = {
    "negative-token": (lambda a: a["tokens"].__setitem__(0, -1), "trajectory 't0': field 'tokens': negative token"),
    "mask-first": (lambda a: a["loss_mask"].__setitem__(0, 1), "trajectory 't0': field 'loss_mask': loss_mask[0] must be 0"),
    "offsets-dtype": (lambda a: a.__setitem__("offsets", a["offsets"].astype(np.int32)), "field 'offsets'"),
    "tokens-length": (lambda a: a.__setitem__("tokens", a["tokens"][:-1]), "field 'tokens': expected int32"),
    "missing-rewards": (lambda a: a.pop("rewards"), "field 'rewards': missing"),
    "unknown-array": (lambda a: a.__setitem__("junk", np.zeros(1)), "field 'junk': unknown array"),
    "nan-logprob": (lambda a: a["old_logprobs"].__setitem__(1, np.nan), "field 'old_logprobs': non-finite"),
    "duplicate-id": (lambda a: a.__setitem__("ids", np.array(["t0", "t0", "t2"])), "duplicate id 't0'"),
    "huge-negative-logprob": (lambda a: a["ref_logprobs"].__setitem__(1, -3e38),
                              "field 'ref_logprobs': log-probabilities must be in [-10000, 0]"),
    "control-character-id": (lambda a: a.__setitem__("ids", np.array(["t0", "t\x01", "t2"])),
                             "trajectory 1: field 'id': control character"),
}


def test_an_npz_with_a_member_twice_is_refused(tmp_path):
    import zipfile

    path = tmp_path / "s.npz"
    write_step(_full_step(), path)
    with zipfile.ZipFile(path) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    other = tmp_path / "tokens.npz"
    np.savez(other, tokens=np.zeros(3, dtype=np.int32))
    with zipfile.ZipFile(other) as archive:
        second_tokens = archive.read("tokens.npy")
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
        archive.writestr("tokens.npy", second_tokens)  # a second member of that name: zipfile warns, then writes it
    with pytest.raises(TrajectoryFormatError, match=rf"{path}: field 'tokens': the archive holds it twice"):
        read_step(path)


def test_ids_that_numpy_would_merge_are_not_written(tmp_path):
    step = make_step([[1, 2], [1, 3]], ids=["a", "a\x00"])
    with pytest.raises(ValueError, match="trajectory 1: field 'id': control character"):
        write_step(step, tmp_path / "s.npz")
    assert not (tmp_path / "s.npz").exists()


@pytest.mark.parametrize("case", NPZ_BREAKAGE)
def test_bad_npz(tmp_path, case):
    path = tmp_path / "s.npz"
    write_step(_full_step(), path)
    with np.load(path) as archive:
        arrays = {k: archive[k].copy() for k in archive.files}
    breakage, fragment = NPZ_BREAKAGE[case]
    breakage(arrays)
    np.savez(path, **arrays)
    with pytest.raises(TrajectoryFormatError) as error:
        read_step(path)
    assert fragment in str(error.value) and str(path) in str(error.value)


def _rewrite_member(path, name, edit):
    """Rewrite member `name` of the zip at `path` with `edit(bytes) -> bytes`, keeping the other members."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        members = {info.filename: archive.read(info) for info in archive.infolist()}
    members[name] = edit(members[name])
    with zipfile.ZipFile(path, "w") as archive:
        for member, data in members.items():
            archive.writestr(member, data)


def _declare_shape(data: bytes, count: int) -> bytes:
    """An .npy member whose 1.0 header declares `count` elements, padded to the header's old length."""
    length = int.from_bytes(data[8:10], "little")
    header = data[10:10 + length].decode("latin1")
    start = header.index("'shape': (") + len("'shape': (")
    header = header[:start] + f"{count}," + header[header.index(")", start):]
    return data[:10] + (header.rstrip("\n").ljust(length - 1) + "\n").encode("latin1") + data[10 + length:]


def test_npz_member_declaring_more_than_it_holds_is_refused_before_allocation(tmp_path):
    """A 4 TiB array header in a small file: numpy would allocate it before reading (a MemoryError)."""
    path = tmp_path / "s.npz"
    write_step(_full_step(), path)
    _rewrite_member(path, "tokens.npy", lambda data: _declare_shape(data, 2**40))
    with pytest.raises(TrajectoryFormatError) as error:
        read_step(path)
    assert str(error.value) == (
        f"{path}: field 'tokens': the array header declares int32 [1099511627776] (4,398,046,511,104 bytes), "
        "the member holds 44 bytes"
    )


def test_npz_member_whose_zip_entry_outgrows_deflate_is_refused(tmp_path):
    """A central-directory size no deflate stream can reach (zipfile would let numpy allocate it)."""
    import zipfile

    path = tmp_path / "s.npz"
    write_step(_full_step(), path)
    _rewrite_member(path, "tokens.npy", lambda data: data)
    raw = bytearray(path.read_bytes())
    entry = raw.index(b"PK\x01\x02")  # central directory entries: method at +10, sizes at +20/+24, name at +46
    while raw[entry + 46:entry + 56] != b"tokens.npy":
        entry = raw.index(b"PK\x01\x02", entry + 4)
    raw[entry + 10:entry + 12] = zipfile.ZIP_DEFLATED.to_bytes(2, "little")
    compressed = int.from_bytes(raw[entry + 20:entry + 24], "little")
    raw[entry + 24:entry + 28] = (compressed * 2000).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(TrajectoryFormatError) as error:
        read_step(path)
    assert str(error.value) == (
        f"{path}: field 'tokens': the zip entry declares {compressed * 2000:,} bytes from {compressed:,} "
        f"compressed bytes (at most {compressed * 1032:,})"
    )


def test_npz_never_unpickles(tmp_path):
    path = tmp_path / "s.npz"
    np.savez(path, format_version=np.asarray(1), ids=np.array([{"a": 1}], dtype=object))
    with pytest.raises(TrajectoryFormatError, match="s.npz"):
        read_step(path)


def test_unknown_file_type(tmp_path):
    path = tmp_path / "s.csv"
    path.write_text("x")
    with pytest.raises(TrajectoryFormatError, match="unknown file type"):
        read_step(path)
    with pytest.raises(TrajectoryFormatError, match="no such file"):
        read_step(tmp_path / "missing.jsonl")
