"""Writes the bad input files of this folder (`python tests/data/bad_inputs/make.py` from the repo root).

Each file holds one thing a user could get wrong or a disk could break; the tests that read them
(tests/trees/test_io.py, tests/trees/test_ingest.py) list the message each must produce. `reader/`
is for steps (`harts trees validate|stats`, harts.trees.io), `ingest/` for chat logs (`harts trees
ingest`, harts.trees.ingest). The binary files are damaged copies of good ones, made here so that
they can be made again: the gzip and zip bytes of a new run may differ (zlib build, zip
timestamps), the kind of damage does not: each damaged file is checked to fail in the intended
way (zlib error, early end, bad CRC) before it is written.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import struct
import tempfile
import zipfile
import zlib
from pathlib import Path

import numpy as np

from harts.trees.io import write_npz
from harts.trees.step import TOKEN_DTYPE, Step

HERE = Path(__file__).resolve().parent
GOOD_LINE = '{"id": "a", "tokens": [1, 2, 3]}\n'
GOOD_LOG = '{"id": "r0", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}\n'
HUGE = "9" * 400


def step_arrays() -> dict[str, np.ndarray]:
    """The arrays of a good three-trajectory step, as write_npz stores them."""
    offsets = np.array([0, 3, 5, 8], dtype=np.int64)
    tokens = np.array([1, 2, 3, 1, 4, 7, 8, 9], dtype=TOKEN_DTYPE)
    loss_mask = np.ones(8, dtype=np.uint8)
    loss_mask[offsets[:-1]] = 0
    step = Step(
        ids=("t0", "t1", "t2"), trees=("x", "x", "y"), offsets=offsets, tokens=tokens, loss_mask=loss_mask,
        rewards=np.zeros(3, dtype=np.float32), advantage_per_trajectory=np.zeros(3, dtype=np.float32),
    )
    with tempfile.TemporaryDirectory() as folder:
        write_npz(step, Path(folder) / "good.npz")
        with np.load(Path(folder) / "good.npz") as archive:
            return {name: archive[name] for name in archive.files}


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def gzip_bytes(text: str) -> bytes:
    return gzip.compress(text.encode(), mtime=0)


def corrupt_gzip(text: str) -> bytes:
    """The gzip of `text` with the first byte of the deflate stream whose inversion zlib refuses
    (some inversions still inflate, to wrong text that only the CRC check catches)."""
    data = gzip_bytes(text)
    for k in range(10, len(data) - 8):  # between the 10-byte header and the 8-byte trailer
        damaged = data[:k] + bytes([data[k] ^ 0xFF]) + data[k + 1 :]
        try:
            gzip.decompress(damaged)
        except zlib.error:
            return damaged
        except gzip.BadGzipFile:
            continue
    raise AssertionError("no single inverted byte makes the deflate stream invalid")


def truncated_gzip(text: str) -> bytes:
    data = gzip_bytes(text)
    data = data[: len(data) // 2]
    try:
        gzip.decompress(data)
    except EOFError:
        return data
    raise AssertionError("half a gzip stream still decompressed")


def truncated_zip(data: bytes) -> bytes:
    data = data[: len(data) // 2]
    try:
        zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile:
        return data
    raise AssertionError("half a zip archive still opened")


def bit_flipped_member(data: bytes, member: str) -> bytes:
    """The zip `data` with one bit of `member`'s array data flipped (its CRC-32 no longer matches)."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        offset = archive.getinfo(member).header_offset
    name_length, extra_length = struct.unpack_from("<HH", data, offset + 26)
    payload = offset + 30 + name_length + extra_length
    flipped = bytearray(data)
    flipped[payload + 128] ^= 0x01  # past the 128-byte .npy header: the first token
    with zipfile.ZipFile(io.BytesIO(bytes(flipped))) as archive:
        try:
            archive.read(member)
        except zipfile.BadZipFile:
            return bytes(flipped)
    raise AssertionError("the flipped bit went unnoticed by the CRC check")


def encrypted_flag_member(data: bytes, member: str) -> bytes:
    """The zip `data` with `member` flagged as encrypted in the central directory (one bit)."""
    start = data.index(b"PK\x01\x02")  # the first central directory entry
    while True:
        name_length = struct.unpack_from("<H", data, start + 28)[0]
        if data[start + 46 : start + 46 + name_length] == member.encode():
            break
        start = data.index(b"PK\x01\x02", start + 46)
    flagged = bytearray(data)
    flagged[start + 8] |= 0x01  # general purpose flag, bit 0: encrypted
    with zipfile.ZipFile(io.BytesIO(bytes(flagged))) as archive:
        try:
            archive.read(member)
        except RuntimeError:
            return bytes(flagged)
    raise AssertionError("the encrypted flag went unnoticed")


def write(path: Path, content: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, str):
        path.write_text(content, encoding="utf-8")
    else:
        path.write_bytes(content)


