"""One training step under a parallel configuration (forward, loss, backward, gradient reduction).

`run_parallel_step(pmodel, step, microbatches, config)` runs on every rank of the world with
the same arguments. The microbatches are a plan's, in (slot, replica) order: K = S·D for D
data-parallel replicas, slot s holding microbatches s·D .. s·D + D − 1; replica r runs
microbatch s·D + r of every slot, in slot order, so the replicas of a slot run side by side
(the expert all-to-alls of dp-ep configurations pair them). Each microbatch's layout is built
by every rank that runs it (identically: it is deterministic), in either execution. The
stage's part of the model runs in the 1F1B order of harts.parallel.pipeline (with pp = 1: F0
B0 F1 B1 ..., the order of `run_step`); the last stage computes the log-probs and the policy
loss through `harts.objective.step.microbatch_loss` itself (handing it the stage's final hidden
states), so the loss is the single-process code; every stage adds its MoE losses ÷ K. With
`pooled_balance_coeff`, transformers' pooled load-balancing loss of each microbatch is added ÷ K too, its
statistics carried across the pipeline stages with the rows and gradients (harts.parallel.balance).
Gradients are then reduced once (`ParallelModel.reduce_gradients`).

Equivalence with `run_step` on the same microbatches (tests/parallel/test_step.py): the step
loss and the per-microbatch policy losses use the step-level normaliser, so summing them over
replicas and stages gives the single-process loss and, by linearity, gradient; each MoE loss
is per microbatch (÷ K, the number of microbatches of the step), as in one process; the
expert-bias counts are summed over replicas (and over row shards under SP). Reported values
(loss, counts, rows) are summed over the ranks that own them once (TP rank 0 unless the value
is per shard) and are the same on every rank; timings are the maximum over ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from harts.objective.step import (
    StepConfig,
    autocast_context,
    build_layout,
    check_partition,
    check_pooled_balance,
    microbatch_loss,
    recompute_blocks_by_rows,
    semantic_index,
    step_normalizer,
)
from harts.objective.targets import semantic_targets_from_step
from harts.parallel.balance import PooledBalance
from harts.parallel.comm import all_reduce_
from harts.parallel.model import ParallelModel
from harts.parallel.pipeline import PipelineLink, one_f_one_b
from harts.trees.step import Step
from harts.trees.trie import PrefixIndex

SECONDS = ("layout", "forward", "backward", "grad_reduce", "total")


class _FinalHidden:
    """Stands in for the model in `microbatch_loss`: returns the last stage's final hidden states."""

    def __init__(self, hidden: torch.Tensor, lm_head: torch.nn.Linear) -> None:
        self.hidden, self.lm_head = hidden, lm_head

    def __call__(self, input_ids, layout, recompute=False, recompute_blocks=None, keep_attention=False):
        return self.hidden, []


@dataclass
class ParallelStepResult:
    loss: float
    policy_loss: float
    moe_loss: float
    clip_fraction: float
    num_rows: int
    num_semantic_tokens: int
    seconds: dict[str, float]
    """Per phase, the maximum over ranks (forward/backward summed over this rank's microbatches)."""
    rank_seconds: dict[str, float]
    """Per phase, this rank's own seconds (the step's critical path is the maximum over ranks of their sum)."""
    tokens_per_expert: list[torch.Tensor]
    """Per MoE layer of the model, q-weighted routed assignments summed over the step."""
    pooled_balance_loss: float | None = None
    """With `pooled_balance_coeff`: the mean over microbatches of each one's transformers' load-balancing loss, without
    the coefficient (`run_step`'s; times it, it is part of `moe_loss`)."""
    logprobs: torch.Tensor | None = None
    """fp32 [S] λ in batch order, on global rank 0 when collected."""
    final_hidden: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    """Per microbatch of the plan: (final hidden [R, D] fp32, semantic rows), on global rank 0 when collected."""


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def replica_microbatches(num_microbatches: int, dp: int, dp_rank: int) -> list[int]:
    """Indices (in the plan's (slot, replica) order) of the microbatches replica `dp_rank` runs."""
    return list(range(dp_rank, num_microbatches, dp))


def check_microbatches(step: Step, microbatches: list[np.ndarray], dp: int) -> None:
    """ValueError unless the microbatches partition the step and fill dp replicas (none empty)."""
    check_partition(step, microbatches, "run_parallel_step")
    if len(microbatches) % dp:
        raise ValueError(f"run_parallel_step: {len(microbatches)} microbatches are not a multiple of dp = {dp}")
    if any(len(m) == 0 for m in microbatches):
        raise ValueError("run_parallel_step: empty microbatch (the step has fewer trajectories than dp replicas)")


