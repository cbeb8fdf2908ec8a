import math

import numpy as np
import pytest
import torch

from harts.objective.logprobs import compact_logprobs, naive_compact_logprobs
from harts.objective.losses import GRPOConfig, PPOConfig, aggregate, grpo_loss, k3_kl, ppo_loss, step_kl
from harts.objective.targets import semantic_targets_from_step

from .helpers import random_tree_step


def _hand_case():
    """Ratios 1.5, 0.5, 0.5, 1.1 on masked positions; an infinite ratio on a masked-out one."""
    old = torch.tensor([-1.0, -1.0, -1.0, -1.0, -math.inf], dtype=torch.float64)
    ratio = torch.tensor([1.5, 0.5, 0.5, 1.1, 1.0], dtype=torch.float64)
    logprobs = (old.nan_to_num(neginf=0.0) + ratio.log()).requires_grad_()
    advantages = torch.tensor([1.0, 2.0, -1.0, -3.0, -5.0], dtype=torch.float64)
    mask = torch.tensor([1, 1, 1, 1, 0], dtype=torch.bool)
    return logprobs, old, advantages, mask


def test_grpo_hand_computed_token_mean():
    logprobs, old, advantages, mask = _hand_case()
    # ℓ = [-1.2 (clipped), -1.0, 0.8 (clipped), 3.3]; the masked-out position is taken at ratio 1.
    out = grpo_loss(
        logprobs, advantages_S=advantages, loss_mask_S=mask, old_logprobs_S=old, config=GRPOConfig()
    )
    assert float(out.per_token_loss[4].detach()) == 5.0
    assert out.loss.item() == pytest.approx((-1.2 - 1.0 + 0.8 + 3.3) / 4, rel=1e-12)
    assert float(out.clip_fraction) == pytest.approx(0.5)
    assert out.kl is None
    out.loss.backward()
    expected = torch.tensor([0.0, -1.0 / 4, 0.0, 3.3 / 4, 0.0], dtype=torch.float64)
    assert torch.allclose(logprobs.grad, expected)


def test_grpo_hand_computed_seq_mean_token_mean():
    logprobs, old, advantages, mask = _hand_case()
    config = GRPOConfig(aggregation="seq-mean-token-mean")
    trajectory = torch.tensor([0, 0, 0, 1, 1])
    out = grpo_loss(
        logprobs, advantages_S=advantages, loss_mask_S=mask, old_logprobs_S=old,
        trajectory_index_S=trajectory, config=config,
    )
    assert out.loss.item() == pytest.approx(((-1.2 - 1.0 + 0.8) / 3 + 3.3) / 2, rel=1e-12)
    out.loss.backward()
    expected = torch.tensor([0.0, -1.0 / 6, 0.0, 3.3 / 2, 0.0], dtype=torch.float64)
    assert torch.allclose(logprobs.grad, expected)


def test_asymmetric_clip():
    logprobs = torch.tensor([math.log(1.25)], dtype=torch.float64, requires_grad=True)
    args = dict(advantages_S=torch.ones(1, dtype=torch.float64), loss_mask_S=torch.ones(1, dtype=torch.bool),
                old_logprobs_S=torch.zeros(1, dtype=torch.float64))
    assert grpo_loss(logprobs, config=GRPOConfig(), **args).loss.item() == pytest.approx(-1.2)
    dapo = grpo_loss(logprobs, config=GRPOConfig(clip_ratio_high=0.28), **args)
    assert dapo.loss.item() == pytest.approx(-1.25) and float(dapo.clip_fraction) == 0.0


def test_on_policy_ratio_is_one_with_gradient():
    logprobs = torch.tensor([-2.0, -0.5, -1.0], dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([0.5, -2.0, 3.0], dtype=torch.float64)
    mask = torch.tensor([True, True, False])
    out = ppo_loss(logprobs, advantages_S=advantages, loss_mask_S=mask, config=PPOConfig())
    assert out.loss.item() == pytest.approx(-(0.5 - 2.0) / 2)
    out.loss.backward()
    assert torch.allclose(logprobs.grad, torch.tensor([-0.25, 1.0, 0.0], dtype=torch.float64))


def test_kl_k3_penalty():
    logprobs = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5, -1.0], dtype=torch.float64)
    delta = torch.tensor([-0.5, 1.0], dtype=torch.float64)
    out = grpo_loss(
        logprobs, advantages_S=torch.zeros(2, dtype=torch.float64),
        loss_mask_S=torch.ones(2, dtype=torch.bool), ref_logprobs_S=ref, config=GRPOConfig(kl_coef=0.1),
    )
    k3 = torch.exp(delta) - delta - 1
    assert torch.allclose(k3_kl(logprobs, ref), k3)
    assert out.loss.item() == pytest.approx(0.1 * float(k3.mean()), rel=1e-12)
    assert float(out.kl) == pytest.approx(float(k3.mean()), rel=1e-6)
    out.loss.backward()
    assert torch.allclose(logprobs.grad, 0.1 * (1 - torch.exp(delta)) / 2)


