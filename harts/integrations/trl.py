"""HARTS inside TRL's GRPO trainer (trl 1.16): `HARTSGRPOTrainer`, a `trl.GRPOTrainer` whose per-token log-probs,
entropies and loss run through HARTS's compact execution (`harts.api`), so that the prompt a GRPO group shares
is computed once per micro-batch instead of once per completion.

The model is a transformers model of an architecture HARTS carries (`KimiLinearForCausalLM`,
`BailingHybridForCausalLM` (Ling-3), `Qwen3NextForCausalLM`, `Qwen3_5MoeForCausalLM`: e.g. `harts export` of a
kimi-tiny, bailing-tiny or gdn-tiny training, or a checkpoint of the Hub): TRL keeps driving it (generation, the
optimizer, `save_pretrained`, the reference model) and HARTS runs its parameters in place
(`harts.model.hf_modules.HFParameterView`: gradients land in the Hugging Face parameters; another model is refused
by name at construction). transformers' models hold no MTP layers, and TRL's loss has no MTP term: HARTS
runs the decoder, as TRL does. What the trainer replaces, and nothing else:
- `_get_per_token_logps_and_entropies` (old and reference log-probs, in TRL's `batch_size` chunks): `api.logprobs`
  of the padded prompt + completion rows at TRL's temperature;
- `_compute_loss`: `api.policy_loss` of the micro-batch with TRL's loss read as a HARTS `GRPOConfig`
  (`grpo_config_from_trl`, the mapping of docs/losses.md) and TRL's normaliser of each `loss_type` (dapo, cispo and
  vespo: `num_items_in_batch` per accumulation step; grpo, sapo, dr_grpo, luspo: the micro-batch's rows × the
  accumulation steps; bnpo: its masked tokens × the accumulation steps); the entropy bonus is a token mean over the
  micro-batch, as TRL's. The router auxiliary loss that TRL adds for a model whose config declares
  router_aux_loss_coef (Qwen3-Next's and Qwen3.5's 0.001, unless the GRPOConfig sets another): transformers'
  load-balancing loss of the micro-batch's real tokens, every MoE layer's router statistics pooled, each token once
  per completion (`api.policy_loss(pooled_balance=True)`), added as TRL adds it: coefficient × loss / the
  accumulation steps (1 in evaluation), logged as `aux_loss`. It logs every metric TRL's `_compute_loss` logs,
  with TRL's definitions on HARTS's log-probs, entropies and loss and TRL's reductions over the processes
  (`harts.integrations.trl_metrics`): `entropy`, `kl` with beta, the clip surrogates' `clip_ratio/low_mean`,
  `low_min`, `high_mean`, `high_max` and `region_mean`, cispo's `cispo_clip_ratio`, vespo's `vespo/phi_seq_mean`,
  and with the entropy bonus `policy_loss` and `entropy_coef`; and `harts/rows` (rows HARTS computed),
  `harts/tokens` (real tokens) and `harts/padded_rows` (rows TRL's padded forward computes) per call, summed over
  the processes (`harts_counts`: this process's totals).
- `training_step`: TRL's, with the HARTS model bound over the policy's tensors until after the backward, where
  HARTS's recomputation (TRL's `gradient_checkpointing`, on by default, read as `recompute`) runs blocks again.

Several processes (`accelerate launch` or torchrun): data parallelism through accelerate's DistributedDataParallel,
each process a whole replica of the model. DDP's reducer averages gradients only after its own forward (its
gradient hooks act between the forward's `prepare_for_backward` and the end of that backward), and HARTS does not
call the model's forward, so `_compute_loss` runs HARTS's loss as the forward of the DDP wrapper
(`forward_through`): DDP then reduces exactly as it does for stock TRL, a mean over the processes once per backward,
not inside `no_sync` (the Trainer's accumulation micro-batches before the last), with its buckets, comm hooks and
`find_unused_parameters`. What TRL computes across processes is TRL's: the advantages (rewards gathered),
`num_items_in_batch` (gathered; dapo, cispo and vespo divide it by the number of processes, as TRL), the metrics
above. Refused by name at construction: DeepSpeed (any ZeRO stage), FSDP, accelerate's other distributed types
(XLA, Megatron-LM) and a `parallelism_config` with tensor, context, sequence or sharded data parallelism, since
HARTS reads each process's parameters whole; at run time, a training step of several processes whose model no DDP
wraps.

TRL's features that act inside the loss and have no HARTS reading are refused at construction with the option to
turn off: top_entropy_quantile < 1, off_policy_mask_threshold, vLLM's importance-sampling correction, adaptive
entropy, the router auxiliary loss of a model without softmax routing, PEFT models, multimodal inputs. The HARTS
model adds no MoE auxiliary losses of its own (its MoE config's coefficients are zeroed): the router auxiliary loss
is TRL's, read as above.

Invariant (tests/integrations/test_trl.py, in one process; tests/integrations/test_trl_processes.py, on two gloo
processes): from the same seed, N steps of `trl.GRPOTrainer` and of `HARTSGRPOTrainer` generate the same
completions and give the same losses and parameters (fp32 rounding) and metrics, with fewer rows computed by HARTS.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from harts import api
from harts.extras import require
from harts.integrations.trl_metrics import loss_metrics, reduce_over_processes
from harts.model.hf_modules import HFParameterView, hf_model_config, without_moe_losses
from harts.objective.losses import GRPOConfig
from harts.objective.step import StepConfig

trl = require("trl", "harts.integrations.trl (HARTS inside TRL's GRPO trainer)")

SUPPORTED_TRL = ("1.16",)
"""TRL minor releases whose private methods this trainer overrides (pyproject's extra `trl` pins the range)."""
TOKEN_NORMALIZED = ("dapo", "cispo", "vespo")
"""TRL loss types divided by the generation batch's masked tokens per accumulation step (`num_items_in_batch`)."""
ROW_NORMALIZED = ("grpo", "sapo", "dr_grpo", "luspo")
"""TRL loss types divided by the micro-batch's rows (and the accumulation steps)."""
DATA_PARALLEL_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
                       "MULTI_XPU", "MULTI_HPU", "MULTI_NEURON")
