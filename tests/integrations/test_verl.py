"""harts/integrations/verl.py: verl's own workers drive the HARTS engine, and its outputs equal verl's computation.

Runs in the verl environment (`bash .ci/setup verl`: verl 0.9.1 within its pins, transformers < 5.11); elsewhere the
module is skipped. Everything verl does, verl's code does: the batch is a DataProto as its trainer holds it after a
rollout (left-padded prompts, right-padded responses, `compute_position_id_with_mask`, `compute_response_mask`, GRPO
advantages from `core_algos.compute_grpo_outcome_advantage`), turned into the engine's TensorDict by
`to_tensordict` + `left_right_2_no_padding` with the trainer's settings (`_compute_old_log_prob`, `_update_actor`), and
fed to verl's `TrainingWorker` (infer_batch, train_mini_batch), which builds the engine through `EngineRegistry`.

The reference is verl's `FSDPEngineWithLMHead` itself (its forward_backward_batch: packing, micro-batches, rolled
labels, temperature, `logprobs_from_logits`, `entropy_from_logits`, the loss call, the backward) over a module that
runs each packed sequence alone through the same weights (its own one-trajectory layout), with verl's `ppo_loss`
(core_algos) as the loss. GRPO groups of 4 samples share each prompt (one sample repeats another, one shares a
response prefix), so HARTS computes fewer rows than tokens. fp32 on the CPU: log-probs and entropy within 1e-5,
the loss within 1e-6 relative and every parameter gradient within 1e-4 relative (‖Δg‖ / ‖g‖, tests/test_api.py's
bounds).
"""

import os
import re
import shlex
import string
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed: these tests run in the verl environment "
                                    "(bash .ci/setup verl; .ci/run runs them there)")

from tests.integrations.verl_cpu import use_cpu_platform  # noqa: E402

use_cpu_platform()

import verl.utils.torch_functional as verl_F  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.trainer.ppo.ray_trainer import compute_response_mask  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.model import compute_position_id_with_mask  # noqa: E402
from verl.workers.config import (  # noqa: E402
    FSDPActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig, PolicyLossConfig, TrainingWorkerConfig,
)
from verl.workers.engine import EngineRegistry  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead  # noqa: E402
from verl.workers.engine_workers import TrainingWorker  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402

from harts.integrations import verl as harts_verl  # noqa: E402
from harts.model.config import load_model_config  # noqa: E402
from harts.model.hf import hf_state_dict, load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from harts.model.model import HybridModel  # noqa: E402
from harts.objective.step import StepConfig, build_layout, microbatch_logprobs  # noqa: E402
from harts.runtime.layout import baseline_layout  # noqa: E402
from harts.trees.step import TOKEN_DTYPE, Step  # noqa: E402
from tests.fixtures import one_thread  # noqa: E402,F401  (autouse: one intra-op thread)

VOCAB = 256
PAD = 0
NUM_PROMPTS, SAMPLES = 3, 4
TEMPERATURE = 0.7
WORKER_ENVIRONMENT = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                      "MASTER_PORT": "29500"}


# ---------------------------------------------------------------------------------------------
# The model, verl's process group and worker


@pytest.fixture(scope="module", autouse=True)
def process_group(tmp_path_factory):
    """verl's workers run inside torch.distributed (gloo here, world size 1) and read their rank from Ray's
    environment variables."""
    saved = {name: os.environ.get(name) for name in WORKER_ENVIRONMENT}
    os.environ.update(WORKER_ENVIRONMENT)
    if not torch.distributed.is_initialized():
        store = tmp_path_factory.mktemp("dist") / "store"
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name)
        else:
            os.environ[name] = value


def save_model(path, moe_losses: bool):
    """kimi-tiny (exportable to Kimi-Linear's layout); without MoE losses unless asked (verl's reference has none)."""
    config = load_model_config("kimi-tiny")
    if not moe_losses:
        config = replace(config, moe=replace(config.moe, aux_loss_coeff=0.0, z_loss_coeff=0.0))
    model = HybridModel(config)
    model.init_weights(seed=42)
    save_hf_checkpoint(model, path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("ckpt") / "model", moe_losses=False)


