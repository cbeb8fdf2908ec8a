"""A pipeline job's own GPUs on a shared host: `python -m harts.workflow.devices --take N --pool M -- COMMAND ...`.

Snakemake counts GPUs (`--resources gpu=M` bounds the sum of the running jobs' `gpu` resources) but
does not tell a job which devices are its own (snakemake/snakemake#281). The pipeline's GPU rules
run their command through this wrapper: it takes N of the pool's M devices for the command's
lifetime, sets CUDA_VISIBLE_DEVICES to them, runs the command as a child process (SIGINT and
SIGTERM forwarded, its exit status returned) and lets them go when the command ends.

- The pool: the first M entries of CUDA_VISIBLE_DEVICES when the pipeline was started with it
  set (e.g. `CUDA_VISIBLE_DEVICES=4,5,6,7`), else devices 0..M-1. M is the pipeline's
  `--resources gpu=M` (the local GPU profiles set it).
- A device is taken by holding an exclusive `flock` on its lock file, so the kernel lets it go
  when the process ends, also on a crash or a kill: no stale claims. Lock files live in
  $HARTS_DEVICE_LOCKS, else <temp dir>/harts-devices-<uid>/ (host-local: on a shared filesystem
  jobs on different nodes would wait for each other's device numbers).
- The lowest free devices are taken. Snakemake's accounting leaves N free whenever it starts a
  job; if fewer are free (another pipeline on the same host), the wrapper waits, saying so once.
- N = 0 or M = 0 (a CPU job; a SLURM job, whose allocation already holds its own devices) runs
  the command unchanged. N > M is a ValueError naming both.

Tested in tests/workflow/test_devices.py (two holders at once get disjoint devices, a waiting holder
gets a device when its holder ends, the child's view of CUDA_VISIBLE_DEVICES and its exit status).
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from harts.args import print_error

logger = logging.getLogger(__name__)

POLL_S = 1.0


def pool(size: int, environ: dict[str, str] | None = None) -> list[str]:
    """The pool's device ids: the first `size` of CUDA_VISIBLE_DEVICES if it is set, else 0..size-1."""
    env = os.environ if environ is None else environ
    visible = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if visible and len(visible) < size:
        raise ValueError(f"--resources gpu={size}: CUDA_VISIBLE_DEVICES lists only {len(visible)} devices "
                         f"({','.join(visible)})")
    return visible[:size] if visible else [str(i) for i in range(size)]


def lock_dir(environ: dict[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    return Path(env.get("HARTS_DEVICE_LOCKS") or Path(tempfile.gettempdir()) / f"harts-devices-{os.getuid()}")


def _private_folder(directory: Path) -> None:
    """Create `directory` (0700) or check that it is a folder of this user that no one else can write: in the shared
    temp folder another local user could otherwise create it first and hold every GPU lock."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        directory.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = directory.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"{directory}: the GPU lock folder is not a folder (a link or a file): remove it or set "
                         "HARTS_DEVICE_LOCKS to a folder of yours")
    if info.st_uid != os.getuid():
        raise ValueError(f"{directory}: the GPU lock folder belongs to uid {info.st_uid}, not to you ({os.getuid()}): "
                         "remove it or set HARTS_DEVICE_LOCKS to a folder of yours")
    if info.st_mode & 0o022:
        raise ValueError(f"{directory}: the GPU lock folder can be written by others (mode {info.st_mode & 0o777:o}): "
                         "chmod go-w it or set HARTS_DEVICE_LOCKS to a folder of yours")


@contextmanager
def take(count: int, devices: list[str], directory: Path, poll_s: float = POLL_S) -> Iterator[list[str]]:
    """Hold `count` of `devices` (the lowest free ones) for the block; waits, holding none, while fewer are free."""
    if count > len(devices):
        raise ValueError(f"a job asks for {count} GPUs, the pool holds {len(devices)} ({','.join(devices) or 'none'})")
    _private_folder(directory)
    held: dict[str, int] = {}
    said = False
    try:
        while True:
            for device in devices:
                if len(held) == count:
                    break
                if device in held:
                    continue
                handle = os.open(directory / f"device-{device}.lock", os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(handle)
                else:
                    held[device] = handle
            if len(held) == count:
                break
            # All or nothing: holding some devices while waiting for more would deadlock two jobs that each
            # took part of what the other needs (two pipelines sharing a host's devices).
            for handle in held.values():
                os.close(handle)
            held.clear()
            if not said:
                logger.info(f"waiting for {count} free GPUs of {','.join(devices)} (locks in {directory})")
                said = True
            time.sleep(poll_s)
        yield sorted(held, key=devices.index)
    finally:
        for handle in held.values():
            os.close(handle)  # closing the descriptor drops its flock


def run(count: int, pool_size: int, command: list[str]) -> int:
    """Run `command` on `count` devices of the pool (see the module docstring); its exit status."""
    if count == 0 or pool_size == 0:
        return subprocess.call(command)
    with take(count, pool(pool_size), lock_dir()) as devices:
        logger.info(f"CUDA_VISIBLE_DEVICES={','.join(devices)}")
        children: list[subprocess.Popen] = []
        received: list[int] = []

        def forward(signum, frame) -> None:
            received.append(signum)
            for child in children:
                child.send_signal(signum)

        # Installed before the child starts: a signal in between must not end this process (and free the
        # devices) while the child goes on to use them.
        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            children.append(subprocess.Popen(command, env={**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(devices)}))
            for signum in received:
                children[0].send_signal(signum)
            return children[0].wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harts.workflow.devices", description=__doc__.splitlines()[0])
    parser.add_argument("--take", type=int, required=True, metavar="N", help="GPUs this command needs")
    parser.add_argument("--pool", type=int, required=True, metavar="M",
                        help="GPUs of the host the pipeline may use (its --resources gpu=M); 0: no assignment")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (after --)")
    if args.take < 0 or args.pool < 0:
        parser.error("--take and --pool must be >= 0")
    try:
        return run(args.take, args.pool, command)
    except ValueError as error:
        print_error(str(error))
        return 2


if __name__ == "__main__":
    sys.exit(main())