def test_ppo_dual_clip():
    ratio = torch.tensor([4.0, 2.0, 0.5], dtype=torch.float64)
    logprobs = ratio.log().requires_grad_()
    advantages = torch.tensor([-1.0, -1.0, 1.0], dtype=torch.float64)
    args = dict(advantages_S=advantages, loss_mask_S=torch.ones(3, dtype=torch.bool),
                old_logprobs_S=torch.zeros(3, dtype=torch.float64))
    assert ppo_loss(logprobs, config=PPOConfig(), **args).loss.item() == pytest.approx((4.0 + 2.0 - 0.5) / 3)
    out = ppo_loss(logprobs, config=PPOConfig(dual_clip_ratio=3.0), **args)
    assert out.loss.item() == pytest.approx((3.0 + 2.0 - 0.5) / 3)
    out.loss.backward()
    assert torch.allclose(logprobs.grad, torch.tensor([0.0, 2.0 / 3, -0.5 / 3], dtype=torch.float64))


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_microbatches_with_step_normalizer_add_up(aggregation):
    generator = torch.Generator().manual_seed(42)
    size = 60
    trajectory = torch.sort(torch.randint(0, 8, (size,), generator=generator)).values
    mask = torch.rand(size, generator=generator) < 0.6
    logprobs = -torch.rand(size, generator=generator, dtype=torch.float64) * 3
    old = logprobs + 0.3 * torch.randn(size, generator=generator, dtype=torch.float64)
    advantages = torch.randn(size, generator=generator, dtype=torch.float64)
    config = GRPOConfig(aggregation=aggregation)

    def loss(select, normalizer=None):
        return grpo_loss(
            logprobs[select], advantages_S=advantages[select], loss_mask_S=mask[select],
            old_logprobs_S=old[select], trajectory_index_S=trajectory[select], config=config,
            normalizer=normalizer,
        ).loss

    everything = torch.ones(size, dtype=torch.bool)
    whole = loss(everything)
    if aggregation == "token-mean":
        normalizer = int(mask.sum())
    else:
        normalizer = int(torch.unique(trajectory[mask]).numel())
    first = trajectory < 4
    summed = loss(first, normalizer) + loss(~first, normalizer)
    assert summed.item() == pytest.approx(whole.item(), rel=1e-12)


def test_no_masked_positions_gives_zero():
    logprobs = torch.tensor([-1.0, -2.0], requires_grad=True)
    out = grpo_loss(logprobs, advantages_S=torch.ones(2), loss_mask_S=torch.zeros(2, dtype=torch.bool),
                    config=GRPOConfig())
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert torch.equal(logprobs.grad, torch.zeros(2))


def test_gradcheck_grpo_with_kl():
    generator = torch.Generator().manual_seed(42)
    size = 12
    logprobs = (-torch.rand(size, generator=generator, dtype=torch.float64) * 3).requires_grad_()
    old = logprobs.detach() + 0.5 * torch.randn(size, generator=generator, dtype=torch.float64)
    ref = logprobs.detach() + 0.5 * torch.randn(size, generator=generator, dtype=torch.float64)
    advantages = torch.randn(size, generator=generator, dtype=torch.float64)
    mask = torch.rand(size, generator=generator) < 0.8
    trajectory = torch.arange(size) // 4
    config = GRPOConfig(kl_coef=0.05, clip_ratio_high=0.28, aggregation="seq-mean-token-mean")
    assert torch.autograd.gradcheck(
        lambda lp: grpo_loss(
            lp, advantages_S=advantages, loss_mask_S=mask, old_logprobs_S=old, ref_logprobs_S=ref,
            trajectory_index_S=trajectory, config=config,
        ).loss,
        (logprobs,),
    )