def actor_config(**overrides) -> FSDPActorConfig:
    """The actor section as verl's trainer builds it, with strategy "harts" (fp32 on the CPU)."""
    settings = dict(strategy="harts", rollout_n=SAMPLES, ppo_mini_batch_size=NUM_PROMPTS,
                    ppo_micro_batch_size_per_gpu=SAMPLES, fsdp_config=FSDPEngineConfig(dtype="float32"),
                    optim=FSDPOptimizerConfig(lr=1e-3, total_training_steps=4, weight_decay=0.01, clip_grad=1.0),
                    clip_ratio=0.2, entropy_coeff=0.0)
    settings.update(overrides)
    return FSDPActorConfig(**settings)


def make_worker(path, actor: FSDPActorConfig, *, use_dynamic_bsz=False, max_token_len=None) -> TrainingWorker:
    """verl's TrainingWorker (EngineRegistry picks the engine from the strategy) with its loss set as the
    ActorRolloutRefWorker sets it."""
    model_config = HFModelConfig(path=str(path), load_tokenizer=False, enable_gradient_checkpointing=False)
    engine = actor.engine
    engine.use_dynamic_bsz = use_dynamic_bsz
    engine.micro_batch_size_per_gpu = engine.infer_micro_batch_size_per_gpu = actor.ppo_micro_batch_size_per_gpu
    engine.max_token_len_per_gpu = engine.infer_max_token_len_per_gpu = max_token_len
    worker = TrainingWorker(TrainingWorkerConfig(
        model_type="language_model", model_config=model_config, engine_config=engine,
        optimizer_config=actor.optim, checkpoint_config=actor.checkpoint,
    ))
    worker.reset()
    worker.set_loss_fn(partial(ppo_loss, config=actor))
    return worker


# ---------------------------------------------------------------------------------------------
# verl's reference: its FSDP engine's forward over each sequence alone


def alone_logits(model: HybridModel, tokens: torch.Tensor) -> torch.Tensor:
    """[n, V] logits of one sequence run alone through the model (its own one-trajectory layout)."""
    n = len(tokens)
    step = Step(ids=("x",), trees=("x",), offsets=np.array([0, n]), tokens=tokens.numpy().astype(TOKEN_DTYPE),
                loss_mask=np.zeros(n, dtype=np.uint8), rewards=np.zeros(1, dtype=np.float32),
                advantage_per_trajectory=np.zeros(1, dtype=np.float32))
    kda = model.config.kda
    layout = baseline_layout(step, np.array([0]), conv_size=kda.conv_size, chunk_size=kda.chunk_size)
    hidden, _ = model(layout.input_ids, layout)
    return hidden @ model.lm_head.weight.T


class EachSequenceAlone(torch.nn.Module):
    """A causal LM as verl's FSDP engine calls one with remove-padding: input_ids and position_ids [1, total] of
    packed sequences (each starts at position 0), logits [1, total, V]."""

    def __init__(self, model: HybridModel):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        ids, positions = input_ids[0].cpu(), position_ids[0].cpu()
        starts = torch.nonzero(positions == 0)[:, 0].tolist() + [len(ids)]
        logits = [alone_logits(self.model, ids[a:b]) for a, b in zip(starts, starts[1:])]
        return SimpleNamespace(logits=torch.cat(logits)[None])


def reference_engine(path) -> FSDPEngineWithLMHead:
    """verl's FSDPEngineWithLMHead, its methods unchanged, holding the checkpoint's model (loaded again: the
    same weights as the HARTS engine's) behind `EachSequenceAlone` instead of an FSDP-wrapped HF model."""
    model, _ = load_hf_checkpoint(path)
    engine = object.__new__(FSDPEngineWithLMHead)
    engine.module = EachSequenceAlone(model)
    engine.engine_config = FSDPEngineConfig(dtype="float32", use_torch_compile=False)
    engine.ulysses_device_mesh, engine.ulysses_sequence_parallel_size, engine.use_ulysses_sp = None, 1, False
    engine.pad_to_length, engine.pad_to_length_bucket = False, 1024
    engine._autocast_dtype, engine.scaler = torch.float32, None
    engine.compute_entropy_from_logits = verl_F.entropy_from_logits
    return engine


# ---------------------------------------------------------------------------------------------
# Batches as verl's trainer makes them


