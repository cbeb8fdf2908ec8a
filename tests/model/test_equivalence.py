"""The core claim: compact execution equals per-trajectory execution of the same weights, for both model families
(tiny: KDA + MLA; gdn-tiny: Gated DeltaNet + gated GQA, grouped values and KV heads, a gated shared expert).

On CPU in fp32, on random trees whose shared rows carry different labels, advantages and masks:
per-semantic-position log-probs (max |Δ| <= 1e-5), loss (<= 1e-6 relative), MoE losses, every
parameter gradient (<= 1e-4 relative), full-vocabulary logits (cosine >= 0.99999) and the
q-weighted expert-assignment counts of the expert-bias update (equal: sums of whole numbers), with and
without activation recomputation, GRPO (on-policy, with a KL term) and PPO (off-policy, with
old log-probs near the current ones so that part of the tokens is clipped).
"""

from dataclasses import replace

import numpy as np
import pytest
import torch

from harts.model.config import load_model_config
from harts.model.model import HybridModel
from harts.objective.losses import GRPOConfig, PPOConfig
from harts.objective.step import StepConfig, run_step
from harts.objective.verify import compare_executions
from tests.objective.helpers import random_tree_step


@pytest.fixture(scope="module", params=["tiny", "gdn-tiny"])
def model(request):
    model = HybridModel(load_model_config(request.param))
    model.init_weights(seed=42)
    return model


def _near_policy(model, step, rng, noise):
    """The step with old/ref log-probs = the model's current ones + noise (token i as a target)."""
    current = run_step(
        model, step, [np.arange(step.num_trajectories)], StepConfig(execution="baseline"),
        backward=False, collect_logprobs=True,
    ).logprobs.numpy()
    shifted = np.zeros_like(current)
    shifted[1:] = current[:-1]
    shifted[step.offsets[:-1]] = 0.0

    def jitter():
        return np.minimum(shifted + noise * rng.standard_normal(len(shifted)), 0.0).astype(np.float32)

    return replace(step, old_logprobs=jitter(), ref_logprobs=jitter())


CASES = {
    "grpo-onpolicy-kl": dict(loss="grpo", grpo=GRPOConfig(kl_coef=0.1)),
    "grpo-onpolicy-kl-recompute": dict(loss="grpo", grpo=GRPOConfig(kl_coef=0.1), recompute=True),
    "ppo-offpolicy-seq-mean": dict(loss="ppo", ppo=PPOConfig(aggregation="seq-mean-token-mean")),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_compact_equals_baseline(model, case, seed):
    rng = np.random.default_rng(42 + seed)
    tree = random_tree_step(rng, num=8, max_len=80, vocab=3)
    step = _near_policy(model, tree.step, rng, noise=0.3)
    if case.startswith("grpo-onpolicy"):
        step = replace(step, old_logprobs=None)
    assert tree.num_compact < 0.9 * step.num_semantic_tokens
    order = rng.permutation(step.num_trajectories)
    microbatches = [order[:4], order[4:]]
    settings = CASES[case]
    report = compare_executions(
        model, step, microbatches, StepConfig(execution="baseline", **settings), StepConfig(execution="compact", **settings),
    )
    assert report["candidate_rows"] < report["reference_rows"]
    assert 0 < report["clip_fraction"] < 1 if case.startswith("ppo") else report["clip_fraction"] == 0
    assert report["max_abs_logprob_diff"] <= 1e-5, report
    assert report["loss_rel_diff"] <= 1e-6, report
    assert report["moe_loss_abs_diff"] <= 1e-6 * max(1.0, abs(report["loss"])), report
    assert report["grad_rel_diff"] <= 1e-4, report
    assert report["logit_cosine_min"] >= 0.99999, report
    counts = [
        run_step(model, step, microbatches, StepConfig(execution=e, **settings), backward=False).tokens_per_expert
        for e in ("baseline", "compact")
    ]
    moe = model.config.moe
    assert len(counts[0]) == len(counts[1]) == model.config.num_layers - model.config.num_dense_layers
    for baseline_counts, compact_counts in zip(*counts):
        assert float(baseline_counts.sum()) == step.num_semantic_tokens * moe.top_k
        assert torch.equal(compact_counts, baseline_counts), (compact_counts, baseline_counts)


@pytest.fixture(scope="module")
def bailing_model():
    model = HybridModel(load_model_config("bailing-tiny"))
    model.init_weights(seed=42)
    return model


@pytest.mark.parametrize("case", ["grpo-onpolicy-kl-recompute", "ppo-offpolicy-seq-mean"])
def test_bailing_compact_equals_baseline(bailing_model, case):
    """The same claim for BailingHybrid's features (bailing-tiny: the bounded KDA gate, full-rank KDA gates, gated
    MLA with interleaved RoPE, group-limited routing, clipped SwiGLU)."""
    model = bailing_model
    rng = np.random.default_rng(7)
    tree = random_tree_step(rng, num=8, max_len=80, vocab=3)
    step = _near_policy(model, tree.step, rng, noise=0.3)
    if case.startswith("grpo-onpolicy"):
        step = replace(step, old_logprobs=None)
    order = rng.permutation(step.num_trajectories)
    settings = CASES[case]
    report = compare_executions(
        model, step, [order[:4], order[4:]], StepConfig(execution="baseline", **settings),
        StepConfig(execution="compact", **settings),
    )
    assert report["candidate_rows"] < report["reference_rows"]
    assert report["max_abs_logprob_diff"] <= 1e-5, report
    assert report["loss_rel_diff"] <= 1e-6, report
    assert report["moe_loss_abs_diff"] <= 1e-6 * max(1.0, abs(report["loss"])), report
    assert report["grad_rel_diff"] <= 1e-4, report
    assert report["logit_cosine_min"] >= 0.99999, report


def test_policy_gradient_is_exercised(model):
    """Guard against a degenerate comparison: the policy term alone moves the LM head."""
    rng = np.random.default_rng(3)
    step = replace(random_tree_step(rng, num=6, max_len=60, vocab=3).step, old_logprobs=None, ref_logprobs=None)
    model.zero_grad(set_to_none=True)
    run_step(model, step, [np.arange(step.num_trajectories)], StepConfig(execution="compact"))
    assert model.lm_head.weight.grad.norm() > 1e-3
    model.zero_grad(set_to_none=True)


def test_no_replay_stays_close(model):
    """The ablation is the same function with a different chunking: equal up to rounding."""
    rng = np.random.default_rng(5)
    step = random_tree_step(rng, num=8, max_len=80, vocab=3).step
    report = compare_executions(
        model, step, [np.arange(step.num_trajectories)], StepConfig(execution="baseline"),
        StepConfig(execution="compact", replay=False),
    )
    assert report["max_abs_logprob_diff"] <= 1e-4, report
