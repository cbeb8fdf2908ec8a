"""The MTP loss (harts.objective.mtp) in both executions, against each other, a dense reference and megatron-core.

On CPU in fp32, for the tiny model with 1 to 3 MTP depths whose block is MLA (Ling-3.0's) or KDA:
- compact = per trajectory: the MTP loss, each depth's term and every parameter gradient of the MTP loss alone
  (advantages 0 and the MoE losses off, so nothing else has a gradient) on trees with forks at every depth, a fork
  right before the last token, trajectories that differ only in their first token, copies and short trajectories,
  and random trees split into two microbatches; then the whole step (policy, MoE and MTP losses, recomputation on
  and off) and the expert-bias counts of the MTP blocks;
- per trajectory = `reference_mtp_loss` (megatron-core's rolls and dense cross entropy, written plainly) on single
  sequences, value and every gradient;
- the loss's gradient = megatron-core's own `GPTModel._postprocess` (its label and loss-mask rolls, per-depth
  normalisation and scaling, driven on CPU with a plain LM head), and each layer's input = megatron-core's
  `MultiTokenPredictionLayer._concat_embeddings`;
- MTP off: a model whose MTP loss is off (factor 0) runs the step of the model without MTP layers bit for bit;
  run_step runs the MTP layers exactly when `runs_mtp` says (the model's factor, the step's, no MTP layers).
"""

import types
import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch

from harts.model.config import MTPConfig, load_model_config
from harts.model.model import HybridModel
from harts.model.moe import updated_expert_bias
from harts.objective.mtp import microbatch_mtp_loss, mtp_normalizers, reference_mtp_loss
from harts.objective.step import StepConfig, run_step, runs_mtp
from harts.objective.targets import semantic_targets_from_step
from harts.optim.update import update_expert_biases
from harts.runtime.mtp import mtp_layouts
from harts.trees.step import TOKEN_DTYPE, Step
from tests.objective.helpers import random_tree_step
from tests.runtime.test_mtp import HAND_MADE

FACTOR = 0.3


def _config(kind: str = "mla", depths: int = 2, *, moe_losses: bool = False):
    config = load_model_config("tiny")
    if not moe_losses:
        config = replace(config, moe=replace(config.moe, aux_loss_coeff=0.0, z_loss_coeff=0.0))
    return replace(config, mtp=MTPConfig(num_layers=depths, loss_scaling_factor=FACTOR, layer_kind=kind))


def _model(config, seed: int = 42) -> HybridModel:
    torch.manual_seed(seed)
    model = HybridModel(config)
    model.init_weights(seed=seed)
    return model