def rollout_batch(seed: int, temperature: float = TEMPERATURE) -> DataProto:
    """A rolled-out GRPO batch: NUM_PROMPTS prompts × SAMPLES samples (verl repeats each prompt SAMPLES times in a
    row, one uid per group), left-padded prompts, right-padded responses; in each group sample 1 starts with sample
    0's first 3 response tokens and sample 2 repeats sample 0. Rewards on the last response token, GRPO advantages,
    old and reference log-probs near the model's (set by the caller)."""
    rng = np.random.default_rng(seed)
    width_p, width_r = 14, 12
    num = NUM_PROMPTS * SAMPLES
    prompts = torch.full((num, width_p), PAD)
    responses = torch.full((num, width_r), PAD)
    prompt_mask = torch.zeros(num, width_p, dtype=torch.long)
    response_mask = torch.zeros(num, width_r, dtype=torch.long)
    uids = []
    for g in range(NUM_PROMPTS):
        prompt = torch.from_numpy(rng.integers(1, VOCAB, int(rng.integers(4, width_p + 1))))
        samples = [rng.integers(1, VOCAB, int(rng.integers(2, width_r + 1))).tolist() for _ in range(SAMPLES)]
        samples[1] = (samples[0][:3] + samples[1])[:width_r]
        samples[2] = list(samples[0])
        for i, response in enumerate(samples):
            b = g * SAMPLES + i
            prompts[b, width_p - len(prompt):] = prompt
            prompt_mask[b, width_p - len(prompt):] = 1
            responses[b, :len(response)] = torch.tensor(response)
            response_mask[b, :len(response)] = 1
            uids.append(f"prompt-{g}")
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    batch = DataProto.from_dict(
        tensors=dict(prompts=prompts, responses=responses, input_ids=torch.cat([prompts, responses], dim=1),
                     attention_mask=attention_mask, position_ids=compute_position_id_with_mask(attention_mask)),
        non_tensors={"uid": np.array(uids, dtype=object)}, meta_info={"temperature": temperature},
    )
    batch.batch["response_mask"] = compute_response_mask(batch)
    rewards = torch.zeros(num, width_r)
    last = batch.batch["response_mask"].sum(-1) - 1
    rewards[torch.arange(num), last] = torch.from_numpy(rng.standard_normal(num)).float()
    batch.batch["token_level_rewards"] = rewards
    advantages, returns = core_algos.compute_grpo_outcome_advantage(
        rewards, batch.batch["response_mask"], index=batch.non_tensor_batch["uid"])
    batch.batch["advantages"], batch.batch["returns"] = advantages, returns
    return batch


def old_log_prob_input(batch: DataProto):
    """The engine's input of `RayPPOTrainer._compute_old_log_prob` (its steps 1-3)."""
    batch_td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(batch_td, calculate_entropy=True, calculate_sum_pi_squared=False, compute_loss=False)
    return batch_td


def update_actor_input(batch: DataProto, actor: FSDPActorConfig):
    """The engine's input of `RayPPOTrainer._update_actor` (one mini-batch: the whole batch)."""
    batch_td = left_right_2_no_padding(batch.to_tensordict())
    size = actor.ppo_mini_batch_size * SAMPLES
    tu.assign_non_tensor(
        batch_td, calculate_entropy=actor.calculate_entropy or actor.entropy_coeff != 0.0, distillation_use_topk=False,
        distillation_only=False, global_batch_size=size, mini_batch_size=size, epochs=1, seed=actor.data_loader_seed,
        dataloader_kwargs={"shuffle": False}, compute_loss=True,
    )
    return batch_td


def with_engine_settings(batch_td, actor: FSDPActorConfig, *, dynamic=False, max_token_len=None):
    """The settings `TrainingWorker.train_batch` adds before calling the engine."""
    tu.assign_non_tensor(batch_td, use_remove_padding=True, use_dynamic_bsz=dynamic,
                         max_token_len_per_gpu=max_token_len,
                         micro_batch_size_per_gpu=actor.ppo_micro_batch_size_per_gpu, use_fused_kernels=False,
                         global_token_num=batch_td["input_ids"].offsets().diff().tolist())
    return batch_td


def with_old_and_ref_log_probs(batch: DataProto, engine, seed: int) -> DataProto:
    """old_log_probs and ref_log_prob: the model's (verl's reference) plus noise, so ratios and KL are not trivial."""
    batch_td = old_log_prob_input(batch)
    with torch.no_grad():
        output = engine.infer_batch(with_engine_settings(batch_td, actor_config()))
    log_probs = no_padding_2_padding(output["model_output"]["log_probs"], batch_td).float()
    generator = torch.Generator().manual_seed(seed)
    noise = 0.3 * torch.randn(log_probs.shape, generator=generator)
    batch.batch["old_log_probs"] = (log_probs + noise).clamp(max=0)
    batch.batch["ref_log_prob"] = (log_probs - noise.flip(0)).clamp(max=0)
    return batch


