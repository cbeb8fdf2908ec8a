"""Start the ranks of a parallel configuration and run one function on each (`launch`).

`launch(fn, config, *args, device=...)` spawns `config.world_size` processes
(torch.multiprocessing, start method "spawn"), each of which joins a process group (gloo on
CPU, NCCL on CUDA with one GPU per rank and NVLink multicast off in its environment) through a
free TCP port on 127.0.0.1 with the config's timeout, builds its `ParallelGroups` and calls
`fn(groups, *args)`. Rank 0's return value is handed back to the caller (through a temporary
file, so it may hold tensors).

Under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in the environment, on
one node or several) nothing is spawned: this process is rank RANK of WORLD_SIZE (which must be
the config's world size), on GPU LOCAL_RANK, and `launch` returns rank 0's value on rank 0 and
None elsewhere. Every rank runs `fn` on rank 0's arguments (broadcast), as spawned ranks run on
their parent's: a rank's own planning may differ (a time-limited planner) and each node reads
its own copy of the inputs. The process group is initialised at the first launch and kept for
the process's later ones (a second init against torchrun's store reuses its keys and hangs).
A failure in `fn` raises `RankFailed` naming this rank. The commands that take `--parallel`
run unchanged on every rank: `check_torchrun` rejects a world that does not fit (or no
--parallel under a world of several ranks) before any work, and only the rank for which
`is_reporting_rank()` holds (rank 0) prints results and writes records; the others exit 0
quietly.

Failures: an exception in any rank stops every rank (torch.multiprocessing terminates the
others) and `launch` raises `RankFailed` with one line, "rank i: Type: message", naming the
rank that failed first (each failing rank records the time of its error: the peers of a crashed
rank fail later, on the lost connection); a collective waiting on a dead or diverged rank
fails after the configured timeout instead of hanging. If the caller is interrupted while the
ranks run (Ctrl-C, or SIGTERM raised by `harts.tracking.records.sigterm_raises`), the ranks are
terminated before the exception propagates.
On CPU each rank uses cpu_count // (ranks on its host) intra-op threads, so ranks do not
oversubscribe. Tested in tests/parallel/test_launch.py (spawned) and tests/parallel/test_torchrun.py
(torchrun on one node and on two nodes simulated on one machine).
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harts.files import atomic_path, write_text
from harts.parallel.config import ParallelConfig

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# NVLink multicast (NVLS) can leave a shared host's GPUs unusable when a program using it fails: keep it off.
NVLINK_MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class RankFailed(RuntimeError):
    """A rank of a parallel run raised or died; the message is one line naming the rank."""


def resolve_backend(config: ParallelConfig, device: str) -> str:
    backend = config.backend
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    if backend == "nccl" and device != "cuda":
        raise ValueError(f"parallel config {config.name!r}: backend nccl needs --device cuda")
    return backend


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _error_line(error: BaseException) -> str:
    message = str(error).strip().splitlines()
    return f"{type(error).__name__}: {message[0]}" if message else type(error).__name__


def _record_error(error: BaseException, path: str) -> None:
    """When and what: written before the process group is torn down (which makes the peers fail)."""
    write_text(path, f"{time.time()!r}\n{_error_line(error)}")


def _rank_device(backend: str, device_type: str, local_rank: int, ranks_here: int):
    """This rank's device (GPU `local_rank` of its host), and its CPU threads: one share of the host's."""
    import torch

    if backend == "nccl":
        os.environ.update(NVLINK_MULTICAST_OFF)
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        return device
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_here))
    return torch.device("cpu")


def _run_rank(rank: int, world_size: int, config: ParallelConfig, backend: str, device_type: str,
              fn: Callable, args: tuple, error_path: str) -> Any:
    """A spawned rank (rank = its local rank: one host)."""
    import torch.distributed as dist

    from harts.parallel.groups import build_groups

    device = _rank_device(backend, device_type, rank, world_size)
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=config.timeout_s),
        device_id=device if device_type == "cuda" else None,
    )
    try:
        return fn(build_groups(config, device), *args)
    except BaseException as error:
        _record_error(error, error_path)
        raise
    finally:
        dist.destroy_process_group()


def _run_in_place(config: ParallelConfig, backend: str, device_type: str, fn: Callable, args: tuple) -> Any:
    """This process as rank RANK of torchrun's world: `fn` on rank 0's arguments; its value on rank 0."""
    import torch
    import torch.distributed as dist

    from harts.parallel.groups import build_groups

    check_torchrun(config)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    if device_type == "cuda" and torch.cuda.device_count() <= local_rank:
        raise ValueError(f"torchrun LOCAL_RANK {local_rank}: only {torch.cuda.device_count()} GPUs are visible")
    device = _rank_device(backend, device_type, local_rank, ranks_here)
    if not dist.is_initialized():
        dist.init_process_group(
            backend, rank=rank, world_size=config.world_size, timeout=datetime.timedelta(seconds=config.timeout_s),
            device_id=device if device_type == "cuda" else None,
        )
        atexit.register(dist.destroy_process_group)
    assert dist.get_backend() == backend, (dist.get_backend(), backend)
    try:
        shared = [args]
        dist.broadcast_object_list(shared, src=0)
        result = fn(build_groups(config, device), *shared[0])
    except Exception as error:
        raise RankFailed(f"rank {rank}: {_error_line(error)}") from error
    return result if rank == 0 else None


def _join(world_size, config, backend, device, fn, args, directory) -> None:
    """Spawn the ranks and wait for them; if this process is interrupted meanwhile (Ctrl-C, SIGTERM
    raised as an exception), stop them first: the ranks must not outlive the caller."""
    import torch.multiprocessing as mp

    context = mp.start_processes(
        _spawned_rank, args=(world_size, _free_port(), config, backend, device, fn, args, directory),
        nprocs=world_size, join=False, start_method="spawn",
    )
    try:
        while not context.join():
            pass
    except (mp.ProcessRaisedException, mp.ProcessExitedException):
        raise
    except BaseException:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
        for process in context.processes:
            process.join(10)
            if process.is_alive():  # stuck in native code: SIGTERM was not enough
                process.kill()
                process.join()
        raise


def _spawned_rank(rank: int, world_size: int, port: int, config: ParallelConfig, backend: str, device_type: str,
                  fn: Callable, args: tuple, directory: str) -> None:
    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    error_path = str(Path(directory, f"rank{rank}.error"))
    try:
        result = _run_rank(rank, world_size, config, backend, device_type, fn, args, error_path)
    except BaseException as error:
        if not Path(error_path).exists():
            _record_error(error, error_path)
        raise
    if rank == 0:
        with atomic_path(Path(directory, "rank0.pt")) as temporary:
            torch.save(result, temporary)


def _first_failure(directory: str) -> str | None:
    """The earliest error of any rank: the cause (the others' are usually lost connections to it)."""
    failures = []
    for path in Path(directory).glob("rank*.error"):
        stamp, line = path.read_text().split("\n", 1)
        failures.append((float(stamp), int(path.stem.removeprefix("rank")), line))
    if not failures:
        return None
    _, rank, line = min(failures)
    return f"rank {rank}: {line}"


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in TORCHRUN_VARIABLES)


