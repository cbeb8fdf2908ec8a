"""Record factories for the report tests: records as `harts bench ...` writes them (harts.tracking.records),
with results of the documented shape and chosen numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harts.tracking.records import make_record, write_records


def speedup_record(*, model="tiny", parallel="single", step=0, semantic=4000, compact=1000, base_fbg=8.0,
                   comp_fbg=2.5, base_plan=0.1, comp_plan=0.2, error=None, breakdown=True,
                   timing_flags=()) -> dict[str, Any]:
    config = {"model": model, "parallel": parallel, "planner": "harts", "world_size": 1 if parallel == "single" else 2,
              "device": "cpu", "dtype": "fp32", "recompute": False, "trees": "data/trees/tiny/step_000.npz",
              "step": step, "capacity": 512, "repeats": 1}
    if error:
        return make_record("speedup", config, error=error)

    def execution(fbg, plan):
        return {"forward_s": 0.4 * fbg, "backward_s": 0.6 * fbg, "grad_reduction_s": 0.0, "planning_s": plan,
                "layout_s": plan / 2, "fbg_s": fbg, "peak_memory_bytes": 2**20, "samples": [{"forward": 0.4 * fbg}]}

    fbg = base_fbg / comp_fbg
    results = {"semantic_tokens": semantic, "compact_tokens": compact, "lower_bound_compact_tokens": compact - 10,
               "compression": semantic / compact, "fbg_speedup": fbg,
               "core_speedup": (base_fbg + base_plan) / (comp_fbg + comp_plan), "efficiency": fbg / (semantic / compact),
               "flops_compression": 0.9 * semantic / compact, "flops_efficiency": fbg / (0.9 * semantic / compact),
               "baseline": execution(base_fbg, base_plan), "compact": execution(comp_fbg, comp_plan),
               "timing_flags": list(timing_flags)}
    if breakdown:
        results["breakdown"] = {"ideal_compact_fbg_s": base_fbg * compact / semantic,
                                "terms_s": {"replay": 0.1, "boundary_handoff_and_calls": 0.2, "kda_other": -0.05,
                                            "ancestor_kv_attention": 0.3, "lm_head": 0.01, "per_row_other": 0.1}}
    return make_record("speedup", config, results)


def planning_record(*, planner, step, tokens, seconds, slots=(0.1, 0.2), step_imbalance=0.01, dataset="tiny",
                    error=None, seconds_without_index=None, details=None) -> dict[str, Any]:
    config = {"trees": f"configs/trees/{dataset}.yaml", "data": f"data/trees/{dataset}", "seed": 0, "step": step,
              "capacity": 512, "dp": 2, "planner": planner, "options": {}}
    if error:
        return make_record("planning", config, error=error)
    return make_record("planning", config, {
        "trajectories": 10, "semantic_tokens": 2000, "compact_tokens": tokens, "lower_bound_compact_tokens": 900,
        "microbatches": 4, "plan_seconds": seconds, "p95_slot_imbalance": max(slots), "step_imbalance": step_imbalance,
        "slot_imbalance": list(slots), "details": details or {"work_gap_to_bound": 0},
        **({} if seconds_without_index is None else {"plan_seconds_without_index": seconds_without_index})})


def fidelity_record(*, parallel="single", rerun_zero=False, error=None, depths=3, model="tiny") -> dict[str, Any]:
    """`depths`: the ablation's handoff depths 0..depths-1, depth d holding 100 + d positions (90 + d with a
    next token)."""
    config = {"model": model, "parallel": parallel, "device": "cpu", "dtype": "bf16", "trees": "x", "step": 0}
    if error:
        return make_record("fidelity", config, error=error)
    if parallel != "single":
        row = {"logit_cosine_min": 0.9999, "logit_cosine_mean": 0.99999, "abs_dloss": 1e-9, "loss_rel_diff": 1e-9,
               "grad_rel_diff": 1e-4, "replica_grad_max_rel_diff": 0.0}
        return make_record("fidelity", config, {"parallel_fidelity": {
            "baseline": {"no-recompute": row, "recompute": row}, "compact": {"no-recompute": row, "recompute": row}}})
    noise = 0.0 if rerun_zero else 0.01
    ablation = {}
    for depth in range(depths):
        no_replay = 0.01 * (1 + 0.2 * depth)
        split = 0.0 if rerun_zero else 0.02  # the split rerun's noise: replay at half of it, no-replay above
        ablation[str(depth)] = {
            "positions": 100 + depth,
            "target_positions": 90 + depth,
            "rerun": {"symkl": noise, "abs_dnll": noise},
            "split-rerun": {"symkl": split, "abs_dnll": split},
            "replay": {"symkl": noise, "abs_dnll": noise,
                       "symkl_excess_over_rerun": None if rerun_zero else 0.0,
                       "abs_dnll_excess_over_rerun": None if rerun_zero else 0.0,
                       "symkl_excess_over_split_rerun": None if rerun_zero else noise / split - 1,
                       "abs_dnll_excess_over_split_rerun": None if rerun_zero else noise / split - 1},
            "no-replay": {"symkl": no_replay, "abs_dnll": no_replay,
                          "symkl_excess_over_rerun": None if rerun_zero else no_replay / noise - 1,
                          "abs_dnll_excess_over_rerun": None if rerun_zero else no_replay / noise - 1,
                          "symkl_excess_over_split_rerun": None if rerun_zero else no_replay / split - 1,
                          "abs_dnll_excess_over_split_rerun": None if rerun_zero else no_replay / split - 1},
        }
    cosine = {path: {"min": 0.9998, "mean": 0.99999, "p001": 0.9999}
              for path in ("rerun", "split-rerun", "replay", "no-replay")}
    losses = {setting: {"loss_baseline": 1.0, "loss_compact": 1.0, "abs_dloss": 0.0, "grad_cosine": 0.99998}
              for setting in ("no-recompute", "recompute")}
    blocks = {str(layer): {"kind": kind, **{str(depth): {"rerun": 0.0, "replay": 1e-9 * layer * depth,
                                                            "no-replay": 1e-3 * depth} for depth in range(depths)}}
              for layer, kind in enumerate(("kda", "mla"))}
    return make_record("fidelity", config, {"semantic_tokens": sum(row["positions"] for row in ablation.values()),
                                            "trajectories": 4, "ablation": ablation,
                                            "block_distance": blocks, "logit_cosine": cosine,
                                            "loss_and_gradients": losses})


def write(tmp_path: Path, name: str, records: list[dict[str, Any]]) -> Path:
    path = tmp_path / name
    write_records(records, path)
    return path


def pdf_text(path: Path) -> tuple[int, str]:
    """(pages, text of every page) of a PDF, parsed with pypdf."""
    from pypdf import PdfReader

    reader = PdfReader(str(path))
    return len(reader.pages), "\n".join(page.extract_text() or "" for page in reader.pages)


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))