@pytest.mark.parametrize(
    "config", [GRPOConfig(kl_coef=0.02), GRPOConfig(clip_ratio_high=0.28, aggregation="seq-mean-token-mean"),
               PPOConfig(dual_clip_ratio=3.0)],
    ids=["grpo-kl-token-mean", "dapo-seq-mean", "ppo-dual-clip"],
)
@pytest.mark.parametrize("chunk_rows", [7, 4096], ids=["chunk7", "chunk4096"])
def test_compact_equals_naive_on_random_trees(config, chunk_rows):
    """DESIGN §5 equivalence on CPU fp32: log-probs, loss and every gradient agree."""
    rng = np.random.default_rng(42)
    tree = random_tree_step(rng, num=16, max_len=40, vocab=6)
    shifted = semantic_targets_from_step(tree.step)
    generator = torch.Generator().manual_seed(42)
    hidden_CD = torch.randn(tree.num_compact, 32, generator=generator)
    weight_VD = torch.randn(6, 32, generator=generator) / 4
    compact_index = torch.from_numpy(tree.compact_map)
    targets = torch.from_numpy(shifted.targets)
    xi = dict(
        advantages_S=torch.from_numpy(shifted.advantages), loss_mask_S=torch.from_numpy(shifted.loss_mask),
        old_logprobs_S=torch.from_numpy(shifted.old_logprobs),
        trajectory_index_S=torch.from_numpy(shifted.trajectory_index),
    )
    if isinstance(config, GRPOConfig):
        xi["ref_logprobs_S"] = torch.from_numpy(shifted.ref_logprobs)
    loss_function = grpo_loss if isinstance(config, GRPOConfig) else ppo_loss

    results = []
    for function, kwargs in ((compact_logprobs, {"chunk_rows": chunk_rows}), (naive_compact_logprobs, {})):
        hidden = hidden_CD.clone().requires_grad_()
        weight = weight_VD.clone().requires_grad_()
        logprobs = function(hidden, weight, compact_index, targets, **kwargs)
        out = loss_function(logprobs, config=config, **xi)
        out.loss.backward()
        results.append((logprobs.detach(), out.loss.detach(), hidden.grad, weight.grad, out.clip_fraction))
    (lp, loss, grad_h, grad_w, clip), (lp_ref, loss_ref, grad_h_ref, grad_w_ref, clip_ref) = results
    assert 0 < float(clip_ref) < 1
    assert float((lp - lp_ref).abs().max()) <= 1e-5
    assert abs(float(loss - loss_ref)) <= 1e-6 * abs(float(loss_ref))
    assert float((grad_h - grad_h_ref).abs().max() / grad_h_ref.abs().max()) <= 1e-4
    assert float((grad_w - grad_w_ref).abs().max() / grad_w_ref.abs().max()) <= 1e-4


@pytest.mark.parametrize(
    "make",
    [
        lambda: GRPOConfig(aggregation="sum"),
        lambda: GRPOConfig(clip_ratio_low=1.0),
        lambda: GRPOConfig(kl_coef=-0.1),
        lambda: PPOConfig(dual_clip_ratio=1.0),
    ],
    ids=["unknown-aggregation", "clip-low-1", "negative-kl", "dual-clip-1"],
)
def test_bad_configs(make):
    with pytest.raises(ValueError):
        make()


@pytest.mark.parametrize("case", ["kl-without-ref", "seq-mean-without-ids", "length-mismatch"])
def test_bad_inputs(case):
    logprobs = torch.zeros(4, requires_grad=True)
    kwargs = dict(advantages_S=torch.ones(4), loss_mask_S=torch.ones(4, dtype=torch.bool))
    config = GRPOConfig()
    if case == "kl-without-ref":
        config = GRPOConfig(kl_coef=0.1)
    elif case == "seq-mean-without-ids":
        config = GRPOConfig(aggregation="seq-mean-token-mean")
    else:
        kwargs["advantages_S"] = torch.ones(3)
    with pytest.raises(ValueError):
        grpo_loss(logprobs, config=config, **kwargs)


def test_aggregate_matches_definition():
    per_token = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    mask = torch.tensor([1, 1, 0, 1, 1], dtype=torch.bool)
    trajectory = torch.tensor([2, 2, 2, 0, 0])
    assert float(aggregate(per_token, mask, aggregation="token-mean")) == pytest.approx(12 / 4)
    assert float(aggregate(per_token, mask, aggregation="token-mean", normalizer=6)) == pytest.approx(2.0)
    seq = aggregate(per_token, mask, aggregation="seq-mean-token-mean", trajectory_index_S=trajectory)
    assert float(seq) == pytest.approx((1.5 + 4.5) / 2)


