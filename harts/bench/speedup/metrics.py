"""The speedup record's figures from what was measured: medians over repeats (`execution_times`: per phase, the
slowest rank; F+B+G the step's critical path), each execution's results (`execution_results`), the speedups,
compression and efficiency (`speedup_metrics`), the same counted in model FLOPs (`flops_metrics`, `mfu_metrics`:
harts.model.flops's count, docs/flops.md) and why the timings should not be trusted (`timing_flags`). Arithmetic
only (no torch): tests/bench/speedup/test_metrics.py checks every figure against values worked out by hand.
"""

from __future__ import annotations

import statistics
from typing import Any

from harts.bench.speedup.executions import EXECUTIONS
from harts.model.flops import estimate_model_flops

# Timings are flagged (`timing_flags`) above this efficiency or this relative F+B+G range over repeats.
EFFICIENCY_LIMIT = 1.05
SPREAD_LIMIT = 0.10
# NVIDIA's datasheet: H100/H200 SXM dense bf16 (the measured ceiling on KINDS.md is lower).
H200_BF16_PEAK_FLOPS = 989.5e12


def speedup_metrics(base: dict[str, float], comp: dict[str, float], semantic_tokens: int,
                    compact_tokens: int) -> dict[str, float]:
    """compression S / C, F/B/Grad and Core speedups and efficiency from the executions' fbg_s and planning_s."""
    compression = semantic_tokens / compact_tokens
    fbg_speedup = base["fbg_s"] / comp["fbg_s"]
    core_speedup = (base["fbg_s"] + base["planning_s"]) / (comp["fbg_s"] + comp["planning_s"])
    return {"compression": compression, "fbg_speedup": fbg_speedup, "core_speedup": core_speedup,
            "efficiency": fbg_speedup / compression}


def execution_flops(model_config, execution: dict[str, Any]) -> dict[str, float]:
    """An execution's model FLOPs (`estimate_model_flops`) over its own rows and attention pairs, and its MTP
    depths' (`mtp_rows`, `mtp_attention_pairs`) when MTP layers ran."""
    return estimate_model_flops(model_config, execution["rows"], execution["attention_pairs"],
                                execution.get("mtp_rows", ()), execution.get("mtp_attention_pairs", ()))


def flops_metrics(model_config, base: dict[str, Any], comp: dict[str, Any]) -> dict[str, float]:
    """Compression and efficiency counted in model FLOPs instead of rows (`execution_flops` with attention, each
    execution's own rows and (query, key) pairs, MTP rows included): `flops_compression` = baseline FLOPs / compact
    FLOPs, below S / C when the compact's attention pairs shrink less than its rows (`attention_pair_ratio` above
    C / S), and `flops_efficiency` = F/B/Grad speedup / flops_compression, the compact's speed per FLOP relative
    to the baseline's. Replay rows and recomputation are overheads, not model FLOPs, on both sides."""
    def total(execution: dict[str, Any]) -> float:
        flops = execution_flops(model_config, execution)
        return flops["matmul"] + flops["attention"]

    flops_compression = total(base) / total(comp)
    return {"flops_compression": flops_compression,
            "flops_efficiency": base["fbg_s"] / comp["fbg_s"] / flops_compression}


