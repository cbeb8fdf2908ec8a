"""One step measured on the ranks of a parallel configuration (`measure_parallel_step`, `--parallel NAME`): both
executions planned for dp = the config's DP degree, then on every rank (`speedup_on_rank`, through
harts.parallel.launch: gloo on CPU, NCCL on CUDA) each execution's `harts.engine.Engine` on the rank's cut of one
model, a warm-up (a whole step on CUDA, the first slot on CPU: `first_slot`) and `--repeats` interleaved steps
(`Engine.run_microbatches`: the parallel step), each rank's seconds gathered on rank 0; with an earlier case's
baseline (`reuse.ReusedBaseline`) the compact execution alone.
The record's times are medians over repeats of the slowest rank (`metrics.execution_times`); no op-level breakdown.
docs/benchmarks.md "How `speedup` measures a step" says how each figure is aggregated; tested in
tests/bench/speedup/test_parallel.py (dp2, tp2-sp, pp2, ep2 on CPU).
"""

from __future__ import annotations

import copy
import time
from typing import Any

from harts.bench.speedup.executions import EXECUTIONS, step_configs
from harts.bench.speedup.metrics import execution_results, mfu_metrics, step_results
from harts.bench.speedup.reuse import ReusedBaseline, measured_executions
from harts import engine_memory
from harts.engine_memory import PeakMemory, sync

PARALLEL_BREAKDOWN_SKIPPED = (
    "--parallel: the op-level breakdown is single-process only (it subtracts single-device op times from the "
    "measured F+B, which under --parallel also holds communication and pipeline waits)"
)


def first_slot(step, microbatches: list, dp: int) -> tuple[Any, list]:
    """The step restricted to the plan's first slot (its first dp microbatches), and those microbatches in it."""
    import numpy as np

    members = microbatches[:dp]
    sizes = np.cumsum([0] + [len(m) for m in members])
    sub = step.subset(np.concatenate(members))
    return sub, [np.arange(sizes[i], sizes[i + 1], dtype=np.int64) for i in range(len(members))]


def speedup_on_rank(groups, model_config, model_seed: int, step, microbatches: dict, configs: dict,
                    repeats: int, names: tuple[str, ...] = EXECUTIONS) -> dict[str, Any] | None:
    """Rank program of `--parallel`: warm-up (a whole step on CUDA, the first slot on CPU), then `repeats`
    interleaved timed steps of the executions `names` (default both). On global rank 0: per execution the
    per-repeat, per-rank seconds (`samples`), the peak memory (maximum over ranks) and the layouts' info of every
    microbatch; None on other ranks."""
    import torch
    import torch.distributed as dist

    from harts.engine import Engine
    from harts.model.model import HybridModel
    from harts.parallel.model import parallelize
    from harts.trees.trie import PrefixIndex

    device = groups.device
    with device:
        model = HybridModel(model_config)
    model.init_weights(model_seed)
    pmodel = parallelize(model, groups)
    engines = {name: Engine(model, configs[name], parallel=pmodel) for name in names}
    index = PrefixIndex.from_step(step)
    dp = groups.config.dp
    for name in names:
        # On CUDA a whole step (Triton autotunes per sequence length); on CPU the first slot.
        if device.type == "cuda":
            engines[name].run_microbatches(step, microbatches[name], index=index)
        else:
            engines[name].run_microbatches(*first_slot(step, microbatches[name], dp))
        model.zero_grad(set_to_none=True)
    samples: dict[str, list] = {name: [] for name in names}
    peaks = dict.fromkeys(names, 0)
    for _ in range(repeats):
        for name in names:
            dist.barrier()
            with PeakMemory(device) as memory:
                result = engines[name].run_microbatches(step, microbatches[name], index=index)
            seconds = dict(result.rank_seconds)
            # The reduction again, alone: the same collectives on gradients of the same sizes.
            dist.barrier()
            sync(device)
            start = time.perf_counter()
            pmodel.reduce_gradients()
            sync(device)
            seconds["grad_reduction_alone"] = time.perf_counter() - start
            model.zero_grad(set_to_none=True)
            gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
            dist.gather_object(seconds, gathered, dst=0)
            samples[name].append(gathered)
            peaks[name] = max(peaks[name], memory.peak)
    peak = torch.tensor([peaks[name] for name in names], dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if dist.get_rank() != 0:
        return None
    infos = {name: [engines[name].layout(step, m, index).info for m in microbatches[name]] for name in names}
    return {"samples": samples, "peak_memory_bytes": dict(zip(names, peak.tolist())), "layout_info": infos,
            "device_memory_bytes": engine_memory.device_memory_bytes(device)}


def measure_parallel_step(args, parallel, model_config, step, dtype_name,
                          reused: ReusedBaseline | None = None) -> dict[str, Any] | None:
    """The `--parallel` record's results of one step (None on a torchrun rank other than 0); `reused`: the baseline
    of an earlier case of the step, measured again only where None (every rank measures what rank 0 asks: under
    torchrun, launch broadcasts rank 0's arguments)."""
    from harts.parallel.launch import launch
    from harts.parallel.step import check_microbatches
    from harts.planning.microbatch import plan
    from harts.trees.io import check_vocabulary
    from harts.trees.trie import PrefixIndex

    check_vocabulary(step, model_config.vocab_size)
    parallel.check_model(model_config)
    plans = {
        "baseline": plan(step, args.capacity, parallel.dp, planner="per-trajectory"),
        "compact": plan(step, args.capacity, parallel.dp, planner=args.planner),
    }
    microbatches = {name: p.members(step) for name, p in plans.items()}
    for name in EXECUTIONS:
        check_microbatches(step, microbatches[name], parallel.dp)
    names = measured_executions(reused)
    measured = launch(speedup_on_rank, parallel, model_config, args.model_seed, step, microbatches,
                      step_configs(args, dtype_name, names=names), args.repeats, names, device=args.device)
    if measured is None:  # a torchrun rank other than 0
        return None
    executions = {
        name: copy.deepcopy(reused.execution) if name not in names else
        execution_results(measured["samples"][name], plans[name].plan_seconds, measured["peak_memory_bytes"][name],
                          measured["layout_info"][name], microbatches[name])
        for name in EXECUTIONS
    }
    index = PrefixIndex.from_step(step)
    results = step_results(model_config, step, index, executions, measured["layout_info"]["compact"])
    results["baseline_reused_from"] = None if reused is None else reused.source
    results["world_size"] = parallel.world_size
    results["device_memory_bytes"] = measured["device_memory_bytes"]
    if args.device == "cuda":
        results.update(mfu_metrics(model_config, step, executions["baseline"], parallel.world_size))
    results["breakdown_skipped"] = PARALLEL_BREAKDOWN_SKIPPED
    return results
