"""verl's training engine backed by HARTS: the rows of verl's batch planned and executed compactly.

`HartsEngine` is a `verl.workers.engine.BaseEngine` (verl 0.9.1), registered with `EngineRegistry` as the backend
"harts" of model type "language_model", so verl's own workers (`TrainingWorker`, `ActorRolloutRefWorker`) drive
it like their FSDP engine: the actor (train_batch, infer_batch for old log-probs), the reference policy (infer_batch)
and the weight sync to the rollout (get_per_tensor_param). Importing this module registers it; a verl run imports it
through `actor_rollout_ref.model.external_lib=harts.integrations.verl` and selects it with
`actor_rollout_ref.actor.strategy=harts` (docs/integrations.md). Only this module imports verl.

What `forward_backward_batch` receives and returns is what verl's `FSDPEngineWithLMHead` receives and returns:
- in: a TensorDict of the no-padding layout (`verl.workers.utils.padding.left_right_2_no_padding`): `input_ids`
  nested [B, j] (prompt + response, no padding), `position_ids`, `loss_mask`, and the padded fields the loss reads
  (`prompts`, `responses`, `response_mask`, `old_log_probs`, `advantages`, `ref_log_prob`, ...), with the non-tensor
  settings `temperature`, `calculate_entropy`, `use_dynamic_bsz`, `max_token_len_per_gpu`,
  `micro_batch_size_per_gpu`, `global_batch_size`;
- out: {"model_output": {"log_probs", "entropy"} as nested [B, j] tensors in the batch's order, "loss": [one float
  per micro-batch], "metrics": {name: [one value per micro-batch]}}. verl's alignment: position t holds the
  log-prob of token t + 1 and the entropy of the distribution that predicts it; at each sequence's last position
  the entropy is that of the distribution after the sequence (as verl's) and the log-prob is 0 (verl's engines
  put there the log-prob of whatever token follows in the packed micro-batch; none of verl's losses reads it).
The loss is `loss_function` (verl's `ppo_loss` with the actor's config, or any other of verl's losses) on those
outputs and the micro-batch, exactly as verl's engines call it, plus the model's MoE losses (router z-loss and load
balancing with the model config's coefficients, q-weighted over compact rows, DESIGN §4) averaged over the
micro-batches; after the optimizer step the aux-loss-free expert biases move by the step's q-weighted routed counts.

HARTS's part: the local batch becomes one `Step` (sequence b = trajectory b); micro-batches are HARTS's planner's
(`use_dynamic_bsz`: `max_token_len_per_gpu` bounds a micro-batch's compact rows C, not its S tokens, so a GRPO group
shares its prompt inside one micro-batch) or verl's fixed-size chunks of `micro_batch_size_per_gpu` sequences; each
runs as its trie through a `harts.engine.Engine` of the model (`Engine.forward_microbatch`: every shared prefix
computed once, log-probs through the compact LM head, never S × V). Data parallel: every rank holds the whole
model; the gradients (fp32 masters of `harts.optim.MasterWeightAdamW`, AdamW with verl's hyper-parameters and verl's
warm-up/cosine schedule) and the routed counts are averaged/summed over verl's data-parallel group before clipping.

Tested (tests/integrations/test_verl.py, in the verl environment of .ci/setup) against verl's own computation on
batches built by verl's code: `FSDPEngineWithLMHead`'s forward over each sequence alone (its packing, rolled
labels, temperature, `logprobs_from_logits`, `entropy_from_logits`) for log-probs and entropy, verl's `ppo_loss`
(core_algos) for the loss, and the parameter gradients of that reference.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable, Generator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harts.api import packed_batch
from harts.config.execution import ExecutionConfig
from harts.engine import Engine
from harts.extras import MissingExtra
from harts.files import fsync_file
from harts.model.hf import hf_tensors, load_hf_checkpoint, save_hf_checkpoint
from harts.model.model import HybridModel
from harts.objective.step import step_config
from harts.objective.targets import semantic_targets_from_step
from harts.optim.adamw import MasterWeightAdamW
from harts.optim.config import OptimizerConfig
from harts.optim.update import update_expert_biases
from harts.planning.microbatch import plan as plan_microbatches
from harts.trees.trie import PrefixIndex

try:
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode
    from verl.workers.engine.base import BaseEngine, BaseEngineCtx, EngineRegistry
    from verl.workers.engine.utils import detach_tree, postprocess_batch_func
except ModuleNotFoundError as error:
    if error.name is None or error.name.split(".")[0] not in ("verl", "tensordict"):
        raise
    raise MissingExtra("harts.integrations.verl needs verl, which is not installed: pip install 'harts[verl]'",
                       name="verl") from None

BACKEND = "harts"
"""verl's strategy name of this engine (`actor_rollout_ref.actor.strategy`)."""
PARAM_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
COMPUTE_DTYPES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}
OPTIMIZER_STATE = "harts_optimizer.pt"
"""A checkpoint's optimizer file beside its model directory `huggingface/`."""