def nested_values(tensor):
    return tensor.values() if tensor.is_nested else tensor


def not_last(offsets: torch.Tensor) -> torch.Tensor:
    """bool [total]: False at each sequence's last position (where verl's log-prob is of the next packed token)."""
    keep = torch.ones(int(offsets[-1]), dtype=torch.bool)
    keep[offsets[1:] - 1] = False
    return keep


# ---------------------------------------------------------------------------------------------
# Registration and the model config


def test_engine_is_registered_for_verl_strategy_harts(checkpoint):
    assert EngineRegistry.get_engine_cls("language_model", "harts") is harts_verl.HartsEngine
    config = HFModelConfig(path=str(checkpoint), load_tokenizer=False)
    assert config.hf_config.model_type == "kimi_linear" and config.architectures == ["KimiLinearForCausalLM"]
    worker = make_worker(checkpoint, actor_config())
    assert isinstance(worker.engine, harts_verl.HartsEngine)


# ---------------------------------------------------------------------------------------------
# Log-probs and entropy (verl's old-log-prob and reference-log-prob path)


@pytest.mark.parametrize("temperature", [1.0, TEMPERATURE], ids=["T1", "T0.7"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed-micro-batches", "harts-planned-micro-batches"])
def test_infer_batch_matches_verl_fsdp_engine(checkpoint, temperature, dynamic):
    batch = rollout_batch(seed=1, temperature=temperature)
    actor = actor_config()
    worker = make_worker(checkpoint, actor, use_dynamic_bsz=dynamic, max_token_len=64)
    output = worker.infer_batch(old_log_prob_input(batch))
    reference_td = with_engine_settings(old_log_prob_input(batch), actor)
    with torch.no_grad():
        expected = reference_engine(checkpoint).infer_batch(reference_td)["model_output"]
    log_probs, entropy = tu.get(output, "log_probs"), tu.get(output, "entropy")
    offsets = reference_td["input_ids"].offsets()
    assert torch.equal(log_probs.offsets(), offsets) and torch.equal(entropy.offsets(), offsets)
    keep = not_last(offsets)
    assert float((log_probs.values() - expected["log_probs"].values())[keep].abs().max()) <= 1e-5
    assert not log_probs.values()[~keep].any()
    assert float((entropy.values() - expected["entropy"].values()).abs().max()) <= 1e-5
    # What the trainer keeps (response-shaped, verl's no_padding_2_padding) is equal too.
    ours = no_padding_2_padding(log_probs, reference_td)
    theirs = no_padding_2_padding(expected["log_probs"], reference_td)
    assert float((ours - theirs).abs().max()) <= 1e-5
    metrics = tu.get(output, "metrics")
    rows, tokens = (np.sum(metrics[name]) for name in ("harts/compact_rows", "harts/tokens"))  # [dp][micro-batch]
    assert rows < tokens == int(offsets[-1])


# ---------------------------------------------------------------------------------------------
# The loss and its gradients (verl's update_actor path)

LOSSES = {
    # name: actor config overrides
    "token-mean": dict(),
    "token-mean-entropy-kl": dict(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.05, kl_loss_type="low_var_kl"),
    "seq-mean-token-mean-dual-clip": dict(loss_agg_mode="seq-mean-token-mean", clip_ratio_c=2.0),
    "seq-mean-token-sum-norm": dict(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=12),
    "gspo": dict(policy_loss=PolicyLossConfig(loss_mode="gspo"), loss_agg_mode="seq-mean-token-mean",
                 clip_ratio_low=3e-4, clip_ratio_high=4e-4),
}


def forward_backward(engine, batch_td, actor):
    for param in engine.module.parameters():
        param.grad = None
    output = engine.forward_backward_batch(batch_td, partial(ppo_loss, config=actor), forward_only=False)
    return sum(output["loss"]), {name: p.grad.clone() for name, p in engine.module.named_parameters()
                                 if p.grad is not None}


@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed-micro-batches", "harts-planned-micro-batches"])
@pytest.mark.parametrize("loss", LOSSES)
def test_loss_and_gradients_match_verl_fsdp_engine(checkpoint, loss, dynamic):
    actor = actor_config(**LOSSES[loss])
    worker = make_worker(checkpoint, actor, use_dynamic_bsz=dynamic, max_token_len=64)
    reference = reference_engine(checkpoint)
    batch = with_old_and_ref_log_probs(rollout_batch(seed=2), reference, seed=3)
    loss_value, grads = forward_backward(
        worker.engine, with_engine_settings(update_actor_input(batch, actor), actor, dynamic=dynamic,
                                            max_token_len=64), actor)
    # verl's engine, always in fixed micro-batches (its dynamic batching needs a GPU); the loss is normalised over
    # the mini-batch, so micro-batching changes neither the loss nor the gradients.
    expected_loss, expected_grads = forward_backward(
        reference, with_engine_settings(update_actor_input(batch, actor), actor), actor)
    assert abs(loss_value - expected_loss) <= 1e-6 * max(1.0, abs(expected_loss)), (loss_value, expected_loss)
    reference_names = {name.removeprefix("model."): g for name, g in expected_grads.items()}
    assert set(grads) == set(reference_names)
    for name, grad in grads.items():
        error = float((grad - reference_names[name]).norm() / reference_names[name].norm().clamp_min(1e-30))
        assert error <= 1e-4, (name, error)


# ---------------------------------------------------------------------------------------------
# One update through verl's TrainingWorker


def test_train_mini_batch_takes_verls_adamw_step(checkpoint):
    """verl's update_actor path (train_mini_batch → train_batch → forward_backward_batch, optimizer_step): the
    parameters after one step equal the reference's gradients clipped to clip_grad and stepped by torch's AdamW
    with verl's settings (weight decay on every parameter, constant schedule)."""
    actor = actor_config(entropy_coeff=0.01, optim=FSDPOptimizerConfig(lr=1e-3, total_training_steps=4,
                                                                        weight_decay=0.1, clip_grad=1.0))
    worker = make_worker(checkpoint, actor)
    reference = reference_engine(checkpoint)
    batch = with_old_and_ref_log_probs(rollout_batch(seed=4), reference, seed=5)
    reference_parameters = {name.removeprefix("model."): p.detach().clone()
                            for name, p in reference.module.named_parameters()}
    metrics = tu.get(worker.train_mini_batch(update_actor_input(batch, actor)), "metrics")

    _, grads = forward_backward(reference, with_engine_settings(update_actor_input(batch, actor), actor), actor)
    params = [p for p in reference.module.parameters() if p.grad is not None]
    norm = float(torch.nn.utils.clip_grad_norm_(params, actor.optim.clip_grad))
    optimizer = torch.optim.AdamW(params, lr=actor.optim.lr, betas=actor.optim.betas,
                                  weight_decay=actor.optim.weight_decay)
    optimizer.step()
    assert abs(metrics["grad_norm"][0] - norm) <= 1e-5 * norm, (metrics["grad_norm"], norm)
    # AdamW's first step moves an entry by about lr·g/(|g| + eps), ±lr whatever |g|: an entry whose gradient is
    # near 0 moves by a different amount (or sign) under the gradients' rounding, so the updates are compared
    # per tensor, ‖Δ − Δ_ref‖ / ‖Δ_ref‖ (measured: at most 1.2e-3, a KDA conv weight; most below 1e-5). Weight decay
    # 0.1 makes a decay left off the vectors (verl decays every parameter) a 10% error of their update.
    expected = {name.removeprefix("model."): p for name, p in reference.module.named_parameters()}
    errors = {}
    for name, param in worker.engine.module.named_parameters():
        update, expected_update = param - reference_parameters[name], expected[name] - reference_parameters[name]
        errors[name] = float((update - expected_update).norm() / expected_update.norm())
    assert max(errors.values()) <= 1e-2, max(errors.items(), key=lambda item: item[1])


# ---------------------------------------------------------------------------------------------
# MoE losses and the expert-bias update (HARTS's own, not verl's)


def test_moe_losses_and_expert_bias_update(tmp_path):
    """With the model's MoE losses on, the engine's loss is verl's plus each micro-batch's MoE losses over the
    micro-batch count, and the expert biases move by the step's routed counts: both as the baseline execution
    (each sequence its own packed sequence, no sharing) of the same micro-batches gives them."""
    path = save_model(tmp_path / "moe", moe_losses=True)
    actor = actor_config()
    worker = make_worker(path, actor)
    engine = worker.engine
    reference = reference_engine(path)
    batch = with_old_and_ref_log_probs(rollout_batch(seed=6), reference, seed=7)
    batch_td = with_engine_settings(update_actor_input(batch, actor), actor)
    engine.optimizer_zero_grad()
    output = engine.forward_backward_batch(batch_td, partial(ppo_loss, config=actor), forward_only=False)
    verl_loss, _ = forward_backward(reference, with_engine_settings(update_actor_input(batch, actor), actor), actor)

    model, _ = load_hf_checkpoint(path)
    offsets = batch_td["input_ids"].offsets().numpy()
    tokens = batch_td["input_ids"].values().numpy()
    num = len(offsets) - 1
    step = Step(ids=tuple(map(str, range(num))), trees=tuple(map(str, range(num))), offsets=offsets,
                tokens=tokens.astype(TOKEN_DTYPE), loss_mask=np.zeros(len(tokens), dtype=np.uint8),
                rewards=np.zeros(num, dtype=np.float32), advantage_per_trajectory=np.zeros(num, dtype=np.float32))
    baseline = StepConfig(execution="baseline")
    chunks = [np.arange(start, start + SAMPLES) for start in range(0, num, SAMPLES)]
    moe_losses, counts = [], None
    with torch.no_grad():
        for members in chunks:
            layout = build_layout(step, members, model, baseline, None)
            targets = torch.zeros(layout.semantic_rows.shape[0], dtype=torch.long)
            _, _, moe, auxes = microbatch_logprobs(model, layout, targets, baseline, torch.device("cpu"))
            moe_losses.append(float(moe))
            mb_counts = [aux.tokens_per_expert_E for aux in auxes]
            counts = mb_counts if counts is None else [a + b for a, b in zip(counts, mb_counts)]
    expected = verl_loss + sum(moe_losses) / len(chunks)
    assert abs(sum(output["loss"]) - expected) <= 1e-6 * abs(expected), (sum(output["loss"]), expected)
    assert sum(moe_losses) > 0

    biases = [block.mlp.expert_bias.clone() for block in model.blocks if block.is_moe]
    engine.optimizer_step()
    rate = model.config.moe.bias_update_rate
    for block, bias, count in zip([b for b in engine.module.blocks if b.is_moe], biases, counts):
        expected_bias = bias + torch.sign(count.float().mean() - count.float()) * rate
        assert torch.allclose(block.mlp.expert_bias, expected_bias), (block.mlp.expert_bias, expected_bias)


# ---------------------------------------------------------------------------------------------
# Weight sync and checkpoints


def test_weight_sync_streams_the_checkpoint_layout(checkpoint):
    from safetensors.torch import load_file

    worker = make_worker(checkpoint, actor_config())
    tensors, peft_config = worker.engine.get_per_tensor_param()
    sent = dict(tensors)
    stored = load_file(str(checkpoint / "model.safetensors"))
    assert peft_config is None and set(sent) == set(stored)
    for name, tensor in sent.items():
        expected = stored[name] if stored[name].dtype != torch.bfloat16 else stored[name]
        assert torch.equal(tensor, hf_state_dict(worker.engine.module, dtype=torch.bfloat16)[name]), name
        assert torch.equal(tensor.float(), expected.to(tensor.dtype).float()), name


def test_checkpoint_round_trip(checkpoint, tmp_path):
    """save_checkpoint then load_checkpoint into a fresh worker: the same parameters, optimizer and schedule, so
    the next step is the same step; max_ckpt_to_keep removes the older checkpoints."""
    actor = actor_config()
    reference = reference_engine(checkpoint)
    batches = [with_old_and_ref_log_probs(rollout_batch(seed=s), reference, seed=s + 1) for s in (8, 10)]
    worker = make_worker(checkpoint, actor)
    worker.train_mini_batch(update_actor_input(batches[0], actor))
    worker.engine.save_checkpoint(str(tmp_path / "global_step_1" / "actor"), global_step=1, max_ckpt_to_keep=1)
    resumed = make_worker(checkpoint, actor)
    resumed.engine.load_checkpoint(str(tmp_path / "global_step_1" / "actor"))
    for worker_ in (worker, resumed):
        worker_.train_mini_batch(update_actor_input(batches[1], actor))
    for (name, param), resumed_param in zip(worker.engine.module.named_parameters(),
                                            resumed.engine.module.parameters()):
        assert torch.equal(param, resumed_param), name
    worker.engine.save_checkpoint(str(tmp_path / "global_step_2" / "actor"), global_step=2, max_ckpt_to_keep=1)
    assert not (tmp_path / "global_step_1" / "actor").exists()
    assert (tmp_path / "global_step_2" / "actor" / "huggingface" / "config.json").exists()


def test_a_save_that_fails_midway_keeps_the_earlier_checkpoint(checkpoint, tmp_path, monkeypatch):
    """Saving again to a checkpoint's path (a full disk while the model is written): the earlier checkpoint stays
    whole and loadable, byte for byte; the next save replaces it and clears what the failed one left."""
    import harts.integrations.verl as harts_verl

    worker = make_worker(checkpoint, actor_config())
    path = tmp_path / "global_step_1" / "actor"
    worker.engine.save_checkpoint(str(path), global_step=1)

    def files() -> dict[str, bytes]:
        return {str(f.relative_to(path)): f.read_bytes() for f in path.rglob("*")
                if f.is_file() and not any(part.startswith(".") for part in f.relative_to(path).parts)}

    before = files()

    def full_disk(module, directory):
        Path(directory).mkdir(parents=True)
        (Path(directory) / "model.safetensors").write_bytes(b"cut short")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(harts_verl, "save_hf_checkpoint", full_disk)
    with pytest.raises(OSError, match="No space left"):
        worker.engine.save_checkpoint(str(path), global_step=1)
    assert files() == before
    make_worker(checkpoint, actor_config()).engine.load_checkpoint(str(path))
    monkeypatch.undo()
    worker.engine.save_checkpoint(str(path), global_step=1)
    assert sorted(f.name for f in path.iterdir()) == ["harts_optimizer.pt", "huggingface"]


# ---------------------------------------------------------------------------------------------
# What the engine refuses


def test_offload_is_refused(checkpoint):
    actor = actor_config(fsdp_config=FSDPEngineConfig(dtype="float32", param_offload=True))
    with pytest.raises(ValueError, match="param_offload: HARTS keeps the model and optimizer on the device"):
        make_worker(checkpoint, actor)


@pytest.mark.parametrize("fault", ["positions", "temperatures", "vocabulary", "sum-pi-squared"])
def test_bad_batches_are_refused(checkpoint, fault):
    batch = rollout_batch(seed=12)
    worker = make_worker(checkpoint, actor_config())
    batch_td = old_log_prob_input(batch)
    if fault == "positions":
        positions = batch_td["position_ids"]
        values = positions.values().clone()
        values[5] += 1
        batch_td["position_ids"] = torch.nested.nested_tensor_from_jagged(values, positions.offsets())
        message = r"position_ids: sequence 0 has position \d+ at token 5 \(HARTS needs 0, 1, ... per sequence\)"
    elif fault == "temperatures":
        tu.assign_non_tensor(batch_td, temperature=None)
        batch_td["temperature"] = torch.linspace(0.5, 1.0, len(batch_td))
        message = "temperature: one temperature per batch is supported"
    elif fault == "vocabulary":
        ids = batch_td["input_ids"]
        values = ids.values().clone()
        values[7] = VOCAB + 3
        batch_td["input_ids"] = torch.nested.nested_tensor_from_jagged(values, ids.offsets())
        message = r"input_ids: token 259 at sequence 0, token 7 is outside the model's vocabulary \[0, 256\)"
    else:
        tu.assign_non_tensor(batch_td, calculate_sum_pi_squared=True)
        message = "calculate_sum_pi_squared: not supported"
    with pytest.raises(ValueError, match=message):
        worker.infer_batch(batch_td)


# ---------------------------------------------------------------------------------------------
# Data parallel: two ranks, each with half the batch, take the step one rank takes with all of it

DP_LOSS = dict(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.05, ppo_micro_batch_size_per_gpu=2)


def _data_parallel_rank(rank: int, world: int, checkpoint: str, store: str, out: str) -> None:
    os.environ.update(WORKER_ENVIRONMENT, WORLD_SIZE=str(world), RANK=str(rank))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    actor = actor_config(**DP_LOSS)
    batch = torch.load(os.path.join(out, "batch.pt"), weights_only=False)
    rows = len(batch) // world
    half = batch[rank * rows:(rank + 1) * rows]  # verl's dispatch: contiguous chunks, one per data-parallel rank
    worker = make_worker(checkpoint, actor)
    metrics = tu.get(worker.train_mini_batch(update_actor_input(half, actor)), "metrics")
    if rank == 0:
        torch.save({"grad_norm": metrics["grad_norm"], "params": dict(worker.engine.module.named_parameters()),
                    "biases": [b.mlp.expert_bias for b in worker.engine.module.blocks if b.is_moe]},
                   os.path.join(out, "rank0.pt"))
    torch.distributed.destroy_process_group()


def test_two_data_parallel_ranks_take_the_single_rank_step(tmp_path):
    """Averaged gradients (verl's loss scales each rank's by dp_size over the global token count) and summed
    routed counts: the update of two ranks equals one rank's on the whole batch (the same per-tensor bound as the
    AdamW test), the gradient norm within 1e-5 and the expert biases exactly."""
    path = save_model(tmp_path / "moe", moe_losses=True)
    actor = actor_config(**DP_LOSS)
    batch = with_old_and_ref_log_probs(rollout_batch(seed=14), reference_engine(path), seed=15)
    torch.save(batch, tmp_path / "batch.pt")
    torch.multiprocessing.spawn(_data_parallel_rank, args=(2, str(path), str(tmp_path / "store"), str(tmp_path)),
                                nprocs=2)
    two = torch.load(tmp_path / "rank0.pt", weights_only=False)
    worker = make_worker(path, actor)
    initial = {name: p.detach().clone() for name, p in worker.engine.module.named_parameters()}
    metrics = tu.get(worker.train_mini_batch(update_actor_input(batch, actor)), "metrics")
    assert abs(two["grad_norm"][0] - metrics["grad_norm"][0]) <= 1e-5 * metrics["grad_norm"][0]
    for name, param in worker.engine.module.named_parameters():
        update, two_update = param - initial[name], two["params"][name] - initial[name]
        assert float((two_update - update).norm() / update.norm()) <= 1e-2, name
    for bias, two_bias in zip([b.mlp.expert_bias for b in worker.engine.module.blocks if b.is_moe], two["biases"]):
        assert torch.equal(bias, two_bias)


# ---------------------------------------------------------------------------------------------
# The recipe of docs/integrations.md "The recipe"

RECIPE = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


def recipe_overrides() -> list[str]:
    """The Hydra overrides of the `python3 -m verl.trainer.main_ppo` command of the docs, variables expanded."""
    text = RECIPE.read_text(encoding="utf-8")
    block = re.search(r"```bash\n(MODEL=.*?)```", text, re.S).group(1)
    lines = block.replace("\\\n", " ").splitlines()
    variables = dict(item.split("=", 1) for item in shlex.split(lines[0]))
    command = shlex.split(string.Template(lines[1]).substitute(variables))
    assert command[:3] == ["python3", "-m", "verl.trainer.main_ppo"], command[:3]
    return command[3:]


def test_the_documented_recipe_selects_harts_in_verls_config():
    """The docs' command composed with verl's own Hydra config (`ppo_trainer`, as main_ppo composes it): verl's
    validate_config accepts it, and the actor and the reference policy (converted as ActorRolloutRefWorker
    converts them) both get the harts engine, without offload, the reference forward-only."""
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    import verl.trainer

    overrides = recipe_overrides()
    assert "actor_rollout_ref.actor.strategy=harts" in overrides
    with initialize_config_dir(config_dir=str(Path(verl.trainer.__file__).parent / "config"), version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)
    assert config.actor_rollout_ref.model.external_lib == "harts.integrations.verl"
    assert need_reference_policy(config) and not need_critic(config)
    validate_config(config, use_reference_policy=True, use_critic=False)
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    ref = config.actor_rollout_ref.ref
    with open_dict(ref):
        ref.ppo_mini_batch_size = config.actor_rollout_ref.actor.ppo_mini_batch_size
        ref.ppo_micro_batch_size = ref.pop("log_prob_micro_batch_size", None)
        ref.ppo_micro_batch_size_per_gpu = ref.pop("log_prob_micro_batch_size_per_gpu", None)
        ref.use_dynamic_bsz = ref.pop("log_prob_use_dynamic_bsz", False)
        ref.ppo_max_token_len_per_gpu = ref.pop("log_prob_max_token_len_per_gpu", None)
    ref = omega_conf_to_dataclass(ref)
    for engine, forward_only in ((actor.engine, False), (ref.engine, True)):
        assert EngineRegistry.get_engine_cls("language_model", engine.strategy) is harts_verl.HartsEngine
        assert (engine.param_offload, engine.optimizer_offload, engine.forward_only) == (False, False, forward_only)
    assert actor.use_dynamic_bsz and not config.trainer.balance_batch
