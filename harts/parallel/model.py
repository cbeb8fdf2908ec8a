"""`parallelize(model, groups)`: the plain `HybridModel` split in place for one rank, and its stage forward.

Applied from outside, torchtitan-style: the model's classes and parameter names are unchanged
(parameters are cut, hooks bracket tensor-parallel regions, MoE layers become `ParallelMoE`),
and `ParallelModel.stage_forward` replaces `HybridModel.forward` (same embedding -> blocks ->
final norm, restricted to this rank's pipeline stage):
- PP: blocks are split in contiguous stages (numpy.array_split of the block indices); the
  first stage keeps the embedding, the last the final norm and LM head; other stages' modules
  are dropped (placeholders keep the block indices, so names stay the plain model's).
- TP/SP: tensor.py and expert.py. Under SP the residual stream between layers is this rank's
  shard of P = ⌈R/tp⌉ rows: the embedding output is padded to tp·P rows and scattered, the
  final norm's output gathered (backward: each rank keeps its rows' gradient, since the LM head
  and the loss are replicated) and trimmed to the R rows of the layout. The MoE needs explicit
  multiplicities to weight its shard (`prepare_layout`: the baseline's q = None becomes all
  ones, which gives the same losses).
- Gradient synchronisation (`reduce_gradients`, once per step): parameters with partial
  gradients over TP are all-reduced over TP, then routed-expert parameters over the expert-
  data-parallel group and every other parameter over the DP group, by sums (the loss normaliser
  is step-level, so the sum over replicas is the single-process gradient).
`shard_specs` records how each cut parameter maps into the full one (`full_gradients` in
harts.parallel.verify reassembles the whole model's gradients from them).
Tested against the plain model in one process: with every degree 1 bitwise equal to `run_step`
(tests/parallel/test_step.py), and every shipped configuration within the fidelity thresholds
(tests/parallel/test_verify.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import nn

from harts.model.gdn import GatedAttentionLayer, GDNLayer
from harts.model.layers import KDALayer, MLALayer
from harts.model.model import HybridModel
from harts.model.moe import MoE, MoEAux
from harts.parallel.comm import all_reduce_, gather_rows, pad_rows, padded_rows, scatter_rows
from harts.parallel.expert import ROUTED_EXPERT_PARAMETERS, MoEParallelism, parallelize_moe
from harts.parallel.gdn import shard_gated_attention, shard_gdn
from harts.parallel.groups import ParallelGroups
from harts.parallel.tensor import (
    SEQUENCE_PARALLEL_PARTIAL,
    Sharder,
    ShardSpec,
    install_region_hooks,
    shard_kda,
    shard_mla,
    shard_swiglu,
)
from harts.runtime.layout import Layout


class _AbsentBlock(nn.Module):
    """Placeholder for a block held by another pipeline stage."""


def stage_recompute_limit(blocks: list[int], recompute_blocks: int | None) -> int | None:
    """The model block index below which a stage holding `blocks` recomputes: its first N blocks, as Megatron's
    block method counts per pipeline stage (None: every block)."""
    if recompute_blocks is None or not blocks:
        return None
    return blocks[0] + recompute_blocks


def stage_blocks(num_layers: int, pp: int, pp_rank: int) -> list[int]:
    return [int(i) for i in np.array_split(np.arange(num_layers), pp)[pp_rank]]


@dataclass(eq=False)
class ParallelModel:
    model: HybridModel
    """The plain model, cut to this rank's share."""
    groups: ParallelGroups
    blocks: list[int]
    """Indices of this stage's blocks."""
    shard_specs: dict[str, ShardSpec] = field(default_factory=dict)
    tp_partial: set[str] = field(default_factory=set)
    """Whole parameters whose gradient on a rank is a part of the full one (summed over TP)."""
    num_moe_layers: int = 0
    moe_layer_offset: int = 0
    """Index (among all MoE layers of the model) of this stage's first MoE layer."""

    @property
    def sequence_parallel(self) -> bool:
        return self.groups.config.sequence_parallel

    @property
    def tp(self) -> int:
        return self.groups.config.tp

    def named_parameters(self):
        return self.model.named_parameters()

    def rows_on_rank(self, layout: Layout) -> int:
        """Rows of the residual stream on this rank: R, or the SP shard P."""
        if self.sequence_parallel:
            return padded_rows(layout.num_rows, self.tp)
        return layout.num_rows

    def prepare_layout(self, layout: Layout) -> Layout:
        """Under SP the MoE needs q to find its shard's weights: all-ones q for the baseline (same losses)."""
        if self.sequence_parallel and layout.multiplicity is None:
            return replace(layout, multiplicity=torch.ones(layout.num_rows, device=layout.input_ids.device))
        return layout

    def stage_forward(
        self, layout: Layout, x_in: torch.Tensor | None, *, recompute: bool = False,
        recompute_blocks: int | None = None, keep_attention: bool = False,
    ) -> tuple[torch.Tensor, list[MoEAux]]:
        """This stage's part of `HybridModel.forward`: hidden rows out (final hidden [R, D] on the last stage);
        with `recompute_blocks`, the stage's first N blocks recomputed (`keep_attention`: their attention kept)."""
        model, groups = self.model, self.groups
        if groups.is_first_stage:
            x = model.embed(layout.input_ids)
            if self.sequence_parallel:
                x = scatter_rows(pad_rows(x, self.tp * self.rows_on_rank(layout)), groups.tp)
        else:
            x = x_in
        x, auxes = model.run_blocks(x, layout, self.blocks, recompute=recompute,
                                    recompute_blocks=stage_recompute_limit(self.blocks, recompute_blocks),
                                    keep_attention=keep_attention)
        if groups.is_last_stage:
            x = model.final_norm(x)
            if self.sequence_parallel:
                x = gather_rows(x, groups.tp, grad="split")[: layout.num_rows]
        return x, auxes

    def is_routed_expert(self, name: str) -> bool:
        module, _, attribute = name.rpartition(".")
        return attribute in ROUTED_EXPERT_PARAMETERS and isinstance(self.model.get_submodule(module), MoE)

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Sum partial gradients over TP, then over DP (dense) and expert-DP (routed experts)."""
        groups = self.groups
        buckets: dict[str, list[torch.Tensor]] = {"tp": [], "dp": [], "edp": []}
        for name, parameter in self.model.named_parameters():
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            if name in self.tp_partial:
                buckets["tp"].append(parameter.grad)
            buckets["edp" if self.is_routed_expert(name) else "dp"].append(parameter.grad)
        for key in ("tp", "dp", "edp"):
            group = getattr(groups, key)
            if not buckets[key] or torch.distributed.get_world_size(group) == 1:
                continue
            grads = buckets[key]
            flat = all_reduce_(torch.cat([g.reshape(-1) for g in grads]), group)
            for g, piece in zip(grads, torch.split(flat, [g.numel() for g in grads])):
                g.copy_(piece.view_as(g))


def parallelize(model: HybridModel, groups: ParallelGroups) -> ParallelModel:
    """Cut `model` (initialised identically on every rank) in place to this rank's share."""
    config = groups.config
    config.check_model(model.config)
    layout = groups.layout
    blocks = stage_blocks(model.config.num_layers, config.pp, layout.pp_rank)
    moe_layers = [i for i, block in enumerate(model.blocks) if block.is_moe]
    sharder = Sharder(model)
    partial: list[str] = []
    sp = config.sequence_parallel
    if config.tp > 1 or config.ep > 1:
        moe_parallelism = MoEParallelism(tp_group=groups.tp, ep_group=groups.ep, sequence_parallel=sp)
    for index in blocks:
        block = model.blocks[index]
        if config.tp > 1:
            mixer = block.mixer
            if isinstance(mixer, KDALayer):
                partial += shard_kda(sharder, mixer, layout.tp_rank, config.tp)
            elif isinstance(mixer, GDNLayer):
                partial += shard_gdn(sharder, mixer, layout.tp_rank, config.tp)
            elif isinstance(mixer, GatedAttentionLayer):
                partial += shard_gated_attention(sharder, mixer, layout.tp_rank, config.tp)
            else:
                assert isinstance(mixer, MLALayer)
                partial += shard_mla(sharder, mixer, layout.tp_rank, config.tp)
            install_region_hooks(mixer, groups.tp, sequence_parallel=sp, whole_paths=True)
            if not block.is_moe:
                partial += shard_swiglu(sharder, block.mlp, layout.tp_rank, config.tp)
                install_region_hooks(block.mlp, groups.tp, sequence_parallel=sp, whole_paths=False)
        if block.is_moe and (config.tp > 1 or config.ep > 1):
            partial += parallelize_moe(sharder, block.mlp, moe_parallelism, tp_rank=layout.tp_rank,
                                       ep_rank=layout.ep_rank)
    for index in range(model.config.num_layers):
        if index not in blocks:
            model.blocks[index] = _AbsentBlock()
    if not groups.is_first_stage:
        model.embed = None
    if not groups.is_last_stage:
        model.final_norm = None
        model.lm_head = None
    if sp:
        partial += [name for name, _ in model.named_parameters() if name.endswith(SEQUENCE_PARALLEL_PARTIAL)]
    mine = [i for i in moe_layers if i in blocks]
    return ParallelModel(
        model=model, groups=groups, blocks=blocks, shard_specs=sharder.specs, tp_partial=set(partial),
        num_moe_layers=len(mine), moe_layer_offset=moe_layers.index(mine[0]) if mine else 0,
    )