def _where(field: str) -> str:
    return f"verl engine '{BACKEND}': {field}"


class HartsEngine(BaseEngine):
    """verl's BaseEngine over a HARTS `HybridModel` loaded from a Kimi-Linear checkpoint (module docstring).

    Args (verl's worker passes the first four, as to every engine):
        model_config: verl's HFModelConfig: `local_path` is the checkpoint directory (`harts.model.hf`);
            `enable_gradient_checkpointing` is HARTS's per-layer recomputation.
        engine_config: verl's engine config (`actor.fsdp_config` under strategy "harts"): `dtype` is the compute
            dtype (bfloat16: autocast; float32), `model_dtype` the parameters' (fp32 default; bf16 keeps fp32
            masters in the optimizer), `forward_only` builds no optimizer (the reference policy).
        optimizer_config: verl's optimizer config: AdamW (torch.optim) with lr, betas, weight_decay (every
            parameter, as verl's FSDP engine), clip_grad, and verl's constant or cosine schedule with warm-up.
        checkpoint_config: verl's; checkpoints hold the model in `huggingface/` and the optimizer state.

    HARTS's execution is the compact one with the device's attention and KDA backends (`harts.api.default_config`);
    the loss fields of its StepConfig are not used (verl's loss_function is).
    """

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        super().__init__()
        self.model_config = model_config
        self.engine_config = engine_config
        self.optimizer_config = optimizer_config
        self.checkpoint_config = checkpoint_config
        self.mode = None
        for name in ("param_offload", "optimizer_offload"):
            if getattr(engine_config, name, False):
                raise ValueError(f"{_where(name)}: HARTS keeps the model and optimizer on the device: set it false")
        if getattr(engine_config, "ulysses_sequence_parallel_size", 1) > 1:
            raise ValueError(f"{_where('ulysses_sequence_parallel_size')}: sequence parallelism is not supported: "
                             "set it to 1")
        if getattr(model_config, "lora_rank", 0) > 0:
            raise ValueError(f"{_where('lora_rank')}: LoRA is not supported: set it to 0")
        compute = str(getattr(engine_config, "dtype", "bfloat16"))
        if compute not in COMPUTE_DTYPES:
            raise ValueError(f"{_where('dtype')}: HARTS computes in bfloat16 or float32, got {compute!r}")
        param = str(getattr(engine_config, "model_dtype", None) or "fp32")
        if param not in PARAM_DTYPES:
            raise ValueError(f"{_where('model_dtype')}: HARTS keeps parameters in fp32 or bf16, got {param!r}")
        self.param_dtype = PARAM_DTYPES[param]
        # verl's get_device_name() says "cuda" on a machine without GPUs too.
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.step_config = step_config(ExecutionConfig(
            recompute=bool(getattr(model_config, "enable_gradient_checkpointing", False)),
            dtype=COMPUTE_DTYPES[compute],
        ), "cuda" if cuda else "cpu", execution="compact")
        self.forward_only = bool(getattr(engine_config, "forward_only", False))
        self.module: HybridModel | None = None
        self.harts_engine: Engine | None = None
        """The module's HARTS engine (built with it, `initialize`)."""
        self.optimizer: MasterWeightAdamW | None = None
        self.lr_scheduler = None
        self._tokens_per_expert: list[torch.Tensor] = []
        self._saved_checkpoints: list[str] = []

    # -----------------------------------------------------------------------------------------
    # Construction, modes, parallel groups

    def initialize(self):
        """Load the model (`model_config.local_path`, a Kimi-Linear checkpoint) and, unless forward-only, the
        optimizer and the learning-rate schedule."""
        self.module, _ = load_hf_checkpoint(self.model_config.local_path, dtype=self.param_dtype, device=self.device)
        self.harts_engine = Engine(self.module, self.step_config)
        if self.forward_only:
            self.module.requires_grad_(False)
            return
        self.optimizer = MasterWeightAdamW(self.module.named_parameters(), self._optimizer_settings())
        self.lr_scheduler = self._build_lr_scheduler()

    def _optimizer_settings(self) -> OptimizerConfig:
        config = self.optimizer_config
        name, impl = getattr(config, "optimizer", "AdamW"), getattr(config, "optimizer_impl", "torch.optim")
        if (name, impl) != ("AdamW", "torch.optim"):
            raise ValueError(f"{_where('optim.optimizer')}: HARTS runs AdamW of torch.optim, got {impl}.{name}")
        if getattr(config, "override_optimizer_config", None):
            raise ValueError(f"{_where('optim.override_optimizer_config')}: not supported: leave it empty")
        beta1, beta2 = config.betas
        return OptimizerConfig(lr=config.lr, beta1=beta1, beta2=beta2, weight_decay=config.weight_decay,
                               weight_decay_vectors=True, max_grad_norm=config.clip_grad)

    def _build_lr_scheduler(self):
        from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

        config = self.optimizer_config
        warmup = config.lr_warmup_steps
        if warmup is None or warmup <= 0:
            warmup = int(config.lr_warmup_steps_ratio * config.total_training_steps)
        kind = getattr(config, "lr_scheduler_type", "constant")
        if kind == "constant":
            return get_constant_schedule_with_warmup(optimizer=self.optimizer.optimizer, num_warmup_steps=warmup)
        if kind == "cosine":
            return get_cosine_schedule_with_warmup(
                optimizer=self.optimizer.optimizer, num_warmup_steps=warmup,
                num_training_steps=config.total_training_steps, min_lr_ratio=config.min_lr_ratio or 0.0,
                num_cycles=config.num_cycles, zero_indexed_step=config.zero_indexed_step,
            )
        raise ValueError(f"{_where('optim.lr_scheduler_type')}: expected constant or cosine, got {kind!r}")

    @property
    def is_param_offload_enabled(self) -> bool:
        return False

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return False

    def train_mode(self, **kwargs):
        return _ModeContext(self, "train", **kwargs)

    def eval_mode(self, **kwargs):
        return _ModeContext(self, "eval", **kwargs)

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        super().to(device=device, model=model, optimizer=optimizer, grad=grad)
        if model or optimizer:
            raise ValueError(f"{_where('to')}: the model and optimizer stay on {self.device} (no offload)")

    def is_mp_src_rank_with_outputs(self):
        return True

    def get_data_parallel_rank(self):
        return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    def get_data_parallel_size(self):
        return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1

    def get_data_parallel_group(self):
        return torch.distributed.group.WORLD if torch.distributed.is_initialized() else None

    # -----------------------------------------------------------------------------------------
    # Forward, backward, update

    def forward_backward_batch(self, data: TensorDict, loss_function: Callable | None, forward_only=False) -> dict:
        """verl's forward (and backward) of one (mini-)batch: see the module docstring for what goes in and out."""
        if tu.get_non_tensor_data(data=data, key="pad_mode", default=DatasetPadMode.NO_PADDING) != \
                DatasetPadMode.NO_PADDING:
            raise ValueError(f"{_where('pad_mode')}: HARTS reads verl's no-padding layout (left_right_2_no_padding)")
        for key in ("calculate_sum_pi_squared", "distillation_use_topk", "distillation_only"):
            if tu.get_non_tensor_data(data=data, key=key, default=False):
                raise ValueError(f"{_where(key)}: not supported (HARTS never forms the full-vocabulary logits)")
        if len(data.get("multi_modal_inputs", [])):
            raise ValueError(f"{_where('multi_modal_inputs')}: HARTS models are text-only")
        dp_size = self.get_data_parallel_size()
        tu.assign_non_tensor(data, sp_size=1, dp_size=dp_size)
        if "loss_mask" in data.keys():
            # Loss normalisation over the global batch, as verl's engines count it.
            num_tokens = data["loss_mask"].sum().to(self.device)
            if dp_size > 1:
                torch.distributed.all_reduce(num_tokens, group=self.get_data_parallel_group())
            tu.assign_non_tensor(data, batch_num_tokens=num_tokens.item())
        return_model_output = tu.get_non_tensor_data(data=data, key="return_model_output", default=False)
        calculate_entropy = bool(tu.get_non_tensor_data(data=data, key="calculate_entropy", default=False))
        temperature = _temperature(data["temperature"])

        input_ids = data["input_ids"]
        offsets = input_ids.offsets().cpu().numpy()
        batch = packed_batch({"input_ids": input_ids.values().cpu(), "cu_seqlens": offsets})
        step = batch.step
        _check_positions(data, offsets)
        vocab = self.module.config.vocab_size
        if int(step.tokens.max()) >= vocab:
            k = int(np.argmax(step.tokens >= vocab))
            raise ValueError(f"{_where('input_ids')}: token {int(step.tokens[k])} at {batch.locate(k)} is outside "
                             f"the model's vocabulary [0, {vocab})")
        groups = self._microbatches(data, step)
        index = PrefixIndex.from_step(step)
        targets_S = torch.from_numpy(semantic_targets_from_step(step).targets).to(self.device)

        outputs = []
        for members in groups:
            # On the model's device, as verl's engines hand it to the loss function.
            micro = tu.index_select_tensor_dict(data, members.tolist()).to(self.device)
            with (torch.no_grad() if forward_only else nullcontext()):
                loss, output = self._microbatch(step, index, members, targets_S, micro, loss_function,
                                                temperature, calculate_entropy, forward_only, len(groups))
                if not forward_only:
                    loss.backward()
                    if not return_model_output:
                        output.pop("model_output")
            outputs.append(output)
        # verl puts the outputs back in batch order when use_dynamic_bsz (the chunks are in order already).
        return postprocess_batch_func(output_lst=outputs, indices=[m.tolist() for m in groups], data=data)

    def _microbatches(self, data: TensorDict, step) -> list[np.ndarray]:
        """Member arrays (sequence indices): HARTS's plan with `max_token_len_per_gpu` compact rows per
        micro-batch (`use_dynamic_bsz`, verl's default), else verl's consecutive chunks of
        `micro_batch_size_per_gpu` sequences."""
        num = step.num_trajectories
        if tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
            capacity = data["max_token_len_per_gpu"]
            if capacity is None:
                raise ValueError(f"{_where('max_token_len_per_gpu')}: required with use_dynamic_bsz")
            plan = plan_microbatches(step, int(capacity), 1, "harts")
            return [np.sort(np.asarray([int(t) for t in mb.trajectory_ids], dtype=np.int64))
                    for mb in plan.microbatches if mb.trajectory_ids]
        size = data["micro_batch_size_per_gpu"]
        if size is None or size < 1 or num % size:
            raise ValueError(f"{_where('micro_batch_size_per_gpu')}: {size!r} does not divide the batch's {num} "
                             "sequences")
        return [np.arange(start, start + size) for start in range(0, num, size)]

    def _microbatch(self, step, index, members, targets_S, micro, loss_function, temperature, calculate_entropy,
                    forward_only, num_microbatches):
        out = self.harts_engine.forward_microbatch(step, members, targets_S, index=index, temperature=temperature,
                                                   return_entropy=calculate_entropy)
        logprobs_S, entropy_S, moe, auxes = out.logprobs_S, out.entropy_S, out.moe_loss, out.auxes
        lengths = step.lengths[members]
        offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)])).to(self.device)
        # Semantic position k predicts token k + 1 (verl's alignment); a sequence's last position predicts nothing.
        logprobs_S = logprobs_S.index_fill(0, offsets[1:] - 1, 0.0)
        model_output = {"log_probs": torch.nested.nested_tensor_from_jagged(logprobs_S, offsets)}
        if calculate_entropy:
            model_output["entropy"] = torch.nested.nested_tensor_from_jagged(entropy_S, offsets)
        if loss_function is not None:
            loss, metrics = loss_function(model_output=model_output, data=micro,
                                          dp_group=self.get_data_parallel_group())
        else:
            assert forward_only, "a loss_function is needed unless forward_only"
            loss, metrics = torch.tensor(1.0, device=self.device), {}
        if not forward_only:
            loss = loss + moe / num_microbatches
            counts = [aux.tokens_per_expert_E.detach() for aux in auxes]
            self._tokens_per_expert = counts if not self._tokens_per_expert else [
                a + b for a, b in zip(self._tokens_per_expert, counts)]
        metrics = dict(metrics)
        metrics["harts/compact_rows"] = out.num_rows
        metrics["harts/tokens"] = int(lengths.sum())
        metrics["harts/moe_loss"] = float(moe.detach()) / num_microbatches
        return loss, {"model_output": detach_tree(model_output), "loss": loss.detach().item(), "metrics": metrics}

    def optimizer_zero_grad(self):
        self.optimizer.zero_grad()
        self._tokens_per_expert = []

    def optimizer_step(self):
        """Average the gradients and sum the routed counts over the data-parallel group, clip to
        `clip_grad`, then AdamW and the expert-bias update; a non-finite norm skips the update (as verl's FSDP
        engine). Returns the gradient norm before clipping."""
        dp_size = self.get_data_parallel_size()
        if dp_size > 1:
            group = self.get_data_parallel_group()
            for master in self.optimizer.masters:
                if master.grad is None:
                    master.grad = torch.zeros_like(master)
                torch.distributed.all_reduce(master.grad, group=group)
                master.grad.div_(dp_size)
            for counts in self._tokens_per_expert:
                torch.distributed.all_reduce(counts, group=group)
        grad_norm = self.optimizer.clip_grad_norm(self.optimizer_config.clip_grad)
        if not math.isfinite(grad_norm):
            print(f"WARN: grad_norm is not finite: {grad_norm}")
            self.optimizer_zero_grad()
            return grad_norm
        self.optimizer.step()
        if self._tokens_per_expert:
            update_expert_biases(self.module, self._tokens_per_expert)
        return grad_norm

    def lr_scheduler_step(self):
        self.lr_scheduler.step()
        return self.lr_scheduler.get_last_lr()[0]

    # -----------------------------------------------------------------------------------------
    # Weight sync and checkpoints

    def get_per_tensor_param(self, **kwargs) -> tuple[Generator[tuple[str, torch.Tensor], None, None], None]:
        """The weights in the Kimi-Linear layout (`harts.model.hf.hf_tensors`), bf16 as verl's FSDP engine
        sends them, one tensor at a time, and no PEFT config."""
        return hf_tensors(self.module, dtype=torch.bfloat16), None

    def save_checkpoint(self, local_path: str, hdfs_path: str | None = None, global_step: int = 0,
                        max_ckpt_to_keep: int | None = None, **kwargs) -> None:
        """`local_path`/huggingface (the model, `save_hf_checkpoint`) and `local_path`/harts_optimizer.pt (AdamW,
        fp32 masters, schedule), written by rank 0; older checkpoints of this engine beyond `max_ckpt_to_keep`
        are removed. Both are written beside the ones they replace (hidden `.NAME.partial`) and renamed over them
        only when complete: a kill or a full disk mid-save leaves the earlier checkpoint at `local_path`."""
        if hdfs_path is not None:
            raise ValueError(f"{_where('save_checkpoint')}: hdfs_path is not supported")
        root = Path(local_path)
        if self.get_data_parallel_rank() == 0:
            model_dir, state_file = root / "huggingface", root / OPTIMIZER_STATE
            staged, staged_state = root / ".huggingface.partial", root / f".{OPTIMIZER_STATE}.partial"
            replaced = root / ".huggingface.replaced"
            if replaced.exists() and not model_dir.exists():  # a save killed between its two renames
                replaced.rename(model_dir)
            for stale in (staged, replaced):  # left by a save that was killed
                if stale.exists():
                    shutil.rmtree(stale)
            root.mkdir(parents=True, exist_ok=True)
            save_hf_checkpoint(self.module, staged)
            if self.optimizer is not None:
                state = {"optimizer": self.optimizer.optimizer.state_dict(), "masters": self.optimizer.copies,
                         "lr_scheduler": self.lr_scheduler.state_dict(), "global_step": global_step}
                torch.save(state, staged_state)
                fsync_file(staged_state)
            if model_dir.exists():
                model_dir.rename(replaced)
            staged.rename(model_dir)
            if self.optimizer is not None:
                os.replace(staged_state, state_file)
            if replaced.exists():
                shutil.rmtree(replaced)
            if str(root) not in self._saved_checkpoints:
                self._saved_checkpoints.append(str(root))
            while max_ckpt_to_keep and len(self._saved_checkpoints) > max_ckpt_to_keep:
                shutil.rmtree(self._saved_checkpoints.pop(0), ignore_errors=True)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    def load_checkpoint(self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = True,
                        **kwargs) -> None:
        """The model, optimizer and schedule of `save_checkpoint`'s `local_path` (kept on disk)."""
        if hdfs_path is not None:
            raise ValueError(f"{_where('load_checkpoint')}: hdfs_path is not supported")
        root = Path(local_path)
        loaded, _ = load_hf_checkpoint(root / "huggingface", dtype=self.param_dtype, device=self.device)
        with torch.no_grad():
            self.module.load_state_dict(loaded.state_dict())
        if self.optimizer is not None:
            state = torch.load(root / OPTIMIZER_STATE, map_location=self.device, weights_only=True)
            self.optimizer.optimizer.load_state_dict(state["optimizer"])
            self.optimizer.load_copies(state["masters"], str(root / OPTIMIZER_STATE))
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])