def dangling_link(folder: Path, good_name: str, good: str, link_name: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    write(folder / good_name, good)
    os.symlink(f"missing{Path(link_name).suffix}", folder / link_name)


def make_reader() -> None:
    reader = HERE / "reader"
    two_lines = GOOD_LINE + '{"id": "b", "tokens": [1, 2, 4]}\n'
    write(reader / "corrupt.jsonl.gz", corrupt_gzip(two_lines))
    write(reader / "truncated.jsonl.gz", truncated_gzip(two_lines))
    write(reader / "huge-int-reward.jsonl", GOOD_LINE + f'{{"id": "b", "tokens": [1, 2], "reward": {HUGE}}}\n')
    write(reader / "huge-int-advantage.jsonl", GOOD_LINE + f'{{"id": "b", "tokens": [1, 2], "advantage": {HUGE}}}\n')
    write(reader / "float32-overflow-reward.jsonl", GOOD_LINE + '{"id": "b", "tokens": [1, 2], "reward": 1e39}\n')
    write(reader / "huge-int-old-logprob.jsonl",
          f'{{"id": "a", "tokens": [1, 2, 3], "old_logprobs": [0, -1, -{HUGE}]}}\n')
    write(reader / "float32-overflow-ref-logprob.jsonl",
          '{"id": "a", "tokens": [1, 2, 3], "ref_logprobs": [0, -1e300, -1]}\n')
    write(reader / "infinite-ref-logprob.jsonl",
          '{"id": "a", "tokens": [1, 2, 3], "ref_logprobs": [0, -1, -Infinity]}\n')
    write(reader / "nan-advantage-list.jsonl", '{"id": "a", "tokens": [1, 2, 3], "advantage": [0, NaN, 1]}\n')
    write(reader / "bool-old-logprob.jsonl", '{"id": "a", "tokens": [1, 2, 3], "old_logprobs": [0, false, -1]}\n')
    write(reader / "bool-reward.jsonl", '{"id": "a", "tokens": [1, 2, 3], "reward": true}\n')
    write(reader / "float-loss-mask.jsonl", '{"id": "a", "tokens": [1, 2, 3], "loss_mask": [0, 1.0, 1]}\n')
    write(reader / "uint64-token.jsonl", '{"id": "a", "tokens": [18446744073709551615, 9223372036854775808]}\n')
    write(reader / "huge-int-token.jsonl", f'{{"id": "a", "tokens": [1, 2, {HUGE}]}}\n')
    write(reader / "int-digit-limit.jsonl", f'{{"id": "a", "tokens": [1, {"9" * 5000}]}}\n')
    write(reader / "invalid-utf8.jsonl", GOOD_LINE.encode() + b'{"id": "b", "tree": "caf\xe9", "tokens": [1]}\n')
    write(reader / "duplicate-key.jsonl", GOOD_LINE + '{"id": "b", "tokens": [1, 2], "reward": 1, "reward": 0}\n')
    write(reader / "empty.jsonl", "")
    dangling_link(reader / "dangling-link", "a.jsonl", GOOD_LINE, "b.jsonl")

    arrays = step_arrays()
    write(reader / "npz-format-version-array.npz", npz_bytes({**arrays, "format_version": np.array([1, 1])}))
    npy = io.BytesIO()
    np.save(npy, arrays["tokens"])
    write(reader / "npz-renamed-npy.npz", npy.getvalue())
    write(reader / "npz-truncated.npz", truncated_zip(npz_bytes(arrays)))
    write(reader / "npz-bit-flipped.npz", bit_flipped_member(npz_bytes(arrays), "tokens.npy"))
    write(reader / "npz-encrypted-flag.npz", encrypted_flag_member(npz_bytes(arrays), "tokens.npy"))
    write(reader / "npz-text.npz", "hello, I am a text file\n")
    write(reader / "npz-empty.npz", b"")
    write(reader / "npz-offsets-not-increasing.npz",
          npz_bytes({**arrays, "offsets": np.array([0, 3, 3, 8], dtype=np.int64)}))
    write(reader / "npz-offsets-beyond-tokens.npz",
          npz_bytes({**arrays, "offsets": np.array([0, 3, 5, 10], dtype=np.int64)}))
    write(reader / "npz-infinite-reward.npz",
          npz_bytes({**arrays, "rewards": np.array([0, np.inf, 0], dtype=np.float32)}))


def make_ingest() -> None:
    ingest = HERE / "ingest"
    write(ingest / "corrupt.jsonl.gz", corrupt_gzip(GOOD_LOG * 2))
    write(ingest / "truncated.jsonl.gz", truncated_gzip(GOOD_LOG * 2))
    write(ingest / "invalid-utf8.jsonl",
          GOOD_LOG.encode() + b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n')
    log = {"history": [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "fix it"}]}
    text = json.dumps(log, indent=1).replace("fix it", "fix \udcff it")
    write(ingest / "invalid-utf8.traj", text.encode("utf-8", "surrogateescape"))
    write(ingest / "empty.jsonl", "")
    write(ingest / "duplicate-key.jsonl",
          '{"id": "r0", "reward": 1, "reward": 0, "messages": [{"role": "user", "content": "hi"}]}\n')
    write(ingest / "duplicate-key-in-message.jsonl",
          '{"id": "r0", "messages": [{"role": "user", "content": "hi", "content": "bye"}]}\n')
    dangling_link(ingest / "dangling-link", "a.jsonl", GOOD_LOG, "b.traj")
    for name, value in (("nan", "NaN"), ("infinity", "Infinity"), ("minus-infinity", "-Infinity"), ("huge-int", HUGE)):
        write(ingest / f"reward-{name}.jsonl",
              f'{{"id": "r0", "reward": {value}, "messages": [{{"role": "user", "content": "hi"}}]}}\n')
    write(ingest / "unknown-field.jsonl",
          '{"id": "r0", "rewrad": 1.0, "messages": [{"role": "user", "content": "hi"}]}\n')
    write(ingest / "bool-reward.jsonl",
          '{"id": "r0", "reward": true, "messages": [{"role": "user", "content": "hi"}]}\n')


if __name__ == "__main__":
    make_reader()
    make_ingest()
