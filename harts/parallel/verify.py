"""A parallel step against the single-process baseline (`harts verify --parallel NAME`), and the rank programs.

`verify_on_rank(groups, ...)` (run on every rank by `launch`) initialises the model identically
on every rank, cuts it with `parallelize`, runs `run_parallel_step` for each candidate step
config (e.g. both executions, ± recomputation) collecting λ, the final hidden states and the
reduced gradients, reassembles the full gradients on rank 0 (`full_gradients`), then runs the
reference on rank 0: `run_step` of the plain model in one process on the same microbatches
(`reference_config`: the baseline execution with the candidate's loss, without
recomputation). For each candidate it reports, beside the figures of harts.objective.verify:
- max_abs_logprob_diff, loss_rel_diff, moe_loss_abs_diff;
- grad_rel_diff: max over parameters of ‖g_parallel − g_reference‖ / ‖g_reference‖, on the
  reassembled full gradients (after the TP/DP/expert-DP reduction);
- logit_cosine_min / _mean: per semantic position, cosine of the full-vocabulary logits
  (final hidden · W_lm_headᵀ, chunked, on rank 0's device) of the parallel run and of the reference;
- tokens_per_expert_max_abs_diff: the expert-bias counts;
- replica_grad_max_rel_diff: ranks holding the same parameter part (DP replicas, TP ranks of
  a whole parameter) must hold the same reduced gradient: the largest relative difference
  (0 when every copy agrees).
This is the parallel layer checking itself (its step against the single-process one); `harts verify --parallel` and
`harts bench fidelity --parallel` run it as their rank program. `harts train-step --parallel` runs the step through
`harts.engine.Engine` (`harts.engine.parallel_train_step`).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist

from harts.model.config import ModelConfig
from harts.model.model import HybridModel
from harts.objective.step import StepConfig, autocast_context, build_layout, run_step
from harts.objective.verify import agreement, logit_cosines
from harts.parallel.groups import ParallelGroups
from harts.parallel.model import ParallelModel, parallelize
from harts.parallel.step import run_parallel_step
from harts.trees.step import Step
from harts.trees.trie import PrefixIndex


def full_gradients(pmodel: ParallelModel) -> tuple[dict[str, torch.Tensor], float] | None:
    """(full gradient per parameter name, replica_grad_max_rel_diff) on global rank 0; None elsewhere."""
    entries = []
    for name, parameter in pmodel.named_parameters():
        grad = parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)
        spec = pmodel.shard_specs.get(name)
        entries.append((name, spec, grad.detach().float().cpu().clone()))
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(entries, gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    full: dict[str, torch.Tensor] = {}
    written: dict[str, torch.Tensor] = {}
    differences = []
    for rank_entries in gathered:
        for name, spec, grad in rank_entries:
            shape = spec.full_shape if spec is not None else tuple(grad.shape)
            if name not in full:
                full[name] = torch.zeros(shape)
                written[name] = torch.zeros(shape, dtype=torch.bool)
            if spec is None:
                target, mask = full[name], written[name]
            else:
                target = full[name].index_select(spec.dim, spec.index)
                mask = written[name].index_select(spec.dim, spec.index)
            if mask.any():
                difference = (target[mask] - grad[mask]).norm() / grad[mask].norm().clamp(min=1e-30)
                differences.append(float(difference))
            if spec is None:
                full[name].copy_(grad)
                written[name].fill_(True)
            else:
                full[name].index_copy_(spec.dim, spec.index, grad)
                written[name].index_fill_(spec.dim, spec.index, True)
    assert all(bool(mask.all()) for mask in written.values()), "every parameter part is held by some rank"
    # np.max keeps a NaN (Python's max would skip one that follows a finite value).
    return full, float(np.max(differences)) if differences else 0.0


def _parallel_model(groups: ParallelGroups, model_config: ModelConfig, seed: int) -> ParallelModel:
    model = HybridModel(model_config).to(groups.device)
    model.init_weights(seed)
    return parallelize(model, groups)


@torch.no_grad()
def _final_hidden(model: HybridModel, step: Step, microbatches, config: StepConfig, index: PrefixIndex):
    device = next(model.parameters()).device
    out = []
    for members in microbatches:
        layout = build_layout(step, np.asarray(members, dtype=np.int64), model, config, index).to(device)
        with autocast_context(device, config):
            hidden, _ = model(layout.input_ids, layout)
        out.append((hidden.float().cpu(), layout.semantic_rows.cpu()))
    return out


def reference_config(candidate: StepConfig) -> StepConfig:
    """The single-process reference of a candidate: the baseline execution, same loss, no recomputation."""
    return replace(candidate, execution="baseline", recompute=False, recompute_blocks=None, recompute_by_rows=False,
                   keep_attention=False, keep_kda_intermediates=False, replay=True)


def _reference(model_config: ModelConfig, seed: int, step: Step, microbatches, config: StepConfig,
               index: PrefixIndex, device: torch.device):
    model = HybridModel(model_config).to(device)
    model.init_weights(seed)
    result = run_step(model, step, microbatches, config, index=index, collect_logprobs=True)
    grads = {name: p.grad.detach().float().cpu() for name, p in model.named_parameters()}
    hidden = _final_hidden(model, step, microbatches, config, index)
    return result, grads, hidden, model.lm_head.weight.detach().float()


def verify_on_rank(
    groups: ParallelGroups, model_config: ModelConfig, seed: int, step: Step, microbatches: list[np.ndarray],
    candidates: list[StepConfig],
) -> list[dict[str, float | int]] | None:
    """One report per candidate on global rank 0 (module docstring); None on other ranks."""
    pmodel = _parallel_model(groups, model_config, seed)
    index = PrefixIndex.from_step(step)
    runs = []
    for candidate in candidates:
        pmodel.model.zero_grad(set_to_none=True)
        result = run_parallel_step(pmodel, step, microbatches, candidate, index=index, collect=True)
        runs.append((result, full_gradients(pmodel)))
    if dist.get_rank() != 0:
        return None
    references = {}
    reports = []
    for candidate, (result, (grads, replica_diff)) in zip(candidates, runs):
        key = repr(reference_config(candidate))
        if key not in references:
            references[key] = _reference(model_config, seed, step, microbatches, reference_config(candidate), index,
                                         groups.device)
        ref, ref_grads, ref_hidden, weight = references[key]
        cosines = logit_cosines(ref_hidden, result.final_hidden, weight)
        reports.append({
            "execution": candidate.execution,
            "recompute": candidate.recompute,
            "loss_function": candidate.loss,
            "semantic_tokens": step.num_semantic_tokens,
            **agreement(ref, result, ref_grads, grads, cosines),
            "clip_fraction": result.clip_fraction,
            "replica_grad_max_rel_diff": replica_diff,
            "seconds": result.seconds,
        })
    return reports
