"""One step measured in one process (`measure_step`): both executions planned (the baseline per-trajectory, the
compact one by `--planner`) on the same weights, the recomputed blocks searched where asked, a warm-up of each (on
CUDA a whole untimed step, since Triton autotunes per sequence length; on CPU the first microbatch), then
`--repeats` interleaved timed steps; medians, peak memory, the breakdown and, with `--profile`, the top ops of each
execution's largest microbatch (`profile_microbatch`). `progress` keeps the phase reached and every finished step's
seconds for an error row, and logs each step live. Tested end to end in tests/bench/speedup/test_run.py.
"""

from __future__ import annotations

from typing import Any

from harts.bench.speedup.breakdown import breakdown
from harts.bench.speedup.executions import EXECUTIONS, requested_blocks, step_configs
from harts.bench.speedup.memory import PeakMemory
from harts.bench.speedup.metrics import execution_results, mfu_metrics, step_results
from harts.bench.speedup.recompute import SEARCHED, search_recompute_blocks

def measure_step(args, model, step, device, dtype_name, progress: dict[str, Any]) -> dict[str, Any]:
    """The single-process record of one step; `progress` holds the current phase and the seconds of
    every finished step (kept in the error row if the run fails or is terminated)."""
    from harts.objective.step import DTYPES, run_step
    from harts.planning.microbatch import plan
    from harts.trees.io import check_vocabulary
    from harts.trees.trie import PrefixIndex

    check_vocabulary(step, model.config.vocab_size)
    plans = {
        "baseline": plan(step, args.capacity, 1, planner="per-trajectory"),
        "compact": plan(step, args.capacity, 1, planner=args.planner),
    }
    microbatches = {name: p.members(step) for name, p in plans.items()}
    index = PrefixIndex.from_step(step)
    requested = requested_blocks(args)
    num_blocks = model.config.num_layers
    configs = step_configs(args, dtype_name, {k: num_blocks if v in SEARCHED else v for k, v in requested.items()})
    blocks, search = search_recompute_blocks(model, step, microbatches, configs, index, device, requested, progress)
    configs = step_configs(args, dtype_name, blocks)
    for name in configs:
        progress["phase"] = f"{name} warm-up"
        _warm(model, step, microbatches[name], configs[name], index, progress)

    samples: dict[str, list] = {"baseline": [], "compact": []}
    peaks = {"baseline": 0, "compact": 0}
    infos: dict[str, list] = {}
    for repeat in range(args.repeats):
        for name in EXECUTIONS:
            progress["phase"] = f"{name} {repeat + 1}/{args.repeats}"
            with PeakMemory(device) as memory:
                result = run_step(model, step, microbatches[name], configs[name], index=index,
                                  progress=progress["phase"])
            _phase_done(progress, name, repeat + 1, result.seconds)
            model.zero_grad(set_to_none=True)
            # One process: one rank, and no gradient reduction.
            samples[name].append([{**result.seconds, "grad_reduce": 0.0, "grad_reduction_alone": 0.0}])
            peaks[name] = max(peaks[name], memory.peak)
            infos[name] = result.layout_info

    executions = {
        name: execution_results(samples[name], plans[name].plan_seconds, peaks[name], infos[name], microbatches[name])
        for name in EXECUTIONS
    }
    results = step_results(model.config, step, index, executions, infos["compact"])
    if search:
        results["recompute_search"] = search
    if device.type == "cuda":
        results.update(mfu_metrics(model.config, step, executions["baseline"], 1))
    if args.no_breakdown:
        results["breakdown_skipped"] = "--no-breakdown"
    else:
        progress["phase"] = "breakdown"
        results["breakdown"] = breakdown(model, step, microbatches, configs, index, device, DTYPES[dtype_name],
                                         executions["baseline"], executions["compact"], results["compression"])
    if args.profile:
        progress["phase"] = "profile"
        results["profile"] = {
            name: profile_microbatch(model, step, max(microbatches[name], key=lambda m: int(step.lengths[m].sum())),
                                     configs[name])
            for name in EXECUTIONS
        }
    return results


def _warm(model, step, microbatches, config, index, progress: dict[str, Any]) -> None:
    """Run the microbatches once so kernels compile and autotune outside the timings: every one on
    CUDA (Triton autotune keys include sequence lengths, so a new length tunes again inside a timed
    step), the first one (as a step of its own) on CPU."""
    import numpy as np

    from harts.objective.step import run_step

    if next(model.parameters()).device.type == "cuda":
        result = run_step(model, step, microbatches, config, index=index, progress=progress["phase"])
    else:
        first = next(m for m in microbatches if len(m))
        result = run_step(model, step.subset(first), [np.arange(len(first))], config)
    _phase_done(progress, config.execution, 0, result.seconds)
    model.zero_grad(set_to_none=True)


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


def profile_microbatch(model, step, members, config) -> dict[str, Any]:
    """Forward + backward of one microbatch under torch.profiler: its size (trajectories, semantic
    tokens, the rows the execution ran) and the top `PROFILE_TOP` ops by self device time on CUDA
    (self CPU time on CPU), with their calls."""
    import numpy as np
    from torch.profiler import ProfilerActivity, profile

    from harts.objective.step import run_step

    cuda = next(model.parameters()).device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    subset = step.subset(np.asarray(members))
    with profile(activities=activities) as prof:
        result = run_step(model, subset, [np.arange(len(members))], config)
    model.zero_grad(set_to_none=True)
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:PROFILE_TOP]
    total = sum(getattr(e, key) for e in events)
    return {
        "trajectories": len(members), "semantic_tokens": subset.num_semantic_tokens, "rows": result.num_rows,
        "sorted_by": key, "total_self_ms": total / 1e3,
        "top": [{"name": e.key[:160], "calls": e.count, "self_ms": getattr(e, key) / 1e3} for e in top],
    }
