"""`--recompute-blocks auto` and `--compact-recompute-blocks auto|within-baseline`: per execution, the fewest
recomputed blocks with which a whole step runs in one GPU's memory (`search_recompute_blocks`), by bisection
(`fewest_recomputed_blocks`) over untimed probe steps (`step_fits`: it fits, or runs out of memory);
`within-baseline` also asks a probe to peak no higher than a baseline step at its own blocks. The checks of these
flags (`check_recompute_flags`) and the config keys of the blocks found (`found_blocks`) live here too.

A search answers n only if n blocks fit and n - 1 do not (monotone fits); tested in
tests/bench/speedup/test_recompute.py against simulated memory on the CPU (`AUTO_DEVICES` widened).
"""

from __future__ import annotations

import time
from typing import Any

from harts.bench.speedup.memory import PeakMemory, release_memory

AUTO = "auto"
WITHIN_BASELINE = "within-baseline"
SEARCHED = (AUTO, WITHIN_BASELINE)
# `--recompute-blocks auto` probes for an out-of-memory error, which only a GPU's allocator raises (on the CPU the
# system would kill the process); the tests add the CPU to run the search against a simulated memory.
AUTO_DEVICES = ("cuda",)


def check_recompute_flags(run_args, where: str) -> None:
    """--recompute-blocks and --compact-recompute-blocks of one run's settings: each needs --recompute, and a search
    needs one process on an `AUTO_DEVICES` device (ValueError, its message prefixed by `where`)."""
    for flag in ("recompute_blocks", "compact_recompute_blocks"):
        value, name = getattr(run_args, flag), f"--{flag.replace('_', '-')}"
        if value is not None and not run_args.recompute:
            raise ValueError(f"{where}{name} needs --recompute")
        if value in SEARCHED and (run_args.device not in AUTO_DEVICES or run_args.parallel):
            raise ValueError(f"{where}{name} {value} searches one GPU's memory: it needs --device cuda and no "
                             "--parallel")


def fewest_recomputed_blocks(fits, num_blocks: int, where: str = "in memory") -> int:
    """The fewest recomputed blocks n in 1..num_blocks with `fits(n)` true, fits being monotone (more recomputed
    blocks, less memory), by bisection. The first try is every block (on the GPU it also compiles and autotunes,
    with the most memory to spare); if that does not fit (`where`: the limit, for the message), ValueError."""
    if not fits(num_blocks):
        raise ValueError(f"the step does not fit {where} even with every block ({num_blocks}) recomputed")
    too_few, enough = 0, num_blocks
    while enough - too_few > 1:
        middle = (too_few + enough) // 2
        if fits(middle):
            enough = middle
        else:
            too_few = middle
    return enough


def step_fits(model, step, microbatches, config, index, device) -> dict[str, Any]:
    """One untimed step of `config`'s execution: whether it ran in the device's memory (a CUDA out-of-memory
    error is the answer no), its peak memory and seconds; what it left is freed either way."""
    import torch

    from harts.objective.step import run_step

    start = time.perf_counter()
    fits = True
    with PeakMemory(device) as memory:
        try:
            run_step(model, step, microbatches, config, index=index)
        except torch.OutOfMemoryError:
            fits = False
    release_memory(device, model)
    return {"recompute_blocks": config.recompute_blocks, "fits": fits, "peak_memory_bytes": memory.peak,
            "seconds": time.perf_counter() - start}


def search_recompute_blocks(model, step, microbatches, configs, index, device, requested, progress) -> tuple:
    """Each execution's recompute_blocks, those `requested` as AUTO or WITHIN_BASELINE found by
    `fewest_recomputed_blocks` (probes by `step_fits`); and, per execution searched, {"recompute_blocks": found,
    "probes": [step_fits' answers]}, with WITHIN_BASELINE also "within_peak_memory_bytes" (the baseline's peak) and
    "baseline_probe" (the untimed baseline step that measured it, or None: the baseline's own search did)."""
    from dataclasses import replace

    blocks, search = dict(requested), {}
    for name, value in requested.items():  # the baseline first: within-baseline needs its blocks
        if value not in SEARCHED:
            continue
        limit, baseline_probe = None, None
        if value == WITHIN_BASELINE:
            limit, baseline_probe = _baseline_peak(model, step, microbatches, configs, index, device, search, progress)
        probes = []

        def fits(n: int) -> bool:
            progress["phase"] = f"{name} memory search ({n} blocks recomputed)"
            probes.append(step_fits(model, step, microbatches[name], replace(configs[name], recompute_blocks=n),
                                    index, device))
            return probes[-1]["fits"] and (limit is None or probes[-1]["peak_memory_bytes"] <= limit)

        where = "in memory" if limit is None else f"within the baseline's peak ({limit / 1e9:.2f} GB)"
        try:
            blocks[name] = fewest_recomputed_blocks(fits, model.config.num_layers, where)
        except ValueError as error:
            flag = "--compact-recompute-blocks" if value == WITHIN_BASELINE else "--recompute-blocks"
            raise ValueError(f"{flag} {value}: the {name} execution: {error}") from None
        search[name] = {"recompute_blocks": blocks[name], "probes": probes}
        if limit is not None:
            search[name].update(within_peak_memory_bytes=limit, baseline_probe=baseline_probe)
    return blocks, search


def _baseline_peak(model, step, microbatches, configs, index, device, search, progress) -> tuple:
    """The peak memory of a baseline step at its blocks and the probe that measured it: its search's probe at the
    blocks found (probe None), else one untimed step (`step_fits`) of `configs["baseline"]`, whose blocks were
    given."""
    if "baseline" in search:
        found = search["baseline"]["recompute_blocks"]
        return next(p["peak_memory_bytes"] for p in search["baseline"]["probes"]
                    if p["recompute_blocks"] == found and p["fits"]), None
    progress["phase"] = "baseline peak memory"
    probe = step_fits(model, step, microbatches["baseline"], configs["baseline"], index, device)
    if not probe["fits"]:
        raise ValueError("--compact-recompute-blocks within-baseline: the baseline execution does not fit in memory "
                         "at its own blocks, so it has no peak to stay within")
    return probe["peak_memory_bytes"], probe


def found_blocks(results: dict[str, Any]) -> dict[str, Any]:
    """The config keys of the blocks `--recompute-blocks auto` found, with `recompute_blocks_auto` naming the
    executions searched; empty without a search."""
    search = results.get("recompute_search")
    if not search:
        return {}
    keys = {"baseline": "recompute_blocks", "compact": "compact_recompute_blocks"}
    return {**{keys[name]: found["recompute_blocks"] for name, found in search.items()},
            "recompute_blocks_auto": sorted(search)}
