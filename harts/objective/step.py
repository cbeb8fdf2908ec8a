"""One training step over microbatches, in either execution (forward, loss, backward).

`run_step(model, step, microbatches, config)` builds each microbatch's layout (baseline: each
trajectory its own packed sequence; compact: the microbatch's trie), runs the model, computes
the log-probs λ of every semantic position through the compact LM head
(`compact_logprobs`, never S × V; with an entropy bonus, the entropies from the same pass), applies
the GRPO/PPO loss with the step-level normalisers (so microbatch losses add up to the step's loss
whatever the microbatching) plus the MoE losses averaged over microbatches (megatron-core's
convention; with `pooled_balance_coeff`, transformers' pooled load-balancing loss of each microbatch among them,
as TRL adds it over its accumulation steps) and, for a model with MTP layers, the MTP loss (harts.objective.mtp:
each depth's rows built by harts.runtime.mtp in the same execution), and accumulates gradients.

Both executions on the same microbatches compute the same function of the same weights: that
is the core claim, checked by tests/model/test_equivalence.py and `harts verify`. Timings of
layout building, forward and backward are returned per step (with device synchronisation).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from harts.config import execution as execution_config
from harts.config.execution import ExecutionConfig
from harts.model.config import ModelConfig
from harts.model.model import HybridModel, unwrap_model
from harts.model.moe import pooled_load_balancing_loss
from harts.objective.logprobs import compact_logprobs
from harts.objective.losses import (
    LOSSES,
    GRPOConfig,
    LossConfig,
    PolicyLoss,
    PPOConfig,
    check_pooled_balance_coeff,
    grpo_loss,
    ppo_loss,
)
from harts.objective.mtp import MTPLoss, microbatch_mtp_loss, mtp_normalizers, mtp_scaling_factor
from harts.objective.targets import SemanticTargets, semantic_targets_from_step
from harts.ops.gdn.packed import check_gdn_kernel
from harts.runtime.layout import Layout, baseline_layout, compact_layout
from harts.runtime.mtp import MTPLayout, mtp_layouts
from harts.trees.step import Step
from harts.trees.trie import PrefixIndex

DTYPES = {"fp32": None, "bf16": torch.bfloat16}
"""The autocast dtype of each of harts.config.execution.DTYPES."""
assert tuple(DTYPES) == execution_config.DTYPES


@dataclass(kw_only=True)
class StepConfig(ExecutionConfig):
    """How a step is executed: the execution knobs (harts.config.execution), resolved for a device (`step_config`
    makes one from an `ExecutionConfig`), and the loss. The planner and capacity are the plan's, not the step's."""

    execution: str = "compact"
    """"baseline" (each trajectory its own sequence) or "compact" (the microbatch's trie)."""
    dtype: str = "fp32"
    """"fp32" or "bf16" (autocast; the parameters keep their dtype)."""
    attention_backend: str = "sdpa"
    kda_backend: str = "torch"
    replay: bool = True
    """Compact only: False runs the no-replay ablation (state handed over at the fork)."""
    loss: str = "grpo"
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    pooled_balance_coeff: float = 0.0
    """Coefficient of transformers' load-balancing loss of each microbatch (`harts.model.moe.
    pooled_load_balancing_loss`: every MoE layer's router statistics pooled over its tokens; TRL's
    router_aux_loss_coef), added to the MoE loss like the layers' own (÷ the step's microbatches). 0: none. Needs
    softmax routing whose layers report their statistics (`check_pooled_balance`)."""

    def __post_init__(self) -> None:
        self.check()

    def check(self, prefix: str = "") -> None:
        super().check(prefix)
        for name in ("execution", "dtype", "attention_backend", "kda_backend"):
            if getattr(self, name) is None:
                raise ValueError(f"{prefix}{name}: a StepConfig takes resolved knobs (ExecutionConfig.resolved), "
                                 "got None")
        if self.recompute_blocks == execution_config.AUTO:
            raise ValueError(f"{prefix}recompute_blocks: a StepConfig takes a number of blocks, got "
                             f"{execution_config.AUTO!r} (harts.engine.Engine.build searches it)")
        if self.loss not in LOSSES:
            raise ValueError(f"{prefix}loss must be one of {LOSSES}, got {self.loss!r}")
        check_pooled_balance_coeff(self.pooled_balance_coeff, f"{prefix}pooled_balance_coeff")


def check_pooled_balance(model_config: ModelConfig, config: StepConfig | LossConfig, caller: str, *, mtp: bool = False,
                         name: str = "pooled_balance_coeff") -> None:
    """ValueError naming `caller` and the knob `name` (a command's key or flag) when `config.pooled_balance_coeff` > 0
    asks for a loss the model cannot give: transformers' loss is the softmax one, over MoE layers that report their
    statistics (`moe.balance_statistics` or `aux_loss_coeff` > 0), of a decoder without MTP layers (`mtp`: they run
    in this step; `runs_mtp`). The commands call it before building the model, the steps before any forward."""
    if config.pooled_balance_coeff == 0:
        return
    moe = model_config.moe
    where = f"{caller}: {name} {config.pooled_balance_coeff} on model {model_config.name!r}"
    if model_config.num_layers == model_config.num_dense_layers:
        raise ValueError(f"{where}: the model has no MoE layer")
    if moe.score_function != "softmax":
        raise ValueError(f"{where}: transformers' load-balancing loss is the softmax one; the model routes with "
                         f"{moe.score_function} scores")
    if not (moe.balance_statistics or moe.aux_loss_coeff > 0):
        raise ValueError(f"{where}: its MoE layers do not report their load-balancing statistics (set "
                         "moe.balance_statistics)")
    if mtp:
        raise ValueError(f"{where}: its MTP layers run in this step and transformers' loss pools the decoder's "
                         "layers only (set mtp_loss_scaling_factor 0)")


def check_baseline_gdn_kernel(model_config: ModelConfig, config: ExecutionConfig, device: str, *,
                              name: str = "gdn_kernel", where: str = "") -> None:
    """ValueError in one line (starting with `where`), naming the knob `name`, when `config` (resolved for
    `device`) runs the baseline of a Gated DeltaNet model on fla's GDN kernel where the installed fla refuses its
    backward (harts.ops.gdn.packed.check_gdn_kernel; nothing for a KDA model, the compact execution, the torch
    backend or another device than CUDA). The commands call it between loading the model config and building the
    model; the model checks its layout again before its first block runs (`HybridModel.run_blocks`)."""
    if model_config.linear_kind == "gdn" and config.execution == "baseline":
        check_gdn_kernel(config.gdn_kernel, config.kda_backend, device, name=name, where=where)


def step_config(knobs: ExecutionConfig, device: str, *, loss_config: LossConfig | None = None,
                **fields) -> StepConfig:
    """The StepConfig of an execution config on `device` (its defaults resolved) with the loss of `loss_config`
    (every field of it; default: `fields`' or GRPO's defaults) and `fields` (e.g. `execution`, `replay`, `loss`)
    replacing the config's."""
    given = {**knobs.knobs(), **{k: v for k, v in fields.items() if k in execution_config.FIELDS}}
    resolved = ExecutionConfig(**given).resolved(device)
    extra = {k: v for k, v in fields.items() if k not in execution_config.FIELDS}
    if loss_config is not None:
        extra.update({"loss" if f.name == "name" else f.name: getattr(loss_config, f.name)
                      for f in dataclasses.fields(loss_config)})
    return StepConfig(**resolved.knobs(), **extra)


def pooled_balance_record(result) -> dict:
    """The pooled load-balancing loss (without its coefficient) of a step result's record (a StepResult or a
    harts.parallel.step.ParallelStepResult): nothing when the step did not add it."""
    return {} if result.pooled_balance_loss is None else {"pooled_balance_loss": result.pooled_balance_loss}


def runs_mtp(model_config: ModelConfig, knobs: ExecutionConfig) -> bool:
    """Whether a step of `knobs` runs the model's MTP layers (their loss's factor is > 0): `run_step`'s rule, which the
    commands ask before building the model."""
    return model_config.mtp is not None and mtp_scaling_factor(model_config, knobs.mtp_loss_scaling_factor) > 0


def microbatch_extent(layout: Layout) -> tuple[int, int, int]:
    """What a microbatch's kept activations scale with: its rows, its KDA rows (the compact execution's replay
    rows added) and its MLA's key/value rows (the compact execution's ancestor KV)."""
    return layout.num_rows, layout.num_kda_rows, layout.groups.num_kv_rows


def scaled_recompute_blocks(recompute_blocks: int, num_blocks: int, extent: tuple[int, ...],
                            extents: list[tuple[int, ...]]) -> int:
    """Blocks to recompute (the first ones, of `num_blocks`) in a microbatch of `extent` (`microbatch_extent`)
    among the step's `extents`, each of which fits with `recompute_blocks` recomputed. The kept blocks grow by
    the largest factor f for which some microbatch of the step is at least f times this one in every extent, at
    most to all blocks: the activations kept then stay within that microbatch's (kept activations are per row,
    per KDA row and per key/value row, about alike from block to block). The step's largest microbatch
    recomputes `recompute_blocks`."""
    kept = num_blocks - min(recompute_blocks, num_blocks)
    scaled = max(min(kept * big // max(small, 1) for small, big in zip(extent, other)) for other in extents)
    return num_blocks - min(num_blocks, scaled)


def recompute_blocks_by_rows(recompute_blocks: int, num_blocks: int, layouts: list[Layout]) -> list[int]:
    """`scaled_recompute_blocks` of each of a step's microbatch layouts among all of them."""
    extents = [microbatch_extent(layout) for layout in layouts]
    return [scaled_recompute_blocks(recompute_blocks, num_blocks, extent, extents) for extent in extents]




@dataclass
class StepResult:
    loss: float
    policy_loss: float
    moe_loss: float
    clip_fraction: float
    """Fraction of masked tokens whose clipped surrogate term is active (mean over microbatches)."""
    num_rows: int
    num_semantic_tokens: int
    seconds: dict[str, float]
    """layout, forward, backward (summed over microbatches)."""
    layout_info: list[dict]
    tokens_per_expert: list[torch.Tensor]
    """Per MoE layer, q-weighted routed assignments summed over microbatches (bias update counts); the MTP
    layers' after the decoder's."""
    logprobs: torch.Tensor | None = None
    """fp32 [S] λ in the step's batch order (when collected)."""
    mtp_loss: float | None = None
    """The MTP loss (part of `loss`), None when no MTP layer ran."""
    mtp_depth_losses: list[float] | None = None
    """Each MTP depth's cross-entropy term before the factor / D (summed over microbatches)."""
    num_mtp_rows: list[int] | None = None
    """Rows each MTP depth ran (summed over microbatches)."""
    num_mtp_semantic_tokens: list[int] | None = None
    """Semantic positions of each MTP depth: Σ over trajectories of max(length - k, 0)."""
    pooled_balance_loss: float | None = None
    """With `pooled_balance_coeff`: the mean over microbatches of each one's transformers' load-balancing loss,
    without the coefficient (times it, it is part of `moe_loss`)."""

    def mtp_record(self) -> dict:
        """The MTP figures of a result record: nothing when no MTP layer ran (the record is today's)."""
        if self.mtp_loss is None:
            return {}
        return {"mtp_loss": self.mtp_loss, "mtp_depth_losses": self.mtp_depth_losses, "mtp_rows": self.num_mtp_rows,
                "mtp_semantic_tokens": self.num_mtp_semantic_tokens}


@dataclass
class MicrobatchMTP:
    """What a microbatch's MTP loss needs beside its layout (`run_step` makes one when the MTP loss is on)."""

    layouts: list[MTPLayout]
    """Its depths' rows (harts.runtime.mtp), on the device; fewer than the model's depths when its trajectories
    are short."""
    normalizers: list[float]
    """The step's N_k, one per MTP layer of the model (`mtp_normalizers`)."""
    scaling_factor: float


def semantic_index(step: Step, members: np.ndarray) -> np.ndarray:
    """int64 [S_mb]: the step's semantic positions of `members`, concatenated in member order."""
    return np.concatenate([np.arange(step.offsets[k], step.offsets[k + 1]) for k in members])


def build_layout(step: Step, members: np.ndarray, model: HybridModel, config: StepConfig,
                 index: PrefixIndex | None, *, attention_splits: list[np.ndarray] | None = None) -> Layout:
    """The layout of `config.execution` for these members; `attention_splits` (baseline only, one
    array per member) splits each member's MLA queries there (`baseline_layout`)."""
    kda = unwrap_model(model).config.linear_attention
    if config.execution == "compact":
        assert attention_splits is None, "attention splits belong to the baseline layout"
        layout = compact_layout(
            step, index, members, conv_size=kda.conv_size, chunk_size=kda.chunk_size, replay=config.replay,
            attention_backend=config.attention_backend, kda_backend=config.kda_backend, gdn_kernel=config.gdn_kernel,
        )
    else:
        layout = baseline_layout(
            step, members, conv_size=kda.conv_size, chunk_size=kda.chunk_size,
            attention_backend=config.attention_backend, kda_backend=config.kda_backend, gdn_kernel=config.gdn_kernel,
            attention_splits=attention_splits,
        )
    layout.keep_kda_intermediates = config.keep_kda_intermediates
    layout.kda_calls = config.kda_calls
    return layout


def build_mtp_layouts(step: Step, members: np.ndarray, model: HybridModel, config: StepConfig,
                      index: PrefixIndex | None) -> list[MTPLayout]:
    """The MTP depths' layouts of `config.execution` for these members (harts.runtime.mtp; the model has MTP
    layers)."""
    model_config = unwrap_model(model).config
    linear = model_config.linear_attention
    layouts = mtp_layouts(
        step, members, model_config.mtp.num_layers, execution=config.execution, index=index,
        conv_size=linear.conv_size, chunk_size=linear.chunk_size, replay=config.replay,
        attention_backend=config.attention_backend, kda_backend=config.kda_backend, gdn_kernel=config.gdn_kernel,
    )
    for mtp in layouts:
        mtp.layout.kda_calls = config.kda_calls
    return layouts


def autocast_context(device: torch.device, config: StepConfig):
    dtype = DTYPES[config.dtype]
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def microbatch_logprobs(
    model: HybridModel, layout: Layout, targets_S: torch.Tensor, config: StepConfig, device: torch.device, *,
    temperature: float = 1.0, return_entropy: bool = False, recompute_blocks: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, list]:
    """(λ, entropy or None, MoE loss, MoE aux) of one microbatch: the model over the layout's rows,
    then the compact LM head at `temperature` for the targets `targets_S` of its semantic positions
    (`layout.semantic_rows` order). `recompute_blocks` overrides the config's (`recompute_by_rows`)."""
    return _microbatch_outputs(model, layout, targets_S, config, device, temperature=temperature,
                               return_entropy=return_entropy, recompute_blocks=recompute_blocks)[:4]


def _microbatch_outputs(
    model: HybridModel, layout: Layout, targets_S: torch.Tensor, config: StepConfig, device: torch.device, *,
    temperature: float = 1.0, return_entropy: bool = False, recompute_blocks: int | None = None,
    mtp_layouts: list[MTPLayout] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, list, list[torch.Tensor], torch.Tensor]:
    """`microbatch_logprobs`' outputs, then the MTP depths' final hidden states (with `mtp_layouts`; MoE aux of
    their blocks included) and the LM-head weight, both in the training dtype."""
    mtp = {"mtp_layouts": mtp_layouts} if mtp_layouts else {}
    with autocast_context(device, config):
        outputs = model(
            layout.input_ids, layout, recompute=config.recompute,
            recompute_blocks=config.recompute_blocks if recompute_blocks is None else recompute_blocks,
            keep_attention=config.keep_attention, **mtp,
        )
    hidden, auxes = outputs[:2]
    mtp_hidden = outputs[2] if mtp else []
    weight = unwrap_model(model).lm_head.weight
    if DTYPES[config.dtype] is not None:
        # The LM head in the training dtype like every other matmul (log-probs stay fp32).
        hidden, weight = hidden.to(DTYPES[config.dtype]), weight.to(DTYPES[config.dtype])
        mtp_hidden = [h.to(DTYPES[config.dtype]) for h in mtp_hidden]
    out = compact_logprobs(
        hidden, weight, layout.semantic_rows, targets_S, chunk_rows=config.logprob_chunk_rows,
        temperature=temperature, return_entropy=return_entropy, grad_precision=config.logprob_grad_precision,
    )
    logprobs, entropy = out if return_entropy else (out, None)
    moe = sum((aux.loss for aux in auxes), hidden.new_zeros((), dtype=torch.float32))
    return logprobs, entropy, moe, auxes, mtp_hidden, weight


def policy_loss_of(
    logprobs_S: torch.Tensor, config: StepConfig, *, advantages_S: torch.Tensor, loss_mask_S: torch.Tensor,
    old_logprobs_S: torch.Tensor | None, ref_logprobs_S: torch.Tensor | None, trajectory_index_S: torch.Tensor,
    normalizer: float, entropy_S: torch.Tensor | None = None, entropy_normalizer: float | None = None,
) -> PolicyLoss:
    """`config.loss` (GRPO with `config.grpo`, or PPO with `config.ppo`, which has no KL term and
    ignores `ref_logprobs_S`) of the log-probs λ (and entropies, for an entropy bonus); all tensors [S],
    one order."""
    common = dict(
        advantages_S=advantages_S, loss_mask_S=loss_mask_S, old_logprobs_S=old_logprobs_S,
        trajectory_index_S=trajectory_index_S, normalizer=normalizer, entropy_S=entropy_S,
        entropy_normalizer=entropy_normalizer,
    )
    if config.loss == "grpo":
        return grpo_loss(logprobs_S, config=config.grpo, ref_logprobs_S=ref_logprobs_S, **common)
    return ppo_loss(logprobs_S, config=config.ppo, **common)


def microbatch_loss(
    model: HybridModel, layout: Layout, targets: SemanticTargets, sem_index: np.ndarray, config: StepConfig,
    normalizer: float, device: torch.device, *, recompute_blocks: int | None = None, mtp: MicrobatchMTP | None = None,
) -> tuple[PolicyLoss, torch.Tensor, torch.Tensor, list, MTPLoss | None]:
    """(policy loss, MoE loss, λ of the microbatch's positions, MoE aux, MTP loss) of one microbatch
    (`recompute_blocks`: `microbatch_logprobs`); the MTP loss is None without `mtp`, and the MoE loss and aux then
    include the MTP blocks'."""
    sem = torch.from_numpy(sem_index).to(device)
    loss_config = loss_config_of(config)
    logprobs, entropy, moe, auxes, mtp_hidden, weight = _microbatch_outputs(
        model, layout, torch.from_numpy(targets.targets).to(device)[sem], config, device,
        recompute_blocks=recompute_blocks, return_entropy=loss_config.entropy_coef > 0,
        mtp_layouts=None if mtp is None else mtp.layouts,
    )
    mtp_loss = None
    if mtp is not None:
        mtp_loss = microbatch_mtp_loss(
            mtp_hidden, mtp.layouts, weight, targets, sem_index, mtp.normalizers, mtp.scaling_factor,
            chunk_rows=config.logprob_chunk_rows, grad_precision=config.logprob_grad_precision,
        )

    def pick(array):
        return None if array is None else torch.from_numpy(array).to(device)[sem]

    policy = policy_loss_of(
        logprobs, config, advantages_S=pick(targets.advantages), loss_mask_S=pick(targets.loss_mask),
        old_logprobs_S=pick(targets.old_logprobs), ref_logprobs_S=pick(targets.ref_logprobs),
        trajectory_index_S=pick(targets.trajectory_index), normalizer=normalizer, entropy_S=entropy,
        entropy_normalizer=aggregation_normalizer(loss_config.aggregation_of_entropy, targets),
    )
    return policy, moe, logprobs, auxes, mtp_loss


def loss_config_of(config: StepConfig) -> GRPOConfig | PPOConfig:
    """The loss hyper-parameters of `config.loss`."""
    return config.grpo if config.loss == "grpo" else config.ppo


def aggregation_normalizer(aggregation: str, targets: SemanticTargets) -> float:
    """The step-level N of `aggregation` (harts.objective.losses): masked tokens for token-mean, 1 for
    token-sum, trajectories with a masked token for the sequence modes."""
    if aggregation == "token-mean":
        return float(targets.loss_mask.sum())
    if aggregation == "token-sum":
        return 1.0
    return float(len(np.unique(targets.trajectory_index[targets.loss_mask])))


def step_normalizer(targets: SemanticTargets, config: StepConfig) -> float:
    """The step-level N of the policy loss's aggregation (`aggregation_normalizer`)."""
    return aggregation_normalizer(loss_config_of(config).aggregation, targets)


def check_partition(step: Step, microbatches: list[np.ndarray], caller: str) -> None:
    """ValueError (naming `caller`) unless every trajectory of `step` is in exactly one microbatch."""
    covered = np.sort(np.concatenate([np.asarray(m, dtype=np.int64) for m in microbatches]))
    if not np.array_equal(covered, np.arange(step.num_trajectories)):
        raise ValueError(f"{caller}: microbatches must cover every trajectory of the step exactly once")


def run_step(
    model: HybridModel,
    step: Step,
    microbatches: list[np.ndarray],
    config: StepConfig,
    *,
    index: PrefixIndex | None = None,
    backward: bool = True,
    collect_logprobs: bool = False,
    progress: str | None = None,
) -> StepResult:
    """Forward (+ backward, accumulating into .grad) of `step` split into `microbatches`; with
    `progress`, a progress bar of that name over the microbatches (stderr)."""
    device = next(model.parameters()).device
    if config.execution == "compact" and index is None:
        index = PrefixIndex.from_step(step)
    check_partition(step, microbatches, "run_step")
    targets = semantic_targets_from_step(step)
    normalizer = step_normalizer(targets, config)
    num_microbatches = len([m for m in microbatches if len(m)])
    seconds = {"layout": 0.0, "forward": 0.0, "backward": 0.0}
    total_policy = total_moe = total_pooled = 0.0
    rows = 0
    model_config = unwrap_model(model).config
    # runs_mtp says no for a model without MTP layers; mtp_scaling_factor refuses a factor asked of one.
    mtp_factor = mtp_scaling_factor(model_config, config.mtp_loss_scaling_factor)
    num_mtp_layers = 0 if model_config.mtp is None else model_config.mtp.num_layers
    num_mtp = num_mtp_layers if runs_mtp(model_config, config) else 0
    check_pooled_balance(model_config, config, "run_step", mtp=num_mtp > 0)
    mtp_norms = mtp_normalizers(step, targets, num_mtp) if num_mtp else []
    total_mtp, mtp_depth_losses, mtp_rows, mtp_semantic = 0.0, [0.0] * num_mtp, [0] * num_mtp, [0] * num_mtp
    infos, tokens_per_expert, clip_fractions = [], [], []
    logprobs_all = torch.full((step.num_semantic_tokens,), float("nan")) if collect_logprobs else None
    microbatches = [np.asarray(members, dtype=np.int64) for members in microbatches]
    layouts, recompute_blocks = None, [None] * len(microbatches)
    if config.recompute_by_rows:
        # Each microbatch's recomputation depends on the step's others: every layout first (layout time).
        start = time.perf_counter()
        layouts = [build_layout(step, m, model, config, index) if len(m) else None for m in microbatches]
        present = [j for j, layout in enumerate(layouts) if layout is not None]
        scaled = recompute_blocks_by_rows(config.recompute_blocks, len(model.blocks), [layouts[j] for j in present])
        for j, blocks in zip(present, scaled):
            recompute_blocks[j] = blocks
        seconds["layout"] += time.perf_counter() - start
    for j, members in enumerate(tqdm(microbatches, desc=progress, disable=progress is None, file=sys.stderr,
                                     leave=False)):
        if not len(members):
            continue
        start = time.perf_counter()
        layout = (build_layout(step, members, model, config, index) if layouts is None else layouts[j]).to(device)
        sem_index = semantic_index(step, members)
        mtp = None
        if num_mtp:
            mtp = MicrobatchMTP(layouts=[m.to(device) for m in build_mtp_layouts(step, members, model, config, index)],
                                normalizers=mtp_norms, scaling_factor=mtp_factor)
        _sync(device)
        seconds["layout"] += time.perf_counter() - start

        start = time.perf_counter()
        with torch.set_grad_enabled(backward):
            policy, moe, logprobs, auxes, mtp_loss = microbatch_loss(
                model, layout, targets, sem_index, config, normalizer, device, recompute_blocks=recompute_blocks[j],
                mtp=mtp)
            pooled = pooled_load_balancing_loss(auxes) if config.pooled_balance_coeff > 0 else None
            if pooled is not None:
                moe = moe + config.pooled_balance_coeff * pooled
            loss = policy.loss + moe / num_microbatches
            if mtp_loss is not None:
                loss = loss + mtp_loss.loss
        _sync(device)
        seconds["forward"] += time.perf_counter() - start
        if backward:
            start = time.perf_counter()
            loss.backward()
            _sync(device)
            seconds["backward"] += time.perf_counter() - start

        total_policy += float(policy.loss.detach())
        clip_fractions.append(float(policy.clip_fraction))
        total_moe += float(moe.detach()) / num_microbatches
        if pooled is not None:
            total_pooled += float(pooled.detach()) / num_microbatches
        rows += layout.num_rows
        counts = [aux.tokens_per_expert_E.detach() for aux in auxes]
        # An MTP layer that did not run (MTP loss off, or a depth none of the microbatch's trajectories reaches)
        # routed nothing: its counts are zeros, so there is one entry per MoE layer of the model.
        counts += [torch.zeros(model_config.moe.num_experts, device=device)
                   for _ in range(num_mtp_layers - (0 if mtp is None else len(mtp.layouts)))]
        if mtp is None:
            infos.append(layout.info)
        else:
            total_mtp += float(mtp_loss.loss.detach())
            mtp_depth_losses = [a + b for a, b in zip(mtp_depth_losses, mtp_loss.depth_losses)]
            depth_rows = [m.num_rows for m in mtp.layouts] + [0] * (num_mtp - len(mtp.layouts))
            depth_semantic = [len(m.semantic_positions) for m in mtp.layouts] + [0] * (num_mtp - len(mtp.layouts))
            mtp_rows = [a + b for a, b in zip(mtp_rows, depth_rows)]
            mtp_semantic = [a + b for a, b in zip(mtp_semantic, depth_semantic)]
            depth_pairs = [m.layout.info["attention_pairs"] for m in mtp.layouts] + [0] * (num_mtp - len(mtp.layouts))
            infos.append({**layout.info, "mtp_rows": depth_rows, "mtp_semantic_tokens": depth_semantic,
                          "mtp_attention_pairs": depth_pairs})
        tokens_per_expert = counts if not tokens_per_expert else [a + b for a, b in zip(tokens_per_expert, counts)]
        if collect_logprobs:
            logprobs_all[torch.from_numpy(sem_index)] = logprobs.detach().float().cpu()
    mtp_fields = {}
    if num_mtp:
        mtp_fields = dict(mtp_loss=total_mtp, mtp_depth_losses=mtp_depth_losses, num_mtp_rows=mtp_rows,
                          num_mtp_semantic_tokens=mtp_semantic)
    return StepResult(
        loss=total_policy + total_moe + total_mtp, policy_loss=total_policy, moe_loss=total_moe,
        clip_fraction=float(np.mean(clip_fractions)), num_rows=rows,
        num_semantic_tokens=step.num_semantic_tokens, seconds=seconds, layout_info=infos,
        tokens_per_expert=tokens_per_expert, logprobs=logprobs_all, **mtp_fields,
        pooled_balance_loss=total_pooled if config.pooled_balance_coeff > 0 else None,
    )