"""accelerate's distributed types that run one process or wrap the model in DistributedDataParallel."""
MULTIMODAL_FIELDS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                     "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def grpo_config_from_trl(args: Any) -> GRPOConfig:
    """HARTS's reading of a `trl.GRPOConfig`'s loss (docs/losses.md, TRL's tables): surrogate, clip range,
    aggregation, KL term and entropy bonus. The normaliser is the trainer's (module docstring)."""
    loss_type = args.loss_type
    epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    fields: dict[str, Any] = dict(clip_ratio_low=args.epsilon, clip_ratio_high=epsilon_high,
                                  importance_sampling_level=args.importance_sampling_level)
    if loss_type in ("grpo", "sapo"):
        fields["aggregation"] = "seq-mean-token-mean"
    elif loss_type == "dr_grpo":
        fields.update(aggregation="seq-mean-token-sum-norm", loss_scale_factor=float(args.max_completion_length))
    elif loss_type == "luspo":
        fields["aggregation"] = "seq-mean-token-sum"
    elif loss_type not in ("dapo", "bnpo", "cispo", "vespo"):
        raise ValueError(f"trl.GRPOConfig: loss_type {loss_type!r} has no HARTS reading")
    if loss_type == "cispo":
        # TRL's CISPO caps the ratio at epsilon_high itself and has no lower bound.
        fields.update(surrogate="cispo", clip_ratio_low=1.0, clip_ratio_high=epsilon_high - 1.0)
    elif loss_type == "sapo":
        fields.update(surrogate="sapo", sapo_tau_pos=args.sapo_temperature_pos, sapo_tau_neg=args.sapo_temperature_neg)
    elif loss_type == "vespo":
        fields.update(surrogate="vespo", vespo_k_pos=args.vespo_k_pos, vespo_lambda_pos=args.vespo_lambda_pos,
                      vespo_k_neg=args.vespo_k_neg, vespo_lambda_neg=args.vespo_lambda_neg)
    elif args.delta is not None:
        fields["ratio_cap"] = args.delta
    if args.beta != 0.0:
        fields.update(kl_coef=args.beta, kl_estimator="k3", kl_importance_weighted=bool(args.use_bias_correction_kl))
    if args.entropy_coef != 0.0:
        fields["entropy_coef"] = args.entropy_coef
        if fields.get("aggregation", "token-mean") != "token-mean":  # TRL's bonus is a token mean for every type
            fields["entropy_aggregation"] = "token-mean"
    return GRPOConfig(**fields)


