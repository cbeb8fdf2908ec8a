"""Start the ranks of a parallel configuration and run one function on each (`launch`).

`launch(fn, config, *args, device=...)` spawns `config.world_size` processes
(torch.multiprocessing, start method "spawn"), each of which joins a process group (gloo on
CPU, NCCL on CUDA with one GPU per rank and NVLink multicast off in its environment) through a
free TCP port on 127.0.0.1 with the config's timeout, builds its `ParallelGroups` and calls
`fn(groups, *args)`. Rank 0's return value is handed back to the caller (through a temporary
file, so it may hold tensors). When the process was itself started by torchrun (RANK,
WORLD_SIZE, LOCAL_RANK and MASTER_ADDR in the environment), nothing is spawned: this process
is one rank, and `launch` returns rank 0's value on rank 0 and None elsewhere.

Failures: an exception in any rank stops every rank (torch.multiprocessing terminates the
others) and `launch` raises `RankFailed` with one line, "rank i: Type: message", naming the
rank that failed first (each failing rank records the time of its error: the peers of a crashed
rank fail later, on the lost connection); a collective waiting on a dead or diverged rank
fails after the configured timeout instead of hanging. If the caller is interrupted while the
ranks run (Ctrl-C, or SIGTERM raised by `harts.bench.records.sigterm_raises`), the ranks are
terminated before the exception propagates.
On CPU each rank uses cpu_count // world_size intra-op threads, so ranks do not oversubscribe.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def _record_error(error: BaseException, path: str) -> None:
    """When and what: written before the process group is torn down (which makes the peers fail)."""
    message = str(error).strip().splitlines()
    line = f"{type(error).__name__}: {message[0]}" if message else type(error).__name__
    Path(path).write_text(f"{time.time()!r}\n{line}")


def _run_rank(rank: int, world_size: int, config: ParallelConfig, backend: str, device_type: str,
              fn: Callable, args: tuple, error_path: str | None = None) -> Any:
    import torch
    import torch.distributed as dist

    from harts.parallel.groups import build_groups

    if backend == "nccl":
        os.environ.update(NVLINK_MULTICAST_OFF)
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=config.timeout_s),
        device_id=device if device_type == "cuda" else None,
    )
    try:
        return fn(build_groups(config, device), *args)
    except BaseException as error:
        if error_path is not None:
            _record_error(error, error_path)
        raise
    finally:
        dist.destroy_process_group()


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
        torch.save(result, Path(directory, "rank0.pt"))


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


def launch(fn: Callable, config: ParallelConfig, *args: Any, device: str = "cpu") -> Any:
    """Run `fn(groups, *args)` on every rank of `config`; rank 0's result (None on other torchrun ranks)."""
    import torch
    import torch.multiprocessing as mp

    backend = resolve_backend(config, device)
    world_size = config.world_size
    if launched_by_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world_size:
            raise ValueError(
                f"parallel config {config.name!r} needs {world_size} ranks, torchrun started {os.environ['WORLD_SIZE']}"
            )
        rank = int(os.environ["RANK"])
        result = _run_rank(rank, world_size, config, backend, device, fn, args)
        return result if rank == 0 else None
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
        return torch.load(Path(directory, "rank0.pt"), weights_only=False)