def _masked_out_case(field, value):
    """Random off-policy GRPO inputs whose masked-out positions hold `value` in `field` (old or
    ref log-probs; e.g. a padded or unscored token) instead of a finite log-prob."""
    generator = torch.Generator().manual_seed(42)
    size = 16
    logprobs = -torch.rand(size, generator=generator, dtype=torch.float64) * 3
    xi = dict(
        advantages_S=torch.randn(size, generator=generator, dtype=torch.float64),
        loss_mask_S=torch.arange(size) % 3 != 0,
        old_logprobs_S=logprobs + 0.5 * torch.randn(size, generator=generator, dtype=torch.float64),
        ref_logprobs_S=logprobs + 0.5 * torch.randn(size, generator=generator, dtype=torch.float64),
        trajectory_index_S=torch.arange(size) // 4,
    )
    xi[field] = torch.where(xi["loss_mask_S"], xi[field], value)
    return logprobs.requires_grad_(), xi


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize(
    ("loss", "field"),
    [("grpo-kl", "ref_logprobs_S"), ("grpo-kl", "old_logprobs_S"), ("ppo", "old_logprobs_S")],
    ids=["grpo-kl-ref", "grpo-kl-old", "ppo-old"],
)
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_non_finite_logprobs_at_masked_out_positions_change_nothing(aggregation, loss, field, value):
    """Loss, per-token losses, diagnostics and the gradient are finite and equal to those with a
    finite log-prob there: masked-out positions take ratio 1 and a zero KL delta (a NaN there
    would turn the zero gradient of the masked loss into 0·NaN = NaN)."""
    outputs = []
    for bad in (-1.0, value):
        logprobs, xi = _masked_out_case(field, bad)
        if loss == "grpo-kl":
            out = grpo_loss(logprobs, config=GRPOConfig(kl_coef=0.1, aggregation=aggregation), **xi)
        else:
            del xi["ref_logprobs_S"]
            out = ppo_loss(logprobs, config=PPOConfig(dual_clip_ratio=3.0, aggregation=aggregation), **xi)
        out.loss.backward()
        outputs.append((out, logprobs.grad))
    (finite, finite_grad), (out, grad) = outputs
    assert torch.isfinite(grad).all() and torch.isfinite(out.per_token_loss).all()
    assert torch.equal(out.loss, finite.loss) and torch.equal(grad, finite_grad)
    assert torch.equal(out.per_token_loss, finite.per_token_loss)
    assert torch.equal(out.clip_fraction, finite.clip_fraction)
    assert (out.kl is None) == (finite.kl is None) and (out.kl is None or torch.equal(out.kl, finite.kl))
    assert float(finite.clip_fraction) > 0 and (finite_grad != 0).any()


@pytest.mark.parametrize("aggregation, entropy_aggregation", [
    ("token-mean", None), ("seq-mean-token-sum", None), ("seq-mean-token-mean", "token-mean"),
    ("token-sum", "seq-mean-token-sum-norm"),
], ids=["token-mean", "seq-sum", "seq-mean-entropy-token-mean", "token-sum-entropy-norm"])
def test_entropy_bonus_microbatches_with_step_normalizers_add_up(aggregation, entropy_aggregation):
    """With the step's N of the loss (and of the entropy's aggregation when it differs), the bonus of two halves
    adds up to the whole's, loss and gradients w.r.t. log-probs and entropies."""
    generator = torch.Generator().manual_seed(42)
    size = 60
    trajectory = torch.sort(torch.randint(0, 8, (size,), generator=generator)).values
    mask = torch.rand(size, generator=generator) < 0.6
    logprobs = -torch.rand(size, generator=generator, dtype=torch.float64) * 3
    old = logprobs + 0.3 * torch.randn(size, generator=generator, dtype=torch.float64)
    entropy = torch.rand(size, generator=generator, dtype=torch.float64) * 2
    advantages = torch.randn(size, generator=generator, dtype=torch.float64)
    uses_norm = "seq-mean-token-sum-norm" in (aggregation, entropy_aggregation)
    config = GRPOConfig(aggregation=aggregation, entropy_coef=0.3, entropy_aggregation=entropy_aggregation,
                        loss_scale_factor=7.0 if uses_norm else None)

    def count(kind):
        sequences = float(torch.unique(trajectory[mask]).numel())
        return {"token-mean": float(mask.sum()), "token-sum": 1.0}.get(kind, sequences)

    def loss(select, normalizer=None, entropy_normalizer=None):
        lp, ent = logprobs.clone().requires_grad_(), entropy.clone().requires_grad_()
        out = grpo_loss(lp[select], advantages_S=advantages[select], loss_mask_S=mask[select],
                        old_logprobs_S=old[select], trajectory_index_S=trajectory[select], config=config,
                        normalizer=normalizer, entropy_S=ent[select], entropy_normalizer=entropy_normalizer)
        out.loss.backward()
        return out.loss.detach(), lp.grad, ent.grad

    whole = loss(torch.ones(size, dtype=torch.bool))
    first = trajectory < 4
    entropy_normalizer = None if entropy_aggregation is None else count(entropy_aggregation)
    halves = [loss(part, count(aggregation), entropy_normalizer) for part in (first, ~first)]
    for got, expected in zip(map(sum, zip(*halves)), whole):
        assert torch.allclose(got, expected, rtol=1e-12, atol=1e-15)
    assert float(whole[2].abs().max()) > 0