def unsupported_options(args: Any) -> list[str]:
    """The settings of a `trl.GRPOConfig` that act inside TRL's loss without a HARTS reading, each with the value
    to set instead."""
    problems = []
    if args.top_entropy_quantile < 1.0:
        problems.append(f"top_entropy_quantile={args.top_entropy_quantile} (set 1.0)")
    if args.off_policy_mask_threshold is not None:
        problems.append(f"off_policy_mask_threshold={args.off_policy_mask_threshold} (set None)")
    if args.use_vllm and args.vllm_importance_sampling_correction:
        problems.append("vllm_importance_sampling_correction=True with use_vllm (set False)")
    if args.use_adaptive_entropy:
        problems.append("use_adaptive_entropy=True (set False)")
    return problems


def parallelism_problems(trainer: Any) -> list[str]:
    """How a trainer's processes would share the model other than as whole replicas under DistributedDataParallel
    (the one way HARTS runs on several processes: module docstring), each with what to run instead."""
    accelerator = trainer.accelerator
    problems = []
    if trainer.is_deepspeed_enabled:
        stage = getattr(accelerator.state.deepspeed_plugin, "zero_stage", "?")
        problems.append(f"DeepSpeed (ZeRO stage {stage}) (launch without DeepSpeed: accelerate's DDP)")
    elif trainer.is_fsdp_enabled:
        problems.append("FSDP (launch without FSDP: accelerate's DDP)")
    elif accelerator.distributed_type not in DATA_PARALLEL_TYPES:
        problems.append(f"accelerate's {accelerator.distributed_type.value} (launch DDP or one process)")
    config = getattr(accelerator, "parallelism_config", None)
    for dimension in ("dp_shard", "tp", "cp", "sp"):
        size = getattr(config, f"{dimension}_size", 1) if config is not None else 1
        if size > 1:
            problems.append(f"parallelism_config {dimension}_size={size} (set 1: DDP's replicas only)")
    return problems


def data_parallel_wrapper(model: torch.nn.Module) -> DistributedDataParallel | None:
    """The DistributedDataParallel that `model` is, or wraps under torch.compile's `_orig_mod`; None if none."""
    while not isinstance(model, DistributedDataParallel):
        model = getattr(model, "_orig_mod", None)
        if model is None:
            return None
    return model