def run_parallel_step(
    pmodel: ParallelModel,
    step: Step,
    microbatches: list[np.ndarray],
    config: StepConfig,
    *,
    index: PrefixIndex | None = None,
    backward: bool = True,
    collect: bool = False,
) -> ParallelStepResult:
    """Forward (+ backward and gradient reduction) of `step` on this rank; call on every rank."""
    started = time.perf_counter()
    groups = pmodel.groups
    parallel, layout_of_rank = groups.config, groups.layout
    device = groups.device
    model = pmodel.model
    microbatches = [np.asarray(m, dtype=np.int64) for m in microbatches]
    check_microbatches(step, microbatches, parallel.dp)
    check_pooled_balance(model.config, config, f"run_parallel_step under {parallel.name!r}")
    if config.execution == "compact" and index is None:
        index = PrefixIndex.from_step(step)
    targets = semantic_targets_from_step(step)
    normalizer = step_normalizer(targets, config)
    num_microbatches = len(microbatches)
    mine = replica_microbatches(num_microbatches, parallel.dp, layout_of_rank.dp_rank)
    seconds = dict.fromkeys(SECONDS, 0.0)

    start = time.perf_counter()
    layouts = [
        pmodel.prepare_layout(build_layout(step, microbatches[j], model, config, index).to(device)) for j in mine
    ]
    sem_indices = [semantic_index(step, microbatches[j]) for j in mine]
    recompute_blocks = [config.recompute_blocks] * len(layouts)
    if config.recompute_by_rows and layouts:
        # Against this rank's own microbatches (its memory); then the most of every rank's, slot by slot: a
        # recomputed MoE block exchanges its rows again in the backward, so an expert-parallel group spanning
        # replicas (which run different microbatches) must recompute the same blocks.
        mine_blocks = recompute_blocks_by_rows(config.recompute_blocks, len(pmodel.blocks), layouts)
        recompute_blocks = all_reduce_(torch.tensor(mine_blocks, device=device), dist.group.WORLD,
                                       op=dist.ReduceOp.MAX).tolist()
    _synchronize(device)
    seconds["layout"] = time.perf_counter() - start

    first, last = groups.is_first_stage, groups.is_last_stage
    link = PipelineLink(None if first else groups.previous_stage_rank, None if last else groups.next_stage_rank)
    hidden_size = model.config.hidden_size
    dtype = next(model.parameters()).dtype
    num_experts = model.config.moe.num_experts
    counts = torch.zeros(pmodel.num_moe_layers, num_experts, device=device)
    owner = layout_of_rank.tp_rank == 0
    totals = {"policy": 0.0, "moe": 0.0, "clip": 0.0, "rows": 0.0, "pooled": 0.0}
    pooled = PooledBalance(config.pooled_balance_coeff / num_microbatches, num_experts,
                           model.config.num_layers - model.config.num_dense_layers, link, device)
    stash: dict[int, tuple] = {}
    collected_logprobs, collected_hidden = [], []

    def forward(j: int) -> None:
        layout = layouts[j]
        x_in = None
        if not first:
            x_in = link.receive_forward((pmodel.rows_on_rank(layout), hidden_size), dtype, device)
            x_in.requires_grad_(backward)
        balance = None
        with torch.set_grad_enabled(backward):
            with autocast_context(device, config):
                out, auxes = pmodel.stage_forward(
                    layout, x_in, recompute=config.recompute, recompute_blocks=recompute_blocks[j],
                    keep_attention=config.keep_attention,
                )
            moe = sum((aux.loss for aux in auxes), torch.zeros((), device=device))
            if last:
                policy, _, logprobs, _, _ = microbatch_loss(
                    _FinalHidden(out, model.lm_head), layout, targets, sem_indices[j], config, normalizer, device
                )
                terms = [policy.loss + moe / num_microbatches]
            else:
                link.send_forward(out)
                terms = [out, moe / num_microbatches]
            if pooled.on:  # S = Σ q: the microbatch's semantic positions, known on every stage
                balance = pooled.forward(auxes, float(layout.semantic_rows.numel()), first=first, last=last)
                if last:
                    terms[0] = terms[0] + balance.share(balance.counts_E)
        if owner:
            totals["moe"] += float(moe.detach()) / num_microbatches
            if balance is not None and last:
                totals["pooled"] += float(balance.value) / num_microbatches
                totals["moe"] += config.pooled_balance_coeff * float(balance.value) / num_microbatches
            if last:
                totals["policy"] += float(policy.loss.detach())
                totals["clip"] += float(policy.clip_fraction)
            if first:
                totals["rows"] += layout.num_rows
        if owner or pmodel.sequence_parallel:
            for k, aux in enumerate(auxes):
                counts[k] += aux.tokens_per_expert_E.detach()
        if collect and last and owner:
            collected_logprobs.append((sem_indices[j], logprobs.detach().float().cpu()))
            collected_hidden.append((mine[j], out.detach().float().cpu(), layout.semantic_rows.cpu()))
        if backward:
            stash[j] = (x_in, terms, balance)

    def backward_step(j: int) -> None:
        x_in, terms, balance = stash.pop(j)
        if last:
            tensors, grads = terms, [None]
        else:
            out, moe_term = terms
            tensors = [out]
            grads = [link.receive_backward(tuple(out.shape), out.dtype, device)]
            if balance is not None:
                # The microbatch's counts of all layers come back with the gradient: this stage's term of the loss.
                balance.counts_E = pooled.receive_counts()
                moe_term = moe_term + balance.share(balance.counts_E)
            if moe_term.requires_grad:
                tensors.append(moe_term)
                grads.append(None)
        torch.autograd.backward(tensors, grads)
        if not first:
            link.send_backward(x_in.grad)
            if balance is not None:
                pooled.send_counts(balance.counts_E)

    schedule = one_f_one_b(len(mine), layout_of_rank.pp_rank, parallel.pp)
    if not backward:
        schedule = [(kind, j) for kind, j in schedule if kind == "F"]
    for kind, j in schedule:
        start = time.perf_counter()
        if kind == "F":
            forward(j)
        else:
            backward_step(j)
        _synchronize(device)
        seconds["forward" if kind == "F" else "backward"] += time.perf_counter() - start
    link.wait()
    if backward:
        start = time.perf_counter()
        pmodel.reduce_gradients()
        _synchronize(device)
        seconds["grad_reduce"] = time.perf_counter() - start
    seconds["total"] = time.perf_counter() - started
    return _reduce_results(pmodel, step, num_microbatches, totals, counts, seconds, collected_logprobs,
                           collected_hidden, collect, pooled.on)


