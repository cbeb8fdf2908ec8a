"""One step measured in one process (`measure_step`): both executions planned (the baseline per-trajectory, the
compact one by `--planner`) on the same weights, each run by its `harts.engine.Engine`: the recomputed blocks
searched where asked, a warm-up of each (on CUDA a whole untimed step, since Triton autotunes per sequence length; on
CPU the first microbatch), then `--repeats` interleaved timed steps (`Engine.run` inside a `PeakMemory`); medians,
peak memory, the device's total, the breakdown and, with `--profile`, the top ops of each execution's largest
microbatch (`profile_microbatch`). Given an earlier case's baseline (`reuse.ReusedBaseline`), only the compact
execution is searched, warmed up and timed, and every figure of the baseline is that case's. `progress` keeps the
phase reached and every finished step's seconds for an error row, and logs each step live. Tested end to end in
tests/bench/speedup/test_run.py and test_reuse.py.
"""

from __future__ import annotations

import copy
from typing import Any

from harts.bench.speedup.breakdown import breakdown
from harts.bench.speedup.executions import EXECUTIONS, requested_blocks, step_configs
from harts.bench.speedup.metrics import execution_results, mfu_metrics, step_results
from harts.bench.speedup.recompute import SEARCHED, search_executions
from harts.bench.speedup.reuse import ReusedBaseline, measured_executions
from harts import engine_memory
from harts.engine_memory import PeakMemory


def measure_step(args, model, step, device, dtype_name, progress: dict[str, Any],
                 reused: ReusedBaseline | None = None) -> dict[str, Any]:
    """The single-process record of one step; `progress` holds the current phase and the seconds of
    every finished step (kept in the error row if the run fails or is terminated); `reused`: the baseline of an
    earlier case of the step, measured again only where None."""
    from harts.engine import Engine, PlannedStep
    from harts.objective.step import DTYPES
    from harts.planning.microbatch import plan
    from harts.trees.io import check_vocabulary
    from harts.trees.trie import PrefixIndex

    check_vocabulary(step, model.config.vocab_size)
    # Planned without the shared index: each planner's time includes building its own (the Core speedup's).
    plans = {
        "baseline": plan(step, args.capacity, 1, planner="per-trajectory"),
        "compact": plan(step, args.capacity, 1, planner=args.planner),
    }
    index = PrefixIndex.from_step(step)
    planned = {name: PlannedStep(plan=p, microbatches=p.members(step), index=index, seconds=p.plan_seconds)
               for name, p in plans.items()}
    microbatches = {name: p.microbatches for name, p in planned.items()}
    measured = measured_executions(reused)
    requested = requested_blocks(args)
    num_blocks = model.config.num_layers
    blocks = {k: num_blocks if v in SEARCHED else v for k, v in requested.items()}
    found = {} if reused is None or reused.search is None else {"baseline": copy.deepcopy(reused.search)}
    if found:
        blocks["baseline"] = found["baseline"]["recompute_blocks"]
    configs = step_configs(args, dtype_name, blocks)
    # The baseline's engine even when reused: within-baseline probes its peak where no search record gives it.
    engines = {name: Engine(model, configs[name]) for name in EXECUTIONS}
    search = search_executions(engines, step, planned, {name: requested[name] for name in measured}, progress,
                               found)
    configs = {name: engine.config for name, engine in engines.items()}
    for name in measured:
        progress["phase"] = f"{name} warm-up"
        _warm(engines[name], step, planned[name], progress)

    samples: dict[str, list] = {name: [] for name in measured}
    peaks = dict.fromkeys(measured, 0)
    infos: dict[str, list] = {}
    for repeat in range(args.repeats):
        for name in measured:
            progress["phase"] = f"{name} {repeat + 1}/{args.repeats}"
            with PeakMemory(device) as memory:
                result = engines[name].run(step, planned[name], progress=progress["phase"])
            _phase_done(progress, name, repeat + 1, result.seconds)
            model.zero_grad(set_to_none=True)
            # One process: one rank, and no gradient reduction.
            samples[name].append([{**result.seconds, "grad_reduce": 0.0, "grad_reduction_alone": 0.0}])
            peaks[name] = max(peaks[name], memory.peak)
            infos[name] = result.layout_info

    executions = {
        name: copy.deepcopy(reused.execution) if name not in measured else
        execution_results(samples[name], plans[name].plan_seconds, peaks[name], infos[name], microbatches[name])
        for name in EXECUTIONS
    }
    results = step_results(model.config, step, index, executions, infos["compact"])
    results["baseline_reused_from"] = None if reused is None else reused.source
    results["device_memory_bytes"] = engine_memory.device_memory_bytes(device)
    if search:
        results["recompute_search"] = search
    if device.type == "cuda":
        results.update(mfu_metrics(model.config, step, executions["baseline"], 1))
    if args.no_breakdown:
        results["breakdown_skipped"] = "--no-breakdown"
    else:
        progress["phase"] = "breakdown"
        results["breakdown"] = breakdown(model, step, microbatches, configs, index, device, DTYPES[dtype_name],
                                         executions["baseline"], executions["compact"], results["compression"],
                                         baseline_ops=None if reused is None else reused.op_seconds)
    if args.profile:
        progress["phase"] = "profile"
        results["profile"] = {
            name: copy.deepcopy(reused.profile) if name not in measured else
            profile_microbatch(engines[name], step, max(microbatches[name], key=lambda m: int(step.lengths[m].sum())))
            for name in EXECUTIONS
        }
    return results