def forward_through(wrapper: DistributedDataParallel, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`compute()`, a loss of the wrapped module's parameters, run as `wrapper`'s forward, for the backward of the
    tensor it returns (DDP may hand back a copy).

    DDP's reducer reduces only after a forward of its own: its hooks on the parameters' gradient accumulators fire
    in every backward, but act only between `prepare_for_backward`, which the wrapper's forward calls (unless under
    `no_sync`, or without gradients), and the end of that backward. HARTS runs the parameters without the module's
    forward, so the module's forward is `compute` for the call: DDP reduces this loss's gradients as it reduces the
    module's own, once per backward, only outside `no_sync` (the last micro-batch of an accumulation window), as a
    mean over the processes."""
    module = wrapper.module
    own = vars(module).get("forward")  # accelerate's autocast wrapper, if it set one
    module.forward = compute
    try:
        return wrapper()
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


class HARTSGRPOTrainer(trl.GRPOTrainer):
    """`trl.GRPOTrainer` with HARTS's compact execution for the log-probs, entropies and loss (module docstring).

    Takes GRPOTrainer's arguments; `harts_config` (optional) sets HARTS's execution (compact or baseline,
    recomputation, backends); its loss fields are always TRL's reading (`pooled_balance_coeff` too: TRL's
    router_aux_loss_coef adds that loss)."""

    def __init__(self, *args: Any, harts_config: StepConfig | None = None, **kwargs: Any) -> None:
        version = ".".join(trl.__version__.split(".")[:2])
        if version not in SUPPORTED_TRL:
            raise ValueError(f"HARTSGRPOTrainer overrides private methods of trl {', '.join(SUPPORTED_TRL)}; "
                             f"trl {trl.__version__} is installed: pip install 'harts[trl]'")
        super().__init__(*args, **kwargs)
        problems = unsupported_options(self.args)
        if trl.trainer.grpo_trainer.is_peft_model(self.model):
            problems.append("a PEFT model (train the full model)")
        problems += parallelism_problems(self)
        if self.args.fp16:
            problems.append("fp16=True (use bf16 or fp32)")
        if problems:
            raise ValueError("HARTSGRPOTrainer: TRL settings without a HARTS reading: " + "; ".join(problems))
        device = "cuda" if self.accelerator.device.type == "cuda" else "cpu"
        # No autocast unless TRL's bf16: the model computes in its parameters' dtype. TRL's gradient checkpointing
        # (on by default; transformers >= 5.25 names it activation_checkpointing) is HARTS's recomputation.
        checkpointing = getattr(self.args, "activation_checkpointing", self.args.gradient_checkpointing)
        base = harts_config or dataclasses.replace(api.device_config(device), recompute=bool(checkpointing))
        self.harts_config = StepConfig(**{**vars(base), "loss": "grpo", "grpo": grpo_config_from_trl(self.args),
                                          "pooled_balance_coeff": 0.0,
                                          "dtype": "bf16" if self.args.bf16 else base.dtype})
        self._views: dict[int, HFParameterView] = {}
        scores = self._view(self.model).config.moe.score_function  # refuses another architecture now, by name
        # TRL 1.16 takes the aux loss coefficient from the model's config when the GRPOConfig leaves it None.
        if self.aux_loss_enabled and scores != "softmax":
            raise ValueError(f"HARTSGRPOTrainer: router_aux_loss_coef={self.router_aux_loss_coef} with "
                             f"{type(self.model).__name__}'s {scores} routing (HARTS reads transformers' softmax "
                             f"load-balancing loss): set 0.0")
        self.harts_counts = {"rows": 0, "tokens": 0, "padded_rows": 0}
        """Totals over the run: rows HARTS computed, real tokens, and rows TRL's padded forwards would compute."""

    def _view(self, model: torch.nn.Module) -> HFParameterView:
        """The HARTS model over `model`'s parameters (one per model: the policy, the reference)."""
        hf_model = self.accelerator.unwrap_model(model)
        view = self._views.get(id(hf_model))
        if view is None or view.hf_model is not hf_model:
            config = without_moe_losses(hf_model_config(hf_model))
            if self.aux_loss_enabled:
                config = dataclasses.replace(config, moe=dataclasses.replace(config.moe, balance_statistics=True))
            view = self._views[id(hf_model)] = HFParameterView(hf_model, config=config)
        return view

    def training_step(self, model, inputs, num_items_in_batch=None):
        """TRL's training step with the HARTS model bound over the policy's tensors until after the backward, where
        HARTS's recomputation runs blocks again from the model's tensors (`_compute_loss` binds it again inside)."""
        with self._view(model).bound():
            return super().training_step(model, inputs, num_items_in_batch)

    def _log_rows(self, outputs: api.TokenOutputs, padded_rows: int) -> None:
        """This process's counts into `harts_counts`, their sums over the processes into the logged metrics."""
        mode = "train" if self.model.training else "eval"
        counts = {"rows": outputs.num_rows, "tokens": outputs.num_tokens, "padded_rows": padded_rows}
        for name, value in counts.items():
            self.harts_counts[name] += value
        totals = self.accelerator.reduce(torch.tensor(list(counts.values()), device=self.accelerator.device),
                                         reduction="sum")
        for name, total in zip(counts, totals.tolist(), strict=True):
            self._metrics[mode][f"harts/{name}"].append(float(total))

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
        compute_aux_loss=False, **multimodal,
    ):
        """TRL's (log-probs, entropies or None, None) of the last `logits_to_keep` columns, computed by HARTS in TRL's
        chunks of `batch_size` rows (the aux loss is `_compute_loss`'s, which does not call this)."""
        given = sorted(name for name, value in multimodal.items() if value is not None)
        if given:
            raise ValueError(f"HARTSGRPOTrainer: multimodal inputs are not supported (got {', '.join(given)})")
        assert not compute_aux_loss, "HARTSGRPOTrainer._compute_loss reads the aux loss"
        view = self._view(model)
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            batch = {"input_ids": input_ids[rows], "attention_mask": attention_mask[rows]}
            with view.bound() as harts_model:
                out = api.logprobs(harts_model, batch, temperature=self.temperature, entropy=compute_entropy,
                                   config=self.harts_config)
            self._log_rows(out, input_ids[rows].numel())
            logps.append(out.log_probs[:, -logits_to_keep:])
            if compute_entropy:
                entropies.append(out.entropy[:, -logits_to_keep:])
        return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None

    def _normalizers(self, inputs: dict, mask: torch.Tensor, accumulation: float) -> tuple[float, float]:
        """(policy loss's N, entropy bonus's N) of TRL's `_compute_loss` for this micro-batch."""
        if self.loss_type in TOKEN_NORMALIZED:
            normalizer = float(inputs["num_items_in_batch"].clamp(min=1.0)) / self.accelerator.num_processes
            if self.model.training:
                normalizer *= self.current_gradient_accumulation_steps / self.args.steps_per_generation
        elif self.loss_type in ROW_NORMALIZED:
            normalizer = mask.size(0) * accumulation
        else:  # bnpo: the micro-batch's own masked tokens
            normalizer = max(float(mask.sum()), 1.0) * accumulation
        return normalizer, max(float(mask.sum()), 1.0) * accumulation

    def _compute_loss(self, model, inputs):
        """TRL's loss of a micro-batch, computed by `harts.api.policy_loss` (module docstring)."""
        given = sorted(name for name in MULTIMODAL_FIELDS if inputs.get(name) is not None)
        if given:
            raise ValueError(f"HARTSGRPOTrainer: multimodal inputs are not supported (got {', '.join(given)})")
        completion_mask = inputs["completion_mask"]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        batch = {
            "input_ids": torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
            "attention_mask": torch.cat([inputs["prompt_mask"], completion_mask], dim=1),
            "loss_mask": mask,
            "advantages": inputs["advantages"],
            "old_log_probs": inputs.get("old_per_token_logps"),
            "ref_log_probs": inputs["ref_per_token_logps"] if self.beta != 0.0 else None,
        }
        mode = "train" if self.model.training else "eval"
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        normalizer, entropy_normalizer = self._normalizers(inputs, mask, float(accumulation))
        view = self._view(model)
        results = []

        def batch_loss() -> torch.Tensor:
            with view.bound() as harts_model:
                result = api.policy_loss(
                    harts_model, batch, config=self.harts_config, temperature=self.temperature, entropy=True,
                    normalizer=normalizer, num_microbatches=accumulation, entropy_normalizer=entropy_normalizer,
                    pooled_balance=self.aux_loss_enabled,
                )
            results.append(result)
            if self.aux_loss_enabled:  # TRL's: scaled by the accumulation steps as its policy loss is
                return result.loss + self.router_aux_loss_coef * result.pooled_balance_loss / accumulation
            return result.loss

        loss = self._reduced(model, batch_loss)
        (result,) = results
        self._log_rows(result, batch["input_ids"].numel())
        self._log_loss_metrics(mode, result, inputs, mask, float(accumulation), entropy_normalizer)
        if self.aux_loss_enabled:
            self._metrics[mode]["aux_loss"].append(
                self.accelerator.gather_for_metrics(result.pooled_balance_loss.detach()).mean().item())
        return loss

    def _reduced(self, model: torch.nn.Module, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`compute()` through the DistributedDataParallel of `model` when there is one (`forward_through`: DDP
        averages its gradients over the processes as stock TRL's forward has it do); a training step of several
        processes without one is refused, since nothing would reduce its gradients."""
        wrapper = data_parallel_wrapper(model)
        if wrapper is not None:
            return forward_through(wrapper, compute)
        if self.accelerator.num_processes > 1 and torch.is_grad_enabled():
            raise ValueError(f"HARTSGRPOTrainer: {self.accelerator.num_processes} processes train a "
                             f"{type(model).__name__} that no DistributedDataParallel wraps: its gradients would "
                             "not be averaged (launch with accelerate's DDP)")
        return compute()

    def _log_loss_metrics(self, mode: str, result: api.BatchLoss, inputs: dict, mask: torch.Tensor,
                          accumulation: float, entropy_normalizer: float) -> None:
        """The metrics TRL logs from `_compute_loss`, from HARTS's log-probs, entropies and loss, reduced over the
        processes as TRL's (`harts.integrations.trl_metrics`). With the entropy bonus, TRL's `policy_loss` is the
        loss before the bonus and, for the loss types it divides by the accumulation steps, before that division:
        HARTS's policy loss with the bonus it subtracted added back (fp32 rounding apart)."""
        width = mask.size(1)
        entropy = result.entropy[:, -width:].detach()
        policy = None
        if self._entropy_bonus_enabled:
            bonus = (self.harts_config.grpo.entropy_coef * torch.where(mask.bool(), entropy, 0.0).sum()
                     / entropy_normalizer)
            policy = (result.policy_loss.detach() + bonus) * (1.0 if self.loss_type in TOKEN_NORMALIZED
                                                              else accumulation)
        parts = loss_metrics(
            self.args, log_probs_BT=result.log_probs[:, -width:], old_log_probs_BT=inputs.get("old_per_token_logps"),
            ref_log_probs_BT=inputs.get("ref_per_token_logps"), entropy_BT=entropy, advantages=inputs["advantages"],
            mask_BT=mask, policy_loss=policy,
        )
        for name, value in reduce_over_processes(parts, self.accelerator.gather).items():
            self._metrics[mode][name].append(value)
        if self._entropy_bonus_enabled and mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