class _ModeContext(BaseEngineCtx):
    """verl's mode context (no offload to do) that also switches the module's train/eval mode."""

    def __enter__(self):
        super().__enter__()
        self.engine.module.train(self.mode == "train")

    def __exit__(self, exc_type, exc_value, traceback):
        if self.mode == "train" and (self.zero_grad_on_exit or exc_type is not None):
            self.engine.optimizer_zero_grad()
        super().__exit__(exc_type, exc_value, traceback)


def _temperature(value: Any) -> float:
    """verl's `temperature`: a number, or one per sequence (all equal: HARTS samples one distribution per row)."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 0 or not bool((value == value.reshape(-1)[0]).all()):
            raise ValueError(f"{_where('temperature')}: one temperature per batch is supported, got "
                             f"{value.reshape(-1)[:8].tolist()}")
        value = value.reshape(-1)[0].item()
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{_where('temperature')}: must be a finite number > 0, got {value!r}")
    return value


def _check_positions(data: TensorDict, offsets: np.ndarray) -> None:
    """HARTS places every token by its path position: verl's position ids must count 0, 1, ... per sequence."""
    if "position_ids" not in data.keys():
        return
    positions = data["position_ids"]
    if positions.dim() != 2:
        raise ValueError(f"{_where('position_ids')}: multi-dimensional (mRoPE) positions are not supported")
    values = positions.values().cpu().numpy()
    lengths = np.diff(offsets)
    expected = np.arange(int(offsets[-1])) - np.repeat(offsets[:-1], lengths)
    bad = np.flatnonzero(values != expected)
    if len(bad):
        b = int(np.searchsorted(offsets, bad[0], side="right") - 1)
        raise ValueError(f"{_where('position_ids')}: sequence {b} has position {int(values[bad[0]])} at token "
                         f"{int(bad[0] - offsets[b])} (HARTS needs 0, 1, ... per sequence)")


def register_kimi_linear_config() -> None:
    """Let verl's HFModelConfig read a HARTS checkpoint's config.json (`model_type` "kimi_linear") when the
    installed transformers has no Kimi-Linear classes (verl 0.9.1 pins transformers < 5.11; they came in 5.25):
    a plain config class under that name. Moonshot's own checkpoints load theirs with trust_remote_code."""
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "kimi_linear" in CONFIG_MAPPING:
        return

    class KimiLinearConfig(PretrainedConfig):
        model_type = "kimi_linear"

    AutoConfig.register("kimi_linear", KimiLinearConfig)


if BACKEND not in EngineRegistry._engines.get("language_model", {}):
    EngineRegistry.register(model_type="language_model", backend=BACKEND, device=["cuda", "cpu"])(HartsEngine)
register_kimi_linear_config()