def _warm(engine, step, planned, progress: dict[str, Any]) -> None:
    """Run the microbatches once so kernels compile and autotune outside the timings: every one on
    CUDA (Triton autotune keys include sequence lengths, so a new length tunes again inside a timed
    step), the first one (as a step of its own) on CPU."""
    import numpy as np

    if next(engine.model.parameters()).device.type == "cuda":
        result = engine.run(step, planned, progress=progress["phase"])
    else:
        first = next(m for m in planned.microbatches if len(m))
        result = engine.run_microbatches(step.subset(first), [np.arange(len(first))])
    _phase_done(progress, engine.config.execution, 0, result.seconds)
    engine.model.zero_grad(set_to_none=True)


def _phase_done(progress: dict[str, Any], execution: str, repeat: int, seconds: dict[str, float]) -> None:
    """Keep a finished step's seconds for an error row, and log them live (`progress["log"]`, W&B history:
    repeat 0 is the warm-up; in one process F+B+G is F+B)."""
    progress["finished"].append({"phase": progress["phase"], **seconds})
    if "log" in progress:
        progress["log"]({"repeat": repeat, execution: {**{f"{k}_s": v for k, v in seconds.items()},
                                                       "fbg_s": seconds["forward"] + seconds["backward"]}})


# Enough ops that the compact microbatch's extra kernels (gathers, scatter-adds, per-call work) show
# beside the baseline's, not only the GEMMs and attention both share.
PROFILE_TOP = 60


def profile_microbatch(engine, step, members) -> dict[str, Any]:
    """Forward + backward of one microbatch of `engine`'s execution under torch.profiler: its size (trajectories,
    semantic tokens, the rows the execution ran) and the top `PROFILE_TOP` ops by self device time on CUDA (self
    CPU time on CPU), with their calls."""
    import numpy as np
    from torch.profiler import ProfilerActivity, profile

    cuda = next(engine.model.parameters()).device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    subset = step.subset(np.asarray(members))
    with profile(activities=activities) as prof:
        result = engine.run_microbatches(subset, [np.arange(len(members))])
    engine.model.zero_grad(set_to_none=True)
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:PROFILE_TOP]
    total = sum(getattr(e, key) for e in events)
    return {
        "trajectories": len(members), "semantic_tokens": subset.num_semantic_tokens, "rows": result.num_rows,
        "sorted_by": key, "total_self_ms": total / 1e3,
        "top": [{"name": e.key[:160], "calls": e.count, "self_ms": getattr(e, key) / 1e3} for e in top],
    }