def test_new_options_are_validated_in_one_line():
    cases = {
        "aggregation": dict(aggregation="seq-mean"), "entropy_aggregation": dict(entropy_aggregation="mean"),
        "surrogate": dict(surrogate="gspo"), "importance_sampling_level": dict(importance_sampling_level="batch"),
        "kl_estimator": dict(kl_estimator="full"), "kl_importance_weighted": dict(kl_importance_weighted=1),
        "ratio_cap": dict(ratio_cap=0.0), "log_ratio_clamp": dict(log_ratio_clamp=math.nan),
        "entropy_coef": dict(entropy_coef=-1.0), "sapo_tau": dict(sapo_tau_neg=0.0),
        "vespo_lambda": dict(vespo_lambda_pos=0.0), "dual_clip_ratio": dict(dual_clip_ratio=1.0),
        "needs loss_scale_factor": dict(aggregation="seq-mean-token-sum-norm"),
        "loss_scale_factor applies": dict(loss_scale_factor=3.0),
        "applies to surrogate": dict(surrogate="cispo", ratio_cap=2.0),
        "clip_ratio_low": dict(clip_ratio_low=1.0),
    }
    for needle, kwargs in cases.items():
        with pytest.raises(ValueError, match=needle) as error:
            GRPOConfig(**kwargs)
        assert "\n" not in str(error.value)
    assert GRPOConfig(surrogate="cispo", clip_ratio_low=1.0).clip_ratio_low == 1.0
    with pytest.raises(ValueError, match="PPOConfig: loss_scale_factor applies"):
        PPOConfig(loss_scale_factor=2.0)


def test_sequence_options_need_trajectory_ids():
    logprobs = torch.tensor([-1.0, -2.0], requires_grad=True)
    args = dict(advantages_S=torch.ones(2), loss_mask_S=torch.ones(2, dtype=torch.bool))
    for config in (GRPOConfig(importance_sampling_level="sequence"), GRPOConfig(surrogate="vespo"),
                   GRPOConfig(entropy_coef=0.1, entropy_aggregation="seq-mean-token-sum")):
        with pytest.raises(ValueError, match="needs trajectory_index_S"):
            grpo_loss(logprobs, config=config, entropy_S=torch.ones(2), **args)
    with pytest.raises(ValueError, match="entropy_coef > 0 needs entropy_S"):
        ppo_loss(logprobs, config=PPOConfig(entropy_coef=0.1), **args)


def test_step_kl_is_the_mean_k3_over_the_positions_that_predict_a_masked_in_token():
    """step_kl against a loop over the step's own (unshifted) arrays: position i - 1 of a trajectory predicts token
    i, which carries the loss mask and the reference log-prob."""
    from dataclasses import replace

    step = random_tree_step(np.random.default_rng(42), num=6, max_len=20, vocab=5).step
    logprobs = torch.from_numpy(-np.random.default_rng(7).random(step.num_semantic_tokens).astype(np.float32) * 3)
    terms = []
    for x in range(step.num_trajectories):
        start, end = int(step.offsets[x]), int(step.offsets[x + 1])
        for i in range(start + 1, end):
            if step.loss_mask[i]:
                delta = float(step.ref_logprobs[i]) - float(logprobs[i - 1])
                terms.append(math.exp(delta) - delta - 1)
    assert terms
    assert step_kl(step, logprobs) == pytest.approx(sum(terms) / len(terms), rel=1e-5)
    assert step_kl(replace(step, ref_logprobs=None), logprobs) is None
    assert step_kl(replace(step, loss_mask=np.zeros_like(step.loss_mask)), logprobs) == 0.0