def mfu_metrics(model_config, step, base, num_devices: int) -> dict[str, float]:
    """The baseline's model-FLOPs utilisation of the bf16 dense peak, both ways (`estimate_model_flops` over the
    step's semantic tokens and every trajectory's causal pairs, and the baseline's MTP rows and pairs when MTP
    layers ran): `baseline_mfu` with the sequence mixing (attention, linear-attention chunk work and convolutions),
    `baseline_mfu_matmul` over the per-token weight products alone."""
    pairs = int(sum(int(n) * (int(n) + 1) // 2 for n in step.lengths))
    flops = estimate_model_flops(model_config, step.num_semantic_tokens, pairs, base.get("mtp_rows", ()),
                                 base.get("mtp_attention_pairs", ()))
    peak = base["fbg_s"] * num_devices * H200_BF16_PEAK_FLOPS
    total = flops["matmul"] + flops["attention"]
    return {"baseline_model_flops": total, "baseline_matmul_flops": flops["matmul"],
            "baseline_mfu": total / peak, "baseline_mfu_matmul": flops["matmul"] / peak}


def timing_flags(results: dict[str, Any]) -> list[str]:
    """Reasons to distrust a record's timings (empty when there are none): an efficiency above
    EFFICIENCY_LIMIT (the compact rows run the same per-row work as the baseline's, so beyond noise it
    cannot beat its compression; seen as 2.86 when another job loaded the machine during the baseline),
    or an execution whose F+B+G varies by more than SPREAD_LIMIT of its median over the repeats."""
    flags = []
    if results["efficiency"] > EFFICIENCY_LIMIT:
        flags.append(f"efficiency {results['efficiency']:.2f} > {EFFICIENCY_LIMIT}: faster than the compression "
                     "allows; the timings were disturbed (a loaded machine?)")
    for name in EXECUTIONS:
        repeats = results[name]["fbg_repeats_s"]
        spread = (max(repeats) - min(repeats)) / statistics.median(repeats)
        if spread > SPREAD_LIMIT:
            flags.append(f"{name} F+B+G varies by {spread:.0%} over {len(repeats)} repeats (> {SPREAD_LIMIT:.0%}): "
                         "timing noise")
    return flags


def execution_times(samples: list[list[dict[str, float]]]) -> dict[str, float]:
    """Medians over repeats of one execution's phases; `samples[repeat][rank]` holds the rank's own seconds
    (layout, forward, backward, grad_reduce in the step, grad_reduction_alone after a barrier)."""
    per_repeat = [
        {
            "forward_s": max(r["forward"] for r in ranks),
            "backward_s": max(r["backward"] for r in ranks),
            "grad_reduction_s": max(r["grad_reduction_alone"] for r in ranks),
            "layout_s": max(r["layout"] for r in ranks),
            "fbg_s": max(r["forward"] + r["backward"] + r["grad_reduce"] for r in ranks),
        }
        for ranks in samples
    ]
    medians = {key: statistics.median(p[key] for p in per_repeat) for key in per_repeat[0]}
    return {**medians, "fbg_repeats_s": [p["fbg_s"] for p in per_repeat]}


def execution_results(samples, plan_seconds: float, peak: int, infos: list[dict], microbatches) -> dict[str, Any]:
    """One execution's results: its `execution_times`, planning (plan + layout), peak memory and its layouts' sizes."""
    times = execution_times(samples)
    return {
        **times, "planning_s": plan_seconds + times["layout_s"], "peak_memory_bytes": int(peak),
        "microbatches": len([m for m in microbatches if len(m)]),
        "rows": int(sum(i["rows"] for i in infos)),
        "attention_kv_rows": int(sum(i["attention_kv_rows"] for i in infos)),
        "attention_pairs": int(sum(i["attention_pairs"] for i in infos)),
        "kda_calls": [i["kda_calls"] for i in infos],
        **_mtp_sizes(infos),
        "samples": samples,
    }


def _mtp_sizes(infos: list[dict]) -> dict[str, list[int]]:
    """Each MTP depth's rows, semantic positions and attention pairs summed over the layouts (nothing without MTP
    layers)."""
    if not infos or "mtp_rows" not in infos[0]:
        return {}
    return {key: [int(sum(depth)) for depth in zip(*(i[key] for i in infos))]
            for key in ("mtp_rows", "mtp_semantic_tokens", "mtp_attention_pairs")}


def step_results(model_config, step, index, executions, compact_infos) -> dict[str, Any]:
    """A step's results from both executions' (`execution_results`): sizes, metrics and `timing_flags`."""
    base, comp = executions["baseline"], executions["compact"]
    results = {
        "semantic_tokens": step.num_semantic_tokens,
        "compact_tokens": comp["rows"],
        "lower_bound_compact_tokens": index.segment_tree().num_compact_tokens,
        "replay_rows": int(sum(i["replay_rows"] for i in compact_infos)),
        **speedup_metrics(base, comp, step.num_semantic_tokens, comp["rows"]),
        # The compact attention's share of the baseline's (query, key) pairs: usually above C/S, since the rows
        # compaction removes most of (shared prefixes) are those with the fewest keys, while every compact query
        # still attends to all of its ancestors; attention work that no kernel removes.
        "attention_pair_ratio": comp["attention_pairs"] / base["attention_pairs"] if base["attention_pairs"] else None,
        **flops_metrics(model_config, base, comp),
        "baseline": base,
        "compact": comp,
    }
    return {**results, "timing_flags": timing_flags(results)}
