"""Peak memory of a measured region (`PeakMemory`: the CUDA allocator's peak, or the process RSS sampled every
5 ms on CPU), the device sync around timed regions, and freeing what a measured case left (`release_memory`).

The speedup records' `peak_memory_bytes` and the recomputation search's probes come from here;
tests/bench/speedup/test_recompute.py checks that a probe that ran out of memory leaves only the weights allocated.
"""

from __future__ import annotations

import os
import threading


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
