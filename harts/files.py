"""Writing files safely: every file a HARTS command writes appears complete under its name or not at all.

`atomic_path(path)` yields a unique temporary path in the target's directory (`.NAME.tmp-PID-RANDOM`: two writers
never share one); when the block ends the file is fsynced and renamed over the target, and the directory fsynced,
so a kill or a full disk leaves the previous file intact and no partial file under the final name. On an error the
temporary is removed and an OSError names the target (`PATH: could not write (No space left on device)`).
`atomic_open` gives a handle on such a temporary; `write_text` / `write_bytes` write one string. `check_outputs`
refuses, before any work, an output that is one of the command's inputs (the same file, also through links or a
folder of inputs); `output_locks` keeps a second process from writing the same output at the same time. Tested in
tests/test_files.py with real full disks, kills and concurrent writers.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO


def fsync_file(path: str | Path) -> None:
    """Flush a written file's data to the disk (before a rename makes it visible under its final name)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_directory(directory: str | Path) -> None:
    """Flush a directory's entries (a rename in it) to the disk, where the file system can."""
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # some file systems cannot open a directory: the rename is still atomic
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def _named(error: OSError, message: str) -> OSError:
    """An OSError whose text is `message` (what the CLI prints), keeping the original's errno."""
    named = OSError(message)
    named.errno = error.errno
    return named


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path to write `path`'s new content to (by any library that takes a file name); renamed over
    `path` when the block succeeds, removed when it fails."""
    target = Path(path)
    directory = target.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise _named(error, f"{target}: could not create its folder ({error.strerror or error})") from None
    temporary = directory / f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        yield temporary
        with open(temporary, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    except BaseException as error:
        try:
            temporary.unlink(missing_ok=True)
        except OSError:
            pass
        if isinstance(error, OSError):
            raise _named(error, f"{target}: could not write ({error.strerror or error})") from None
        raise
    fsync_directory(directory)


@contextmanager
def atomic_open(path: str | Path, mode: str = "w", *, encoding: str | None = "utf-8",
                newline: str | None = None) -> Iterator[IO]:
    """`open(temporary, mode)` for `atomic_path(path)`: mode "w" (text, `encoding`) or "wb"."""
    assert mode in ("w", "wb"), mode
    with atomic_path(path) as temporary:
        if mode == "wb":
            with open(temporary, "wb") as handle:
                yield handle
        else:
            with open(temporary, "w", encoding=encoding, newline=newline) as handle:
                yield handle


def write_text(path: str | Path, text: str) -> None:
    with atomic_open(path) as handle:
        handle.write(text)


def write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_open(path, "wb") as handle:
        handle.write(data)


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


def _files(path: Path) -> list[Path]:
    """An input's files: the file itself, or a folder's files (one level: step folders, run folders)."""
    if path.is_dir():
        return [path, *(entry for entry in path.iterdir() if entry.is_file())]
    return [path]


def check_outputs(command: str, outputs: Iterable[str | Path | None], inputs: Iterable[str | Path | None], *,
                  read_whole: bool = False) -> None:
    """ValueError naming `command` if an output is one of the inputs (or a file of an input folder; with
    `read_whole`, inputs that are data folders read file by file, also a new file in one: a later read of the folder
    would take it in), or two outputs are one file (e.g. records given a table's suffix: the table would replace
    them)."""
    inputs = [Path(p) for p in inputs if p is not None]
    outputs = [Path(p) for p in outputs if p is not None]
    for k, output in enumerate(outputs):
        for other in outputs[:k]:
            if _same(output, other):
                which = (f"output {output} is written twice" if output == other
                         else f"outputs {other} and {output} are one file")
                raise ValueError(f"{command}: {which} (one would overwrite the other); choose another name")
        for given in inputs:
            for existing in _files(given):
                if _same(output, existing):
                    what = "is" if existing == given else f"is {existing}, a file of"
                    raise ValueError(f"{command}: output {output} {what} its input {given} (it would be overwritten)")
            if read_whole and given.is_dir() and _same(output.parent, given):
                raise ValueError(f"{command}: output {output} is in its input folder {given} (a later read of the "
                                 "folder would take it in); write it elsewhere")


@contextmanager
def output_locks(command: str, outputs: Iterable[str | Path | None]) -> Iterator[None]:
    """Hold an exclusive lock on each output (a hidden `.NAME.lock` beside it, removed afterwards) while the command
    runs: a second harts process writing the same file (a records file, a run's train.jsonl) is refused in one line
    instead of losing the first one's work. The kernel drops a lock when its process ends, however it ends."""
    held: list[tuple[Path, IO]] = []
    created: list[Path] = []
    try:
        for output in (Path(p) for p in outputs if p is not None):
            created += [p for p in reversed(output.parents) if not p.exists()]
            held.append(_lock(command, output))
        yield
    finally:
        for lock, handle in reversed(held):
            lock.unlink(missing_ok=True)
            handle.close()
        for folder in reversed(created):  # made for a lock and left empty: the command failed before writing
            with contextlib.suppress(OSError):
                folder.rmdir()


def _lock(command: str, output: Path) -> tuple[Path, IO]:
    import fcntl

    lock = output.parent / f".{output.name}.lock"
    blocking = next((p for p in reversed(output.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise ValueError(f"{output}: cannot be written: {blocking} is a file, not a folder")
    while True:
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
            handle = open(lock, "a+", encoding="utf-8")
        except OSError as error:
            raise _named(error, f"{lock}: could not open the lock of {output} ({error.strerror or error})") from None
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "?"
            handle.close()
            raise ValueError(f"{command}: {output} is being written by another harts process (pid {holder}); wait "
                             "for it or choose another output") from None
        try:
            current = os.stat(lock).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(handle.fileno()).st_ino:
            break
        handle.close()  # the holder removed this lock file as we took it: take the new one
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return lock, handle