def _step(sequences, rng, *, advantages: bool = False) -> Step:
    lengths = np.array([len(s) for s in sequences])
    offsets = np.zeros(len(sequences) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    size = int(offsets[-1])
    loss_mask = (rng.random(size) < 0.7).astype(np.uint8)
    loss_mask[offsets[:-1]] = 0
    return Step(
        ids=tuple(f"t{k}" for k in range(len(sequences))), trees=tuple("task" for _ in sequences), offsets=offsets,
        tokens=np.concatenate([np.asarray(s, dtype=TOKEN_DTYPE) for s in sequences]), loss_mask=loss_mask,
        rewards=np.zeros(len(sequences), dtype=np.float32),
        advantage_per_token=(rng.standard_normal(size) if advantages else np.zeros(size)).astype(np.float32),
    )


def _trees():
    """(step, microbatches) by name: the hand-made trees in one microbatch, random ones in two."""
    trees = {}
    for name, sequences in HAND_MADE.items():
        step = _step(sequences, np.random.default_rng(len(trees)))
        trees[name] = (step, [np.arange(step.num_trajectories)])
    for seed in range(2):
        rng = np.random.default_rng(10 + seed)
        step = random_tree_step(rng, num=8, max_len=40, vocab=3).step
        step = replace(step, old_logprobs=None, ref_logprobs=None,
                       advantage_per_token=np.zeros_like(step.advantage_per_token))
        order = rng.permutation(step.num_trajectories)
        trees[f"random-{seed}"] = (step, [order[:4], order[4:]])
    return trees


TREES = _trees()


def _run(model, step, microbatches, execution, **fields):
    model.zero_grad(set_to_none=True)
    result = run_step(model, step, microbatches, StepConfig(execution=execution, **fields))
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return result, grads


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _assert_same_gradients(grads, expected, tolerance):
    assert grads.keys() == expected.keys()
    worst = max(((_relative(grads[n], expected[n]), n) for n in expected), default=(0.0, None))
    assert worst[0] <= tolerance, worst


@pytest.mark.parametrize("depths", [1, 3], ids=["D1", "D3"])
@pytest.mark.parametrize("kind", ["mla", "kda"])
@pytest.mark.parametrize("name", TREES)
def test_compact_equals_per_trajectory(name, kind, depths):
    model = _model(_config(kind, depths))
    step, microbatches = TREES[name]
    baseline, baseline_grads = _run(model, step, microbatches, "baseline")
    compact, compact_grads = _run(model, step, microbatches, "compact")
    # The policy term is 0 (advantages 0) and the MoE losses are off: every gradient is the MTP loss's.
    assert baseline.policy_loss == 0 and baseline.moe_loss == 0
    assert baseline.mtp_loss > 0
    assert compact.mtp_loss == pytest.approx(baseline.mtp_loss, rel=1e-6, abs=0)
    assert compact.mtp_depth_losses == pytest.approx(baseline.mtp_depth_losses, rel=1e-6, abs=1e-12)
    _assert_same_gradients(compact_grads, baseline_grads, 2e-5)  # fp32; worst seen 3.9e-6 (a KDA gate: other chunkings)
    trained = [f"mtp.layers.{k}.block." for k, term in enumerate(baseline.mtp_depth_losses) if term > 0]
    for prefix in ("embed.", "blocks.0.", "lm_head.", "mtp.layers.0.eh_proj", *trained):
        assert any(n.startswith(prefix) and float(g.norm()) > 0 for n, g in baseline_grads.items()), prefix
    lengths = step.lengths
    assert baseline.num_mtp_semantic_tokens == compact.num_mtp_semantic_tokens == [
        int(np.maximum(lengths - k, 0).sum()) for k in range(1, depths + 1)]
    assert baseline.num_mtp_rows == baseline.num_mtp_semantic_tokens
    if name == "first-token-differs":
        assert compact.num_mtp_rows == baseline.num_mtp_rows, "nothing shared below the first token"
    elif name != "short":
        assert compact.num_mtp_rows[0] < baseline.num_mtp_rows[0]


@pytest.mark.parametrize("execution", ["baseline", "compact"])
def test_microbatching_does_not_change_the_mtp_loss(execution):
    """The step-level N_k: two microbatches add up to the one-microbatch loss and gradients."""
    model = _model(_config("mla", 2))
    step, microbatches = TREES["random-0"]
    whole, whole_grads = _run(model, step, [np.arange(step.num_trajectories)], execution)
    split, split_grads = _run(model, step, microbatches, execution)
    assert split.mtp_loss == pytest.approx(whole.mtp_loss, rel=1e-6)
    assert split.mtp_depth_losses == pytest.approx(whole.mtp_depth_losses, rel=1e-6)
    _assert_same_gradients(split_grads, whole_grads, 1e-5)


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
def test_whole_step_with_mtp(recompute):
    """Policy (GRPO with KL), MoE and MTP losses together; the MTP blocks' expert-bias counts and update."""
    model = _model(_config("mla", 2, moe_losses=True))
    rng = np.random.default_rng(7)
    step = random_tree_step(rng, num=8, max_len=60, vocab=3).step
    step = replace(step, old_logprobs=None)
    order = rng.permutation(step.num_trajectories)
    microbatches = [order[:5], order[5:]]
    fields = dict(recompute=recompute, loss="grpo")
    baseline, baseline_grads = _run(model, step, microbatches, "baseline", **fields)
    compact, compact_grads = _run(model, step, microbatches, "compact", **fields)
    assert baseline.mtp_loss > 0 and baseline.moe_loss > 0 and baseline.policy_loss != 0
    assert baseline.loss == pytest.approx(baseline.policy_loss + baseline.moe_loss + baseline.mtp_loss, rel=1e-12)
    assert compact.loss == pytest.approx(baseline.loss, rel=1e-6)
    assert compact.moe_loss == pytest.approx(baseline.moe_loss, rel=1e-5)
    _assert_same_gradients(compact_grads, baseline_grads, 1e-4)
    num_main = model.config.num_layers - model.config.num_dense_layers
    assert len(baseline.tokens_per_expert) == len(compact.tokens_per_expert) == num_main + 2
    top_k = model.config.moe.top_k
    for depth, counts in enumerate(baseline.tokens_per_expert[num_main:], start=1):
        assert float(counts.sum()) == baseline.num_mtp_semantic_tokens[depth - 1] * top_k
    for a, b in zip(baseline.tokens_per_expert, compact.tokens_per_expert):
        assert torch.equal(a, b)
    before = model.mtp.layers[1].block.mlp.expert_bias.clone()
    update_expert_biases(model, compact.tokens_per_expert)
    rate = model.config.moe.bias_update_rate
    assert torch.equal(model.mtp.layers[1].block.mlp.expert_bias,
                       updated_expert_bias(compact.tokens_per_expert[-1], before, rate))
    info = compact.layout_info[0]
    assert info["mtp_rows"][0] < info["mtp_semantic_tokens"][0]
    record = compact.mtp_record()
    assert record["mtp_rows"] == compact.num_mtp_rows and record["mtp_loss"] == compact.mtp_loss


@pytest.mark.parametrize("length", [2, 5, 17, 40])
@pytest.mark.parametrize("kind", ["mla", "kda"])
def test_per_trajectory_equals_dense_reference(kind, length):
    model = _model(_config(kind, 2))
    rng = np.random.default_rng(length)
    step = _step([rng.integers(0, model.config.vocab_size, length).tolist()], rng)
    result, grads = _run(model, step, [np.arange(1)], "baseline")
    loss = reference_mtp_loss(model, step.tokens, step.loss_mask)
    loss.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    assert result.mtp_loss == pytest.approx(float(loss.detach()), rel=1e-6, abs=1e-12)
    if float(loss.detach()) == 0:
        return  # length 2, mask on the second token off: no MTP label
    # The baseline's zero-advantage policy term and the MoE blocks' (coefficient 0) losses add exact zeros.
    grads = {n: g for n, g in grads.items() if n in expected}
    _assert_same_gradients(grads, expected, 1e-5)


def _megatron():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron warns at import that TE and Apex are missing
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.transformer import multi_token_prediction
    return GPTModel, multi_token_prediction


@pytest.mark.parametrize("depths", [1, 2, 3])
def test_loss_gradient_equals_megatron(depths):
    """megatron-core's loss on equal-length sequences ([s, b] layout), with given hidden states per depth."""
    gpt_model, _ = _megatron()
    rng = np.random.default_rng(depths)
    length, batch, hidden_size, vocab = 9, 3, 6, 13
    step = _step([rng.integers(0, vocab, length).tolist() for _ in range(batch)], rng)
    generator = torch.Generator().manual_seed(depths)
    hidden = torch.randn((1 + depths) * length, batch, hidden_size, generator=generator, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, generator=generator, requires_grad=True)
    tokens = torch.from_numpy(step.tokens.astype(np.int64)).view(batch, length)
    mask = torch.from_numpy(step.loss_mask.astype(np.float32)).view(batch, length)
    # megatron's labels and loss mask are indexed by the predicting position: token t + 1 and its mask.
    labels = torch.cat([tokens[:, 1:], tokens.new_zeros(batch, 1)], dim=1)
    label_mask = torch.cat([mask[:, 1:], mask.new_zeros(batch, 1)], dim=1)
    config = types.SimpleNamespace(mtp_num_layers=depths, mtp_loss_scaling_factor=FACTOR,
                                   calculate_per_token_loss=False)
    fake = types.SimpleNamespace(
        config=config, share_embeddings_and_output_weights=False, cp_group=None, training=False, post_process=True,
        output_layer=lambda x, weight=None, runtime_gather_output=None: (x @ weight_for_megatron.T, None),
        compute_language_model_loss=lambda labels, logits: torch.nn.functional.cross_entropy(
            logits.permute(1, 2, 0), labels, reduction="none"),
    )
    weight_for_megatron = weight
    main_loss = gpt_model._postprocess(fake, hidden, None, None, labels, None, None, None, mtp_in_postprocess=False,
                                       loss_mask=label_mask)
    (0 * main_loss.sum()).backward()  # megatron's MTP loss enters through its auto-scaler's backward
    expected_hidden, expected_weight = hidden.grad.clone(), weight.grad.clone()
    hidden.grad, weight.grad = None, None

    targets = semantic_targets_from_step(step)
    layouts = mtp_layouts(step, np.arange(batch), depths, execution="baseline", conv_size=4, chunk_size=4)
    chunks = hidden.detach().view(1 + depths, length, batch, hidden_size)
    ours = [chunks[k].transpose(0, 1)[:, : length - k].reshape(-1, hidden_size).clone().requires_grad_()
            for k in range(1, depths + 1)]
    loss = microbatch_mtp_loss(ours, layouts, weight, targets, np.arange(step.num_semantic_tokens),
                               mtp_normalizers(step, targets, depths), FACTOR, chunk_rows=5).loss
    loss.backward()
    expected_chunks = expected_hidden.view(1 + depths, length, batch, hidden_size)
    assert float(expected_chunks[0].abs().max()) == 0, "the main rows carry no MTP gradient"
    for k in range(1, depths + 1):
        per_trajectory = expected_chunks[k].transpose(0, 1)
        assert float(per_trajectory[:, length - k:].abs().max()) == 0, "megatron's rolled-in rows carry none"
        torch.testing.assert_close(ours[k - 1].grad, per_trajectory[:, : length - k].reshape(-1, hidden_size),
                                   rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(weight.grad, expected_weight, rtol=1e-5, atol=1e-7)


def test_layer_input_equals_megatron(monkeypatch):
    """[enorm(embedding); hnorm(hidden)] through eh_proj, embedding first, as megatron-core's MTP layer."""
    _, multi_token_prediction = _megatron()
    monkeypatch.setattr(multi_token_prediction, "gather_from_tensor_model_parallel_region", lambda x: x)
    layer = _model(_config()).mtp.layers[0]
    with torch.no_grad():
        for norm in (layer.enorm, layer.hnorm):
            norm.weight.uniform_(0.5, 1.5)
    generator = torch.Generator().manual_seed(0)
    embedded, hidden = (torch.randn(7, 1, 64, generator=generator) for _ in range(2))
    fake = types.SimpleNamespace(enorm=layer.enorm, hnorm=layer.hnorm, sequence_parallel=False,
                                 eh_proj=lambda x: (layer.eh_proj(x), None))
    expected = multi_token_prediction.MultiTokenPredictionLayer._concat_embeddings(fake, hidden, embedded)
    torch.testing.assert_close(layer.combine(embedded, hidden), expected, rtol=0, atol=0)


def test_mtp_off_is_the_model_without_mtp():
    """The MTP layers' parameters come after the decoder's (the same initial weights), and with the MTP loss off
    the step is the plain model's bit for bit (loss, log-probs, gradients, records); the MTP layers' expert counts
    are zeros."""
    config = _config("mla", 2, moe_losses=True)
    plain, with_mtp = _model(replace(config, mtp=None)), _model(config)
    plain_state = plain.state_dict()
    mtp_state = with_mtp.state_dict()
    assert all(torch.equal(value, mtp_state[name]) for name, value in plain_state.items())
    assert set(mtp_state) - set(plain_state) == {n for n in mtp_state if n.startswith("mtp.")}
    rng = np.random.default_rng(3)
    step = random_tree_step(rng, num=8, max_len=50, vocab=3).step
    microbatches = [np.arange(3), np.arange(3, 8)]
    for execution in ("baseline", "compact"):
        reference, reference_grads = _run(plain, step, microbatches, execution)
        result, grads = _run(with_mtp, step, microbatches, execution, mtp_loss_scaling_factor=0.0)
        for key in ("loss", "policy_loss", "moe_loss", "clip_fraction", "num_rows", "layout_info"):
            assert getattr(result, key) == getattr(reference, key), key
        assert result.mtp_loss is None and result.mtp_record() == {} == reference.mtp_record()
        assert torch.equal(result.logprobs if result.logprobs is not None else torch.zeros(0),
                           reference.logprobs if reference.logprobs is not None else torch.zeros(0))
        assert grads.keys() == reference_grads.keys()
        assert all(torch.equal(grads[n], reference_grads[n]) for n in grads)
        num_main = len(reference.tokens_per_expert)
        assert all(torch.equal(a, b) for a, b in zip(result.tokens_per_expert, reference.tokens_per_expert))
        assert [float(c.abs().sum()) for c in result.tokens_per_expert[num_main:]] == [0.0, 0.0]


@pytest.mark.parametrize(("model_factor", "override", "runs"), [
    (FACTOR, None, True), (FACTOR, 0.0, False), (0.0, None, False), (0.0, 0.5, True), (None, None, False),
    (None, 0.0, False),
], ids=["model-factor", "override-0", "model-factor-0", "override-on-model-factor-0", "no-mtp-layers",
        "no-mtp-layers-override-0"])
def test_run_step_runs_the_mtp_layers_when_runs_mtp_says(model_factor, override, runs):
    """One rule for whether a step runs the MTP layers (`runs_mtp`, which the commands ask before building the model):
    the StepConfig's factor when given, else the model config's (0 in a Hugging Face checkpoint without one), and
    never for a model without MTP layers. run_step follows it, in both executions."""
    config = _config()
    mtp = None if model_factor is None else replace(config.mtp, loss_scaling_factor=model_factor)
    config = replace(config, mtp=mtp)
    model = _model(config)
    step, microbatches = TREES["random-0"]
    for execution in ("baseline", "compact"):
        step_config = StepConfig(execution=execution, mtp_loss_scaling_factor=override)
        assert runs_mtp(config, step_config) is runs
        result = run_step(model, step, microbatches, step_config, backward=False)
        assert (result.mtp_loss is not None) is runs and len(result.mtp_record()) == 4 * runs
        if runs:
            assert result.mtp_loss > 0 and len(result.num_mtp_rows) == config.mtp.num_layers


def test_mtp_loss_needs_mtp_layers():
    model = _model(replace(_config(), mtp=None))
    step = TREES["short"][0]
    with pytest.raises(ValueError, match="mtp_loss_scaling_factor is 0.5, but model 'tiny' has no MTP layers"):
        run_step(model, step, [np.arange(step.num_trajectories)], StepConfig(mtp_loss_scaling_factor=0.5))
    with pytest.raises(ValueError, match=r"mtp_loss_scaling_factor must be a finite number >= 0 .*, got -1$"):
        StepConfig(mtp_loss_scaling_factor=-1)