def check_torchrun(config: ParallelConfig | None) -> None:
    """Under torchrun, a ValueError unless `config` (None: no --parallel) has torchrun's world size:
    without --parallel every rank would run the whole command alone (and write the same records)."""
    if not launched_by_torchrun():
        return
    world = int(os.environ["WORLD_SIZE"])
    if config is None and world > 1:
        raise ValueError(f"torchrun started {world} ranks: give --parallel NAME, a config of {world} ranks")
    if config is not None and config.world_size != world:
        raise ValueError(f"parallel config {config.name!r} needs {config.world_size} ranks, torchrun started {world}")


def is_reporting_rank() -> bool:
    """Whether this process prints results and writes records: always, but under torchrun on rank 0 only."""
    return not launched_by_torchrun() or int(os.environ["RANK"]) == 0


def launch(fn: Callable, config: ParallelConfig, *args: Any, device: str = "cpu") -> Any:
    """Run `fn(groups, *args)` on every rank of `config`; rank 0's result (None on other torchrun ranks)."""
    import torch
    import torch.multiprocessing as mp

    backend = resolve_backend(config, device)
    world_size = config.world_size
    if launched_by_torchrun():
        return _run_in_place(config, backend, device, fn, args)
    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(
            f"parallel config {config.name!r} needs {world_size} GPUs, {torch.cuda.device_count()} are visible"
        )
    with tempfile.TemporaryDirectory(prefix="harts-parallel-") as directory:
        try:
            _join(world_size, config, backend, device, fn, args, directory)
        except mp.ProcessRaisedException:
            raise RankFailed(_first_failure(directory)) from None
        except mp.ProcessExitedException as error:
            cause = _first_failure(directory) or f"rank {error.error_index}: exited with code {error.exit_code}"
            raise RankFailed(cause) from None
        # Rank 0's own return value (any object `fn` returns), in this call's private temporary folder: not input.
        return torch.load(Path(directory, "rank0.pt"), weights_only=False)
