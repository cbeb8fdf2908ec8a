"""A step's device memory, and the fewest recomputed blocks with which a step fits and leaves a margin free.

`PeakMemory` measures a region's peak (the CUDA allocator's, or the process RSS sampled every 5 ms on CPU),
`release_memory` frees what a step left, `device_memory_bytes` is a GPU's total (None elsewhere: no process-wide
figure stands for a device's). `fit_recompute_blocks(probe, num_blocks, ...)` is the search behind
`recompute_blocks: auto` (`harts.engine.Engine.fit_recompute_blocks` probes with untimed steps, `probe_step`): the
fewest blocks n whose probe ran without running out of memory and peaked at most `memory_limit_bytes`, the
device's total less `memory_margin` of it (less what the caller will hold that a probe does not, and within a
given peak where one is given), by bisection from every block (`fewest_recomputed_blocks`; a search again after an
earlier one, from the blocks that one found). An answer n means that n
blocks fit and n - 1 do not (fits monotone in n). Torch is imported where used: the command lines import this.

Tested in tests/test_engine_memory.py against fake probes (the margin and its boundary, the reserved bytes, the
error naming the margin) and in tests/bench/speedup/test_recompute.py end to end against simulated memory.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from fractions import Fraction
from typing import Any


class PeakMemory:
    """Peak memory of a region: CUDA allocator peak, or the process RSS sampled every 5 ms on CPU."""

    def __init__(self, device) -> None:
        self.device = device
        self.peak = 0

    def __enter__(self) -> PeakMemory:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.base = _rss()
            self.peak = self.base
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, _rss())


def _rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as handle:
        pages = int(handle.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_memory(device, model=None) -> None:
    """Free what a measured case left (gradients of a case that failed in its backward, a failed case's graph,
    cycles through its traceback, the allocator's cached blocks) so that the next case starts from the weights
    alone."""
    import gc

    import torch

    if model is not None:
        model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def device_memory_bytes(device) -> int | None:
    """The total memory of a CUDA device (its properties' total_memory); None for the CPU."""
    import torch

    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory


def memory_limit_bytes(device_memory_bytes: int, memory_margin: float, reserved_bytes: int = 0) -> int:
    """The most a step may peak at: the device's total less `memory_margin` of it (rounded up to a byte) and less
    `reserved_bytes`."""
    # The margin as the decimal it was written as: 0.05 is 1/20, not the binary float just above or below it.
    margin_bytes = math.ceil(device_memory_bytes * Fraction(repr(float(memory_margin))))
    return device_memory_bytes - margin_bytes - reserved_bytes


class DoesNotFit(ValueError):
    """No number of recomputed blocks fits (`fewest_recomputed_blocks`): told apart from a ValueError of a probe's
    own step, which the search passes on as it is."""


def fewest_recomputed_blocks(fits: Callable[[int], bool], num_blocks: int, where: str = "in memory", *,
                             at_least: int | None = None) -> int:
    """The fewest recomputed blocks n in 0..num_blocks (at_least..num_blocks) with `fits(n)` true, fits being
    monotone (more recomputed blocks, less memory), by bisection. The first try is every block (on the GPU it also
    compiles and autotunes, with the most memory to spare); if that does not fit (`where`: the limit, for the
    message), `DoesNotFit`. With `at_least` (a search again, from the blocks an earlier one found) that number is
    tried first, and is the answer when it fits: one step more instead of a bisection."""
    too_few = -1  # the most blocks known not to fit: none known yet, so 0 blocks is tried too
    if at_least is not None:
        assert 0 <= at_least <= num_blocks, "at_least is a number of the blocks"
        if fits(at_least):
            return at_least
        too_few = at_least
    if too_few == num_blocks or not fits(num_blocks):
        raise DoesNotFit(f"the step does not fit {where} even with every block ({num_blocks}) recomputed")
    enough = num_blocks
    while enough - too_few > 1:
        middle = (too_few + enough) // 2
        if fits(middle):
            enough = middle
        else:
            too_few = middle
    return enough


def probe_step(run: Callable[[], Any], device, model) -> dict[str, Any]:
    """One untimed step (`run()`): whether it ran in the device's memory (a CUDA out-of-memory error is the answer
    no), its peak memory and seconds; what it left (`model`'s gradients too) is freed either way."""
    import torch

    start = time.perf_counter()
    fits = True
    with PeakMemory(device) as memory:
        try:
            run()
        except torch.OutOfMemoryError:
            fits = False
    release_memory(device, model)
    return {"fits": fits, "peak_memory_bytes": memory.peak, "seconds": time.perf_counter() - start}


def fit_recompute_blocks(probe: Callable[[int], dict[str, Any]], num_blocks: int, *, device_memory_bytes: int,
                         memory_margin: float, reserved_bytes: int = 0, within_bytes: int | None = None,
                         within: str = "a given peak", at_least: int | None = None) -> dict[str, Any]:
    """The search's record: the fewest `recompute_blocks` n of 0..num_blocks (at_least..num_blocks) whose
    `probe(n)` (`probe_step`'s answer) fits and peaks at most `memory_limit_bytes` (and at most `within_bytes`
    where given: `within` names it in the error), with the limit's terms and every probe in order
    (`fewest_recomputed_blocks`). `DoesNotFit` (a ValueError) when no number does, naming the limit, the margin and
    what the step did with every block; a probe's own error passes through."""
    limit = memory_limit_bytes(device_memory_bytes, memory_margin, reserved_bytes)
    probes: list[dict[str, Any]] = []

    def fits(n: int) -> bool:
        probes.append(probe(n))
        peak = probes[-1]["peak_memory_bytes"]
        return probes[-1]["fits"] and peak <= limit and (within_bytes is None or peak <= within_bytes)

    where = (f"in {limit / 1e9:.2f} GB (the device's {device_memory_bytes / 1e9:.2f} GB less memory_margin "
             f"{memory_margin:g}" + (f" and {reserved_bytes / 1e9:.2f} GB reserved" if reserved_bytes else "") + ")")
    if within_bytes is not None:
        where += f" and within {within} ({within_bytes / 1e9:.2f} GB)"
    try:
        found = fewest_recomputed_blocks(fits, num_blocks, where, at_least=at_least)
    except DoesNotFit as error:
        last = probes[-1]
        did = "ran out of memory" if not last["fits"] else f"peaked at {last['peak_memory_bytes'] / 1e9:.2f} GB"
        raise ValueError(f"{error}: with every block it {did}") from None
    search = {"recompute_blocks": found, "memory_margin": memory_margin, "device_memory_bytes": device_memory_bytes,
              "reserved_bytes": reserved_bytes, "memory_limit_bytes": limit, "probes": probes}
    if within_bytes is not None:
        search["within_peak_memory_bytes"] = within_bytes
    return search
