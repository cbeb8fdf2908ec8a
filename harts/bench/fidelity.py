"""`harts bench fidelity`: replay ablation and logit fidelity (DESIGN §6).

Fixed weights (seeded) and inputs (one step, or its first `--max-trees` task trees), forward in
`--dtype` (bf16 by default), each path's layouts, forwards and steps through its `harts.engine.Engine`. Five paths
compute the final hidden state of every semantic position:
- baseline: each trajectory its own sequence, packed to capacity (per-trajectory planner);
- rerun: the same, with the trajectories packed in reverse order (same math, other packing): a
  noise floor. On varlen kernels every sequence keeps its call shape, so this floor holds only
  the effects of another microbatch composition (exactly 0 on CPU);
- split rerun: the baseline's microbatches with each trajectory's MLA queries split where the
  compact execution's query groups start along its path, each part attending to all earlier
  positions (`baseline_layout(attention_splits=...)`): the same math in the compact execution's
  attention call shapes, KDA still one call per trajectory — the noise floor of "same math,
  different kernel tiling" that the compact execution is held to;
- replay: the compact execution (HARTS plan) with replay, as HARTS runs it;
- no-replay: the compact execution where a side branch takes the state at its fork directly,
  ignoring the chunk phase.

(a) Replay ablation. Per position, against the baseline: the symmetric KL of the next-token
distributions, KL(p‖q) + KL(q‖p) over the full vocabulary, and |ΔNLL| of the actual next token.
Positions are binned by handoff depth: the number of state handoffs on the chain of sequences of
the no-replay schedule that computed the position's row (0 = no handoff;
`position_handoff_depth`, which needs no model). In that schedule every side branch waits for
the call after its parent's, so a position's depth is the number of forks on its path where it
leaves the heavy child, and the largest depth of a microbatch is its no-replay call count minus 1
(the DESIGN §3 recursion with T_pre = T_in: a Horton-Strahler number of the trie): depth d needs
at least 2^d leaves in one microbatch, nested as a balanced tree (the paper's depth 4-5: 16-32).
Reported per depth 0..max: the positions and those with a next token (`positions`,
`target_positions`), the mean of each metric per path, and how far replay and no-replay exceed
each noise floor (`{metric}_excess_over_rerun`, `..._over_split_rerun` = mean_path / mean_floor
- 1; None where the floor is 0), the paper's "+32.4-36.1% SymKL, +17.0-18.7% |ΔNLL| at depth 4-5".
Where a path departs from the baseline: `block_distance`, per layer and depth, the mean relative
distance ‖x − x_base‖ / ‖x_base‖ of each block's output (fp32) at the semantic positions. With
replay the KDA layers before the first MLA layer match the baseline bit for bit (on CPU, where
the kernels are deterministic per row); differences enter where a kernel sees another call shape
(MLA over a segment's query group with its ancestors' keys vs a whole trajectory) and grow
through the later layers — as they do in the split rerun.
(b) Logit fidelity. Per-position cosine of the full-vocabulary logits of replay vs baseline,
beside both reruns vs baseline (the paper: > 0.9997, rerun 0.99972-0.99979); and the step loss and
gradient of the compact vs the baseline execution with and without per-layer recomputation
(|Δloss|, gradient cosine), both on the same microbatches (the MoE losses depend on a
microbatch's rows), trajectories packed by semantic tokens up to the longest one's length so
that the baseline holds at most that many rows. Without recomputation a microbatch keeps every
layer's activations (the h200 model ran out of the H200's 140 GB on a microbatch near 62K rows), so
`--grad-max-tokens N` restricts this comparison to trajectories of at most N tokens (the record's
`gradient_inputs` says which; under `--parallel` the whole comparison runs on them).
Logits are formed chunk by chunk from the stored hidden states (never S x V at once).

`--parallel NAME` (configs/parallel/NAME.yaml) measures (b) per parallel configuration instead:
both executions, with and without recomputation, run on the configuration's ranks
(`harts.parallel.verify.verify_on_rank`, spawned by harts.parallel.launch) and are compared with
the single-process baseline execution (no recomputation) on the same microbatches: per-position
full-vocabulary logit cosine (min, mean), |Δloss| and the relative loss difference, the largest
relative gradient difference over parameters (after the parallel reduction, reassembled), and
the agreement of the reduced gradient's copies across ranks. The microbatches are packed for
dp = the config's DP degree up to the longest trajectory's length (as the single-process
gradient comparison), on the first ⌊n / dp⌋ · dp trajectories of at most N tokens (trajectories
that each fill a microbatch form K mod dp = 0 microbatches only so; `gradient_inputs` counts
them). The replay ablation (a) is about the KDA schedule, not parallelism, and stays
single-process: a `--parallel` record (config.parallel = NAME) holds (b) only. Started by torchrun
(one node or several), every rank runs the command and rank 0 alone prints and writes the record.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

from harts.args import non_negative_int, positive_int, print_error, records_file
from harts.bench.outputs import records_files
from harts.config import execution
from harts.tracking import wandb_log

logger = logging.getLogger(__name__)

PAPER = {
    "symkl_excess_depth_4_5": (0.324, 0.361),
    "abs_dnll_excess_depth_4_5": (0.170, 0.187),
    "cosine_min": 0.9997,
    "rerun_cosine": (0.99972, 0.99979),
    "abs_dloss": 1e-8,
}
PATHS = ("rerun", "split-rerun", "replay", "no-replay")
NOISE_FLOORS = {"rerun": "rerun", "split_rerun": "split-rerun"}
"""Excess keys (`{metric}_excess_over_{key}`) and the path that gives each noise floor."""


KNOBS = ("capacity", "dtype", "attention_backend", "kda_backend", "gdn_kernel", "experts_backend",
         "logprob_chunk_rows", "logprob_grad_precision")
"""The execution knobs of the comparison (harts.config.execution); the paths fix the executions, planners and
recomputation."""


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("fidelity", help="replay ablation and logit fidelity records")
    parser.add_argument("--model", required=True, help="configs/models NAME or a YAML path")
    parser.add_argument("--trees", required=True, help="trees config NAME or YAML path, or a step path")
    parser.add_argument("--step", type=non_negative_int, default=0)
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--model-seed", type=non_negative_int, default=0)
    parser.add_argument("--max-trees", type=positive_int, default=None, help="use the first N task trees of the step")
    parser.add_argument("--device", choices=execution.DEVICES, default="cpu")
    execution.add_arguments(parser, KNOBS, dtype=dict(default="bf16", help="fp32 or bf16 (bf16 autocast; default "
                                                                          "bf16 on every device)"))
    parser.add_argument("--no-gradients", action="store_true", help="skip the loss/gradient comparison")
    parser.add_argument("--grad-max-tokens", type=positive_int, default=None,
                        help="compare loss and gradients on the trajectories of at most this many tokens (memory "
                             "without recomputation grows with the microbatch)")
    parser.add_argument("--parallel", default=None, metavar="NAME",
                        help="configs/parallel NAME or a YAML path: logit fidelity of both executions +/- "
                             "recomputation on its ranks vs the single-process baseline (no replay ablation); "
                             "spawned here, or started by torchrun: rank 0 writes the record")
    parser.add_argument("--out", type=records_file, default=None,
                        help="records file (default reports/raw/fidelity/MODEL.json)")
    wandb_log.add_arguments(parser)
    parser.set_defaults(run=run, files=records_files("fidelity"))


def _plan_members(step, capacity: int, planner: str, index=None, dp: int = 1):
    """Member indices of the planned microbatches; for dp > 1 all K of them in (slot, replica) order."""
    from harts.planning.microbatch import plan

    members = plan(step, capacity, dp, planner=planner, index=index).members(step)
    return [m for m in members if len(m) or dp > 1]


class BlockOutputs:
    """Every block's output at the semantic positions over one path's microbatches (forward hooks):
    kept ([L, S, D] fp32, the baseline's) when `reference` is None, else compared with the
    reference's kept ones as the relative distance ‖x − x_ref‖ / ‖x_ref‖ per layer and position
    ([L, S] fp32), which shows at which layer a path first departs from the baseline. `order` maps
    the path's positions to the reference's (the rerun's step is re-ordered)."""

    def __init__(self, model, num_positions: int, device, reference: BlockOutputs | None = None,
                 order=None) -> None:
        import torch

        self.blocks = model.blocks
        shape = (len(self.blocks), num_positions)
        self.kept = None if reference is not None else torch.empty(*shape, model.config.hidden_size, device=device)
        self.reference, self.order = reference, order
        self.distance = None if reference is None else torch.zeros(shape, device=device)
        self.positions = self.rows = None

    def hooks(self) -> list:
        return [block.register_forward_hook(self._hook(i)) for i, block in enumerate(self.blocks)]

    def microbatch(self, positions, rows) -> None:
        """The path positions of the next microbatch and the layout rows that hold them."""
        self.positions = positions if self.order is None else self.order[positions]
        self.rows = rows

    def _hook(self, layer: int):
        def hook(module, inputs, output):
            x = output[0][self.rows]
            if self.kept is not None:
                self.kept[layer, self.positions] = x.float()
            else:
                ref = self.reference.kept[layer, self.positions]
                self.distance[layer, self.positions] = (
                    (x.float() - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30))

        return hook


def compact_attention_splits(step, microbatches, model, config, index) -> list:
    """Per trajectory of the step: the path positions (> 0) where the compact execution's MLA query
    groups (`config`'s layouts of `microbatches`) start along its path."""
    import numpy as np

    from harts.engine import Engine

    engine = Engine(model, config)
    splits: list = [None] * step.num_trajectories
    for members in microbatches:
        layout = engine.layout(step, members, index)
        groups = layout.groups
        group_of_row = np.empty(layout.num_rows, dtype=np.int64)
        group_of_row[groups.q_index.numpy()] = np.repeat(np.arange(groups.num_groups), np.diff(groups.q_ptr.numpy()))
        along = group_of_row[layout.semantic_rows.numpy()]
        offset = 0
        for k in members.tolist():
            path = along[offset : offset + int(step.lengths[k])]
            splits[k] = np.flatnonzero(path[1:] != path[:-1]) + 1
            offset += int(step.lengths[k])
    return splits


def path_hidden(model, step, microbatches, config, index, device, dtype, blocks: BlockOutputs | None = None,
                attention_splits: list | None = None):
    """Final hidden states [S, D] of every semantic position (batch order); `blocks` also records
    every block's output at those positions; `attention_splits` (per trajectory, baseline
    execution) splits each trajectory's MLA queries there."""
    import torch
    from tqdm import tqdm

    from harts.engine import Engine
    from harts.objective.step import semantic_index

    engine = Engine(model, config)
    hidden = torch.empty(step.num_semantic_tokens, model.config.hidden_size, device=device, dtype=dtype)
    hooks = blocks.hooks() if blocks is not None else []
    try:
        with torch.no_grad():
            for members in tqdm(microbatches, desc=f"{config.execution} forward", file=sys.stderr, leave=False):
                splits = None if attention_splits is None else [attention_splits[k] for k in members.tolist()]
                layout = engine.layout(step, members, index, attention_splits=splits).to(device)
                sem_device = torch.from_numpy(semantic_index(step, members)).to(device)
                if blocks is not None:
                    blocks.microbatch(sem_device, layout.semantic_rows)
                h, _ = engine.forward(layout)
                hidden[sem_device] = h[layout.semantic_rows].to(dtype)
    finally:
        for hook in hooks:
            hook.remove()
    return hidden


def layer_table(distance: dict[str, Any], depth, kinds: list[str]) -> dict[str, Any]:
    """layer -> {"kind", depth -> path -> mean relative distance of the block output to the baseline's}."""
    table: dict[str, Any] = {}
    depths = sorted(set(depth.tolist()))
    on_host = {path: values.cpu().double() for path, values in distance.items()}
    for layer, kind in enumerate(kinds):
        row: dict[str, Any] = {"kind": kind}
        for d in depths:
            sel = depth == d
            row[str(d)] = {path: float(values[layer][sel].mean()) for path, values in on_host.items()}
        table[str(layer)] = row
    return table


def row_handoff_depth(schedule):
    """int64 [C]: handoff depth of the sequence that computed each compact row."""
    import numpy as np

    depth = np.zeros(schedule.num_compact_tokens, dtype=np.int64)
    for call in schedule.calls:
        per_row = np.repeat(call.handoff_depth, np.diff(call.cu_seqlens))
        computed = ~call.is_replay
        depth[call.rows[computed]] = per_row[computed]
    return depth


def position_handoff_depth(step, microbatches, index, chunk_size: int):
    """int64 [S] (batch order): the handoff depth of every semantic position, that of the sequence
    of the no-replay schedule (`plan_kda_calls(..., replay=False)`, as the no-replay path runs it)
    that computed the position's compact row in its microbatch. No model is needed, so a trees
    config's depths can be counted before it is run.

    Every depth from 0 to the largest occurs: a sequence at depth d > 0 starts from a state of one
    at depth d - 1, and every sequence computes at least one row."""
    import numpy as np

    from harts.objective.step import semantic_index
    from harts.planning.kda_calls import plan_kda_calls

    depth = np.zeros(step.num_semantic_tokens, dtype=np.int64)
    for members in microbatches:
        tree = index.segment_tree(members)
        schedule = plan_kda_calls(tree, chunk_size, replay=False)
        depth[semantic_index(step, members)] = row_handoff_depth(schedule)[tree.compact_map()]
    assert (np.bincount(depth) > 0).all(), "a handoff depth between 0 and the largest has no position"
    return depth


LOGIT_CHUNK_ELEMENTS = 1 << 28
"""Logits of a path formed at a time in the comparison (rows x vocabulary): with their fp64 copies for the cosine
and the softmax terms, a chunk's transients stay near 12 GB whatever the vocabulary (4,096 rows of gdn-h200's
248,320 would be 8 GB a copy)."""


def compare(weight, reference, candidate, targets, has_target, chunk: int | None = None) -> dict[str, Any]:
    """Per-position SymKL, |ΔNLL| and logit cosine of candidate vs reference hidden states, `chunk` positions at a
    time (default: `LOGIT_CHUNK_ELEMENTS` logits, at most 4,096 rows)."""
    import torch

    if chunk is None:
        chunk = max(1, min(4096, LOGIT_CHUNK_ELEMENTS // weight.shape[0]))
    with torch.no_grad():
        return _compare(weight, reference, candidate, targets, has_target, chunk)


def _compare(weight, reference, candidate, targets, has_target, chunk):
    import torch

    symkl, dnll, cosine = [], [], []
    w = weight.float()
    for lo in range(0, reference.shape[0], chunk):
        a = reference[lo : lo + chunk].float() @ w.T
        b = candidate[lo : lo + chunk].float() @ w.T
        la, lb = a.log_softmax(-1), b.log_softmax(-1)
        pa, pb = la.exp(), lb.exp()
        symkl.append(((pa - pb) * (la - lb)).sum(-1).double().cpu())
        y = targets[lo : lo + chunk]
        dnll.append((la.gather(1, y[:, None]) - lb.gather(1, y[:, None]))[:, 0].abs().double().cpu())
        cosine.append(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).cpu())
    result = {"symkl": torch.cat(symkl), "abs_dnll": torch.cat(dnll), "cosine": torch.cat(cosine)}
    result["abs_dnll"] = torch.where(has_target, result["abs_dnll"], torch.nan)
    return result


def ablation_table(per_path: dict[str, dict], depth, has_target) -> dict[str, Any]:
    """depth -> {"positions" (binned there), "target_positions" (those with a next token, over
    which |ΔNLL| is averaged), path -> {metric means, replay's and no-replay's excess over each
    floor}} for every depth that has positions."""
    import torch

    table: dict[str, Any] = {}
    for d in sorted(set(depth.tolist())):
        sel = depth == d
        row = {"positions": int(sel.sum()), "target_positions": int((sel & has_target).sum())}
        for path, metrics in per_path.items():
            row[path] = {
                "symkl": float(metrics["symkl"][sel].mean()),
                "abs_dnll": float(torch.nanmean(metrics["abs_dnll"][sel & has_target])) if (sel & has_target).any() else None,
            }
        for path in ("replay", "no-replay"):
            for metric in ("symkl", "abs_dnll"):
                for key, floor in NOISE_FLOORS.items():
                    if floor in row:
                        row[path][f"{metric}_excess_over_{key}"] = excess_over_floor(row[path][metric],
                                                                                     row[floor][metric])
        table[str(d)] = row
    return table


def excess_over_floor(value: float | None, noise: float | None) -> float | None:
    """value / noise - 1; None when either is missing or the noise floor is 0 (nothing to exceed)."""
    return value / noise - 1.0 if noise and value is not None else None


def gradient_comparison(model, step, microbatches, configs, index) -> dict[str, Any]:
    import torch

    from harts.engine import Engine

    rows = {}
    for recompute in (False, True):
        losses, grads = {}, {}
        for name in ("baseline", "compact"):
            model.zero_grad(set_to_none=True)
            config = replace(configs[name], recompute=recompute, recompute_blocks=None, recompute_by_rows=False)
            result = Engine(model, config).run_microbatches(step, microbatches[name], index=index)
            losses[name] = result.loss
            # The gradients themselves, set aside: no flat fp32 copy (44 GB at 11B parameters).
            grads[name] = [p.grad for p in model.parameters() if p.grad is not None]
        model.zero_grad(set_to_none=True)
        rows["recompute" if recompute else "no-recompute"] = {
            "loss_baseline": losses["baseline"], "loss_compact": losses["compact"],
            "abs_dloss": abs(losses["compact"] - losses["baseline"]),
            "grad_cosine": gradient_cosine(grads["baseline"], grads["compact"]),
        }
        del grads
    return rows


def gradient_cosine(first: list, second: list) -> float:
    """The cosine of two models' gradients as one flat vector each, summed parameter by parameter in fp64 (one
    parameter's fp64 copies at a time, where a flat copy of every gradient would need 8 bytes a parameter)."""
    import torch

    assert len(first) == len(second), "the same parameters have gradients"
    dot = norm_first = norm_second = torch.zeros((), dtype=torch.float64, device=first[0].device)
    for a, b in zip(first, second):
        a, b = a.double().flatten(), b.double().flatten()
        dot = dot + a @ b
        norm_first = norm_first + a @ a
        norm_second = norm_second + b @ b
    return float(dot / (norm_first.sqrt() * norm_second.sqrt()))


def _phase(progress: dict[str, str], name: str) -> None:
    progress["phase"] = name
    logger.info(f"fidelity: {name} ...")


def gradient_subset(step, max_tokens: int | None, multiple_of: int = 1):
    """The step restricted to trajectories of at most `max_tokens` tokens (all when None), and to the
    first ⌊n / multiple_of⌋ · multiple_of of them (batch order): D data-parallel replicas need K mod D = 0
    microbatches, which trajectories that each fill a microbatch can only form when n is a multiple of D."""
    import numpy as np

    keep = np.arange(step.num_trajectories) if max_tokens is None else np.flatnonzero(step.lengths <= max_tokens)
    if not len(keep) and max_tokens is not None:
        raise ValueError(f"--grad-max-tokens {max_tokens}: no trajectory is that short "
                         f"(shortest {int(step.lengths.min()):,})")
    if len(keep) < multiple_of:
        raise ValueError(f"{len(keep)} trajectories for the gradient comparison: {multiple_of} data-parallel "
                         f"replicas need at least {multiple_of}")
    keep = keep[: len(keep) - len(keep) % multiple_of]
    return step if len(keep) == step.num_trajectories else step.subset(keep)


def single_process_results(args, model, step, knobs, device, store_dtype, progress: dict[str, Any]) -> dict[str, Any]:
    """(a) the replay ablation and (b) logit fidelity, loss and gradients in one process. The results of (a) and
    of the logit fidelity go into `progress["finished"]` before the loss and gradients run, so that a record of
    their failure (out of memory: they keep every activation) still holds them."""
    import numpy as np
    import torch

    from harts.objective.step import step_config
    from harts.objective.targets import semantic_targets_from_step
    from harts.trees.trie import PrefixIndex

    configs = {
        "baseline": step_config(knobs, args.device, execution="baseline"),
        "replay": step_config(knobs, args.device, execution="compact"),
        "no-replay": step_config(knobs, args.device, execution="compact", replay=False),
    }
    index = PrefixIndex.from_step(step)
    base_mbs = _plan_members(step, args.capacity, "per-trajectory")
    compact_mbs = _plan_members(step, args.capacity, "harts", index)
    reverse = np.arange(step.num_trajectories)[::-1].copy()
    rerun_step = step.subset(reverse)
    logger.info(f"fidelity: {step.num_trajectories} trajectories, {step.num_semantic_tokens:,} tokens")
    _phase(progress, "baseline forward")
    reference = BlockOutputs(model, step.num_semantic_tokens, device)
    hidden = {"baseline": path_hidden(model, step, base_mbs, configs["baseline"], index, device, store_dtype,
                                      reference)}
    _phase(progress, "rerun forward")
    # Back to the original batch order: positions of trajectory reverse[j] in the rerun step.
    back = torch.from_numpy(np.concatenate([
        np.arange(rerun_step.offsets[j], rerun_step.offsets[j + 1]) for j in np.argsort(reverse)
    ])).to(device)
    blocks = {path: BlockOutputs(model, step.num_semantic_tokens, device, reference,
                                 order=torch.argsort(back) if path == "rerun" else None) for path in PATHS}
    rerun_hidden = path_hidden(model, rerun_step, _plan_members(rerun_step, args.capacity, "per-trajectory"),
                               configs["baseline"], None, device, store_dtype, blocks["rerun"])
    hidden["rerun"] = rerun_hidden[back]
    _phase(progress, "rerun forward with the compact execution's attention groups")
    splits = compact_attention_splits(step, compact_mbs, model, configs["replay"], index)
    hidden["split-rerun"] = path_hidden(model, step, base_mbs, configs["baseline"], index, device, store_dtype,
                                        blocks["split-rerun"], attention_splits=splits)
    _phase(progress, "compact forward with and without replay")
    hidden["replay"] = path_hidden(model, step, compact_mbs, configs["replay"], index, device, store_dtype,
                                   blocks["replay"])
    hidden["no-replay"] = path_hidden(model, step, compact_mbs, configs["no-replay"], index, device, store_dtype,
                                      blocks["no-replay"])
    chunk_size = model.config.linear_attention.chunk_size
    depth = torch.from_numpy(position_handoff_depth(step, compact_mbs, index, chunk_size))
    # The baseline's block outputs ([L, S, D] fp32: 41 GB for gdn-h200 on 2 trees) are done with once every path has
    # been measured against them; each path's BlockOutputs holds them too.
    for path_blocks in blocks.values():
        path_blocks.reference = None
    del reference
    targets = semantic_targets_from_step(step)
    next_token = torch.from_numpy(targets.targets).to(device)
    has_target = torch.ones(step.num_semantic_tokens, dtype=torch.bool)
    has_target[torch.from_numpy(step.offsets[1:] - 1)] = False
    _phase(progress, "logit comparison")
    per_path = {path: compare(model.lm_head.weight, hidden["baseline"], hidden[path], next_token, has_target)
                for path in PATHS}
    cosine = {path: {"min": float(m["cosine"].min()), "mean": float(m["cosine"].mean()),
                     "p001": float(m["cosine"].quantile(0.001))} for path, m in per_path.items()}
    results: dict[str, Any] = {
        "semantic_tokens": step.num_semantic_tokens,
        "trajectories": step.num_trajectories,
        "ablation": ablation_table(per_path, depth, has_target),
        "block_distance": layer_table({path: b.distance for path, b in blocks.items()}, depth,
                                      model.config.layer_kinds()),
        "logit_cosine": cosine,
        "paper": PAPER,
    }
    progress["finished"] = results
    if not args.no_gradients:
        # The same microbatches for both executions (MoE losses depend on a microbatch's rows):
        # trajectories packed by semantic tokens up to the longest one's length, so the baseline,
        # which keeps every activation without recomputation, holds at most that many rows.
        del hidden, rerun_hidden, per_path
        if device.type == "cuda":
            torch.cuda.empty_cache()
        _phase(progress, "loss and gradients")
        grad_step = gradient_subset(step, args.grad_max_tokens)
        grad_index = PrefixIndex.from_step(grad_step)
        grad_mbs = _plan_members(grad_step, int(grad_step.lengths.max()), "per-trajectory")
        results["loss_and_gradients"] = gradient_comparison(
            model, grad_step, {"baseline": grad_mbs, "compact": grad_mbs},
            {"baseline": configs["baseline"], "compact": configs["replay"]}, grad_index)
        results["gradient_inputs"] = {"trajectories": grad_step.num_trajectories, "max_tokens": args.grad_max_tokens,
                                      "semantic_tokens": grad_step.num_semantic_tokens}
    return results


def parallel_results(args, parallel, model_config, step, knobs) -> dict[str, Any] | None:
    """(b) under a parallel configuration: both executions +/- recomputation vs the single-process baseline
    (None on a torchrun rank other than 0)."""
    from harts.objective.step import step_config
    from harts.parallel.launch import is_reporting_rank, launch
    from harts.parallel.step import check_microbatches
    from harts.parallel.verify import verify_on_rank

    parallel.check_model(model_config)
    step = gradient_subset(step, args.grad_max_tokens, multiple_of=parallel.dp)
    capacity = int(step.lengths.max())
    # Packed by semantic tokens (as in the single-process comparison): the baseline holds at most T rows.
    microbatches = _plan_members(step, capacity, "per-trajectory", dp=parallel.dp)
    check_microbatches(step, microbatches, parallel.dp)
    candidates = [step_config(knobs, args.device, execution=name, recompute=recompute)
                  for name in ("baseline", "compact") for recompute in (False, True)]
    if is_reporting_rank():
        logger.info(f"fidelity --parallel {parallel.name}: {step.num_trajectories} trajectories, "
                    f"{step.num_semantic_tokens:,} tokens, {len(microbatches)} microbatches on "
                    f"{parallel.world_size} ranks")
    reports = launch(verify_on_rank, parallel, model_config, args.model_seed, step, microbatches, candidates,
                     device=args.device)
    if reports is None:  # a torchrun rank other than 0
        return None
    return {
        "semantic_tokens": step.num_semantic_tokens,
        "trajectories": step.num_trajectories,
        "world_size": parallel.world_size,
        "microbatches": len(microbatches),
        "microbatch_capacity": capacity,
        "gradient_inputs": {"trajectories": step.num_trajectories, "max_tokens": args.grad_max_tokens,
                            "semantic_tokens": step.num_semantic_tokens},
        "parallel_fidelity": parallel_fidelity_rows(reports),
        "paper": PAPER,
    }


def parallel_fidelity_rows(reports: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """execution -> "no-recompute"/"recompute" -> figures, from `verify_on_rank`'s reports (|Δloss| recovered
    from its relative difference and reference loss)."""
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    for report in reports:
        reference = report["loss"]
        rows.setdefault(report["execution"], {})["recompute" if report["recompute"] else "no-recompute"] = {
            "logit_cosine_min": report["logit_cosine_min"],
            "logit_cosine_mean": report["logit_cosine_mean"],
            "loss_reference": reference,
            "abs_dloss": report["loss_rel_diff"] * max(abs(reference), 1e-30),
            "loss_rel_diff": report["loss_rel_diff"],
            "max_abs_logprob_diff": report["max_abs_logprob_diff"],
            "moe_loss_abs_diff": report["moe_loss_abs_diff"],
            "grad_rel_diff": report["grad_rel_diff"],
            "replica_grad_max_rel_diff": report["replica_grad_max_rel_diff"],
            "tokens_per_expert_max_abs_diff": report["tokens_per_expert_max_abs_diff"],
            "reference_rows": report["reference_rows"],
            "candidate_rows": report["candidate_rows"],
        }
    return rows


def run(args: argparse.Namespace) -> int:
    import torch

    from harts.config import config_to_dict
    from harts.model.config import load_model_config_with
    from harts.model.model import HybridModel
    from harts.objective.step import check_baseline_gdn_kernel
    from harts.parallel.config import load_parallel_config
    from harts.parallel.launch import RankFailed, check_torchrun, is_reporting_rank
    from harts.tracking.records import Terminated, error_message, make_record, sigterm_raises, write_records
    from harts.tracking.wandb_log import log_records, options
    from harts.trees.io import check_vocabulary
    from harts.trees.sources import first_trees, iter_steps

    knobs = execution.ExecutionConfig(**execution.from_arguments(args, KNOBS)).resolved(args.device)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    parallel = load_parallel_config(args.parallel) if args.parallel else None
    check_torchrun(parallel)
    if parallel is not None and args.no_gradients:
        raise ValueError("--no-gradients: the --parallel comparison always includes the loss and gradients")
    model_config = load_model_config_with(args.model, knobs.experts_backend)
    check_baseline_gdn_kernel(model_config, replace(knobs, execution="baseline"), args.device,
                              name=execution.flag("gdn_kernel"))
    if parallel is None:
        with device:
            model = HybridModel(model_config)
        model.init_weights(args.model_seed)
    store_dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    (_, full_step, meta), = iter_steps(args.trees, args.seed, [args.step])
    step = first_trees(full_step, args.max_trees)
    if not is_reporting_rank():
        # A torchrun rank other than 0: its part of the run, nothing printed or written (rank 0 writes the record).
        check_vocabulary(step, model_config.vocab_size)
        try:
            parallel_results(args, parallel, model_config, step, knobs)
        except RankFailed as error:
            print_error(str(error))
            return 1
        return 0
    config = {"model": model_config.name, "model_config": config_to_dict(model_config), **meta,
              "max_trees": args.max_trees, "capacity": args.capacity, "device": args.device, "dtype": args.dtype,
              "parallel": parallel.name if parallel else "single", "world_size": parallel.world_size if parallel else 1,
              "parallel_config": config_to_dict(parallel) if parallel else None,
              "execution": {name: getattr(knobs, name) for name in KNOBS}}
    out = Path(args.out)  # the default set when the command started (harts.bench.outputs.records_files)
    progress: dict[str, Any] = {"phase": "setup"}  # the single-process phase an error row names, what it finished
    try:
        with sigterm_raises():
            check_vocabulary(step, model_config.vocab_size)
            if parallel is None:
                results = single_process_results(args, model, step, knobs, device, store_dtype, progress)
            else:
                results = parallel_results(args, parallel, model_config, step, knobs)
        records = [make_record("fidelity", config, results)]
    except (RuntimeError, ValueError, torch.OutOfMemoryError, Terminated) as error:
        message = error_message(error)
        if progress["phase"] != "setup":
            message = f"{progress['phase']}: {message}"
        if os.environ.get("HARTS_DEBUG"):
            traceback.print_exc()
        records = [make_record("fidelity", config, error=message)]
        if "finished" in progress:
            records[0]["finished_results"] = progress["finished"]
        if isinstance(error, Terminated):
            write_records(records, out)
            return 128 + signal.SIGTERM
    write_records(records, out)
    print(format_fidelity(records[0]))
    log_records(records, options(args))
    return 0 if "error" not in records[0] else 1


def format_fidelity(record: dict[str, Any]) -> str:
    if "error" in record:
        finished = " (the replay ablation and logit fidelity finished: the record's finished_results)" if (
            "finished_results" in record) else ""
        return f"fidelity: error: {record['error']}{finished}"
    r = record["results"]
    if "parallel_fidelity" in r:
        return _format_parallel(record["config"]["parallel"], r["parallel_fidelity"])
    lines = ["excess = path mean / noise floor mean - 1, over the rerun and over the split rerun", "",
             "| handoff depth | positions | metric | rerun | split rerun | replay (excess) | no-replay (excess) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]

    def cell(row, path, metric):
        value = row.get(path, {}).get(metric)
        if value is None:
            return "n/a"
        excess = [row[path].get(f"{metric}_excess_over_{key}") for key in NOISE_FLOORS]
        shown = "; ".join("undef." if e is None else f"{e:+.1%}" for e in excess)
        return f"{value:.3g}" + (f" ({shown})" if path in ("replay", "no-replay") else "")

    for depth, row in r["ablation"].items():
        for metric, name in (("symkl", "SymKL"), ("abs_dnll", "abs dNLL")):
            lines.append(f"| {depth} | {row['positions']:,} | {name} | "
                         + " | ".join(cell(row, path, metric) for path in PATHS) + " |")
    lines += ["", "| layer | kind | handoff depth | block distance: rerun | split rerun | replay | no-replay |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for layer, row in r.get("block_distance", {}).items():
        for depth, paths in row.items():
            if depth != "kind":
                lines.append(f"| {layer} | {row['kind']} | {depth} | "
                             + " | ".join(f"{paths[path]:.3g}" for path in PATHS) + " |")
    cos = r["logit_cosine"]
    lines.append("")
    lines.append(f"logit cosine vs baseline: replay min {cos['replay']['min']:.6f} mean {cos['replay']['mean']:.6f}; "
                 f"rerun min {cos['rerun']['min']:.6f} mean {cos['rerun']['mean']:.6f}; "
                 f"split rerun min {cos['split-rerun']['min']:.6f} mean {cos['split-rerun']['mean']:.6f}; "
                 f"no-replay min {cos['no-replay']['min']:.6f}")
    for setting, row in r.get("loss_and_gradients", {}).items():
        lines.append(f"{setting}: |dloss| {row['abs_dloss']:.3g}, gradient cosine {row['grad_cosine']:.6f}")
    return "\n".join(lines)


def _format_parallel(name: str, rows: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = [f"| {name} vs single-process baseline | logit cosine min | mean | abs dloss | grad rel diff | "
             "replica grad rel diff |", "| --- | --- | --- | --- | --- | --- |"]
    for execution, settings in rows.items():
        for setting, row in settings.items():
            lines.append(f"| {execution}, {setting} | {row['logit_cosine_min']:.6f} | {row['logit_cosine_mean']:.6f} | "
                         f"{row['abs_dloss']:.3g} | {row['grad_rel_diff']:.3g} | "
                         f"{row['replica_grad_max_rel_diff']:.3g} |")
    lines.append(f"| paper | > {PAPER['cosine_min']} | | < {PAPER['abs_dloss']:g} | | |")
    return "\n".join(lines)
