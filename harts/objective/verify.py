"""Compare two executions of the same weights on the same step (`harts verify`).

`compare_executions(model, step, microbatches, reference, candidate)` runs both step configs on
identical weights and microbatches and returns the discrepancies DESIGN §6 and issue 5 name:
- max_abs_logprob_diff: max over semantic positions of |λ_candidate − λ_reference|;
- loss_rel_diff, moe_loss_abs_diff;
- grad_rel_diff: max over parameters of ‖g_c − g_r‖ / ‖g_r‖;
- tokens_per_expert_max_abs_diff: max over MoE layers and experts of the q-weighted routed
  assignment counts' difference (the expert-bias update's input);
- mtp_loss_abs_diff, when the model's MTP layers ran (harts.objective.mtp);
- pooled_balance_loss_abs_diff, with `pooled_balance_coeff` (transformers' pooled load-balancing loss);
- logit_cosine_min / logit_cosine_mean: per semantic position, the cosine of the two
  full-vocabulary logit vectors (computed chunk by chunk, never S × V at once);
plus S and the rows each execution ran. The model's gradients are left zeroed.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from harts.model.model import HybridModel
from harts.objective.step import StepConfig, StepResult, autocast_context, build_layout, run_step
from harts.trees.step import Step
from harts.trees.trie import PrefixIndex


def _gradients(model: HybridModel) -> dict[str, torch.Tensor]:
    return {
        name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for name, p in model.named_parameters()
    }


@torch.no_grad()
def _semantic_logits_cosine(
    model: HybridModel, step: Step, microbatches: list[np.ndarray], reference: StepConfig, candidate: StepConfig,
    index: PrefixIndex, chunk: int = 2048,
) -> np.ndarray:
    device = next(model.parameters()).device
    weight = model.lm_head.weight.float()
    cosines = []
    for members in microbatches:
        members = np.asarray(members, dtype=np.int64)
        if not len(members):
            continue
        hidden = []
        for config in (reference, candidate):
            layout = build_layout(step, members, model, config, index).to(device)
            with autocast_context(device, config):
                h, _ = model(layout.input_ids, layout)
            hidden.append((h.float(), layout.semantic_rows))
        cosines.append(logit_cosines([hidden[0]], [hidden[1]], weight, chunk))
    return np.concatenate(cosines)


@torch.no_grad()
def logit_cosines(reference_hidden: list[tuple[torch.Tensor, torch.Tensor]],
                  candidate_hidden: list[tuple[torch.Tensor, torch.Tensor]], weight: torch.Tensor,
                  chunk: int = 2048) -> np.ndarray:
    """Per semantic position, the cosine of the two executions' full-vocabulary logits; each list
    holds a microbatch's (final hidden rows, semantic rows) per entry. Chunk by chunk, never S x V,
    on the weight's device (hidden rows kept on the host are moved there a chunk at a time: the
    full-vocabulary products are far too slow on a CPU for a GPU-sized step)."""
    device = weight.device
    cosines = []
    for (h_ref, rows_ref), (h_cand, rows_cand) in zip(reference_hidden, candidate_hidden):
        for lo in range(0, len(rows_ref), chunk):
            a = h_ref[rows_ref[lo : lo + chunk]].to(device) @ weight.T
            b = h_cand[rows_cand[lo : lo + chunk]].to(device) @ weight.T
            cosines.append(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).cpu().numpy())
    return np.concatenate(cosines)


def agreement(ref: StepResult, cand, ref_grads: dict[str, torch.Tensor], cand_grads: dict[str, torch.Tensor],
              cosines: np.ndarray) -> dict[str, float | int]:
    """The discrepancies of the module docstring between a reference step and a candidate (a
    StepResult, or a ParallelStepResult of `harts.parallel.verify`: the same fields)."""
    # np.max, not max(): Python's max keeps a finite value over a later NaN (a NaN gradient).
    grad_rel = float(np.max([
        float((cand_grads[n].float() - g.float()).norm() / g.float().norm().clamp(min=1e-30))
        for n, g in ref_grads.items()
    ]))
    counts = [float((a.cpu() - b.cpu()).abs().max()) for a, b in zip(cand.tokens_per_expert, ref.tokens_per_expert,
                                                                        strict=True)]
    mtp = getattr(ref, "mtp_loss", None)
    pooled = ref.pooled_balance_loss
    return {
        "reference_rows": ref.num_rows,
        "candidate_rows": cand.num_rows,
        "max_abs_logprob_diff": float((cand.logprobs - ref.logprobs).abs().max()),
        "loss": ref.loss,
        "loss_rel_diff": abs(cand.loss - ref.loss) / max(abs(ref.loss), 1e-30),
        "moe_loss_abs_diff": abs(cand.moe_loss - ref.moe_loss),
        **({} if mtp is None else {"mtp_loss_abs_diff": abs(cand.mtp_loss - mtp)}),
        **({} if pooled is None else {"pooled_balance_loss_abs_diff": abs(cand.pooled_balance_loss - pooled)}),
        "grad_rel_diff": grad_rel,
        "tokens_per_expert_max_abs_diff": float(np.max(counts)) if counts else 0.0,
        "logit_cosine_min": float(cosines.min()),
        "logit_cosine_mean": float(cosines.mean()),
    }


def compare_executions(
    model: HybridModel,
    step: Step,
    microbatches: list[np.ndarray],
    reference: StepConfig,
    candidate: StepConfig,
    *,
    index: PrefixIndex | None = None,
) -> dict[str, float | int]:
    index = index or PrefixIndex.from_step(step)
    results = []
    for config in (reference, candidate):
        model.zero_grad(set_to_none=True)
        result = run_step(model, step, microbatches, config, index=index, collect_logprobs=True)
        results.append((result, _gradients(model)))
    model.zero_grad(set_to_none=True)
    (ref, ref_grads), (cand, cand_grads) = results
    cosines = _semantic_logits_cosine(model, step, microbatches, reference, candidate, index)
    return {
        "semantic_tokens": step.num_semantic_tokens,
        **agreement(ref, cand, ref_grads, cand_grads, cosines),
        "clip_fraction": ref.clip_fraction,
    }


def baseline_and_compact(config: StepConfig) -> tuple[StepConfig, StepConfig]:
    return replace(config, execution="baseline"), replace(config, execution="compact")