def _reduce_results(pmodel, step, num_microbatches, totals, counts, seconds, logprobs, hidden, collect, pooled_on):
    device = pmodel.groups.device
    world = dist.group.WORLD
    sums = torch.tensor([totals["policy"], totals["moe"], totals["clip"], totals["rows"], totals["pooled"]],
                        dtype=torch.float64, device=device)
    all_reduce_(sums, world)
    config = pmodel.model.config
    all_counts = torch.zeros(config.num_layers - config.num_dense_layers, config.moe.num_experts, device=device)
    offset = pmodel.moe_layer_offset
    all_counts[offset : offset + pmodel.num_moe_layers] = counts
    all_reduce_(all_counts, world)
    times = torch.tensor([seconds[k] for k in SECONDS], dtype=torch.float64, device=device)
    all_reduce_(times, world, op=dist.ReduceOp.MAX)
    policy, moe, clip, rows, pooled = sums.tolist()
    result = ParallelStepResult(
        loss=policy + moe, policy_loss=policy, moe_loss=moe, clip_fraction=clip / num_microbatches,
        num_rows=int(rows), num_semantic_tokens=step.num_semantic_tokens,
        seconds=dict(zip(SECONDS, times.tolist())), rank_seconds=dict(seconds),
        tokens_per_expert=list(all_counts.cpu()),
        pooled_balance_loss=pooled if pooled_on else None,
    )
    if collect:
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object((logprobs, hidden), gathered, dst=0)
        if dist.get_rank() == 0:
            result.logprobs = torch.full((step.num_semantic_tokens,), float("nan"))
            result.final_hidden = [None] * num_microbatches
            for rank_logprobs, rank_hidden in gathered:
                for sem, values in rank_logprobs:
                    result.logprobs[torch.from_numpy(sem)] = values
                for j, h, rows in rank_hidden:
                    result.final_hidden[j] = (h, rows)
    return result
