"""The hybrid linear-attention/attention MoE language model (plain PyTorch, no parallelism inside): KDA + MLA
(Ling-3, Kimi-Linear) or Gated DeltaNet + gated GQA (Qwen3-Next, Qwen3.5; harts.model.gdn).

`HybridModel(config)` maps input ids of R rows and a `Layout` to final hidden states [R, D] and
the MoE auxiliary outputs of every MoE layer. The LM head is applied by the objective
(`harts.objective.compact_logprobs`), which never materialises all logits at once. With
`recompute=True` every block is checkpointed (non-reentrant): its activations are dropped in
forward and recomputed in backward with the same layout, so the KDA call plan, replay ranges and
state handoffs are replayed exactly (DESIGN §4, activation recomputation). `recompute_blocks=N`
checkpoints only blocks 0 … N − 1 (Megatron's block method): the others keep their activations,
trading memory for the recomputation's time; the values are the same either way. With
`keep_attention=True` the recomputed MLA blocks keep their attention kernels' outputs (output and
log-sum-exp, about 4-6 KB a row for the paper's shape) from the forward and the recomputation skips those
kernels, the costliest part of a block per byte kept (torchtitan's op-level selective recomputation,
through torch's `create_selective_checkpoint_contexts`; backends `KEEPABLE_BACKENDS`; `flash4` and `triton_tree`
through their own keeper, harts.ops.attention.keep, which puts no dispatch mode over the block). The kernels are
deterministic, so the values are the same again (tests/model/test_recompute.py, tests/ops/attention/test_flash4.py,
tests/ops/attention/test_tree_triton.py).
With a layout's `keep_kda_intermediates` the recomputed blocks run inside harts.ops.kda.keep's context, where fla's
KDA calls keep their intermediates for the backward instead of computing them again.
With `config.mtp` the model also owns the multi-token-prediction layers (`self.mtp`, harts.model.mtp), which its
forward runs after the final norm when given their layouts.
Parallelism (TP/SP/PP/EP/DP) is applied from outside by harts.parallel.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from functools import cache, partial

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from harts.model.config import ModelConfig
from harts.model.gdn import GatedAttentionLayer, GDNLayer
from harts.model.layers import KDALayer, MLALayer, RMSNorm, SwiGLU
from harts.model.moe import MoE, MoEAux
from harts.model.mtp import MultiTokenPrediction
from harts.ops.attention.groups import attention_kernel_ops
from harts.ops.attention.keep import keeper_contexts, keeper_scope
from harts.ops.kda.keep import keeping_kda_intermediates
from harts.runtime.layout import Layout


KEEPER_BACKENDS = ("flash4", "triton_tree", "flash4_tree")
"""The attention backends kept through harts.ops.attention.keep's keeper instead of torch's selective policy."""
ATTENTION_KINDS = ("mla", "gqa")
"""The layer kinds that run the layout's attention (whose kernels a recomputation may keep)."""


class Block(nn.Module):
    """Pre-norm residual block: token mixer (KDA, GDN, MLA or gated GQA), then MLP (dense or MoE)."""

    def __init__(self, config: ModelConfig, index: int, *, kind: str | None = None) -> None:
        super().__init__()
        self.kind = config.layer_kind(index) if kind is None else kind
        centered = config.norm_zero_centered
        self.mixer_norm = RMSNorm(config.hidden_size, config.norm_eps, zero_centered=centered)
        if self.kind == "kda":
            self.mixer = KDALayer(config.hidden_size, config.kda, config.norm_eps)
        elif self.kind == "gdn":
            self.mixer = GDNLayer(config.hidden_size, config.gdn, config.norm_eps)
        elif self.kind == "gqa":
            self.mixer = GatedAttentionLayer(config.hidden_size, config.gated_attention, config.norm_eps,
                                             zero_centered=centered)
        else:
            self.mixer = MLALayer(config.hidden_size, config.mla, config.norm_eps)
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps, zero_centered=centered)
        self.is_moe = index >= config.num_dense_layers
        self.mlp = MoE(config.moe_for_layer(index)) if self.is_moe else SwiGLU(config.hidden_size,
                                                                                config.dense_hidden_size)

    def forward(self, x_RD: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, MoEAux | None]:
        x_RD = x_RD + self.mixer(self.mixer_norm(x_RD), layout)
        h_RD = self.mlp_norm(x_RD)
        if self.is_moe:
            y_RD, aux = self.mlp(h_RD, multiplicity_N=layout.multiplicity)
        else:
            y_RD, aux = self.mlp(h_RD), None
        return x_RD + y_RD, aux


@cache
def keep_attention_context(backend: str | None = None):
    """The `context_fn` of a checkpoint whose recomputation keeps the attention kernels' outputs and runs every
    other op again: for `KEEPER_BACKENDS`, their own keeper (harts.ops.attention.keep: no dispatch mode over the
    block's other ops); for the other backends, torch's selective checkpointing of `attention_kernel_ops`."""
    if backend in KEEPER_BACKENDS:
        return keeper_contexts
    kept = attention_kernel_ops()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in kept else CheckpointPolicy.PREFER_RECOMPUTE

    return partial(create_selective_checkpoint_contexts, policy)


def _keeping_kda_intermediates(block: nn.Module):
    """`block` run inside `keeping_kda_intermediates()`: the checkpoint runs this function in the forward and
    again in the recomputation, each time with the context entered on the thread that runs it."""

    def run(x_RD: torch.Tensor, layout: Layout):
        with keeping_kda_intermediates():
            return block(x_RD, layout)

    return run


class HybridModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.final_norm = RMSNorm(config.hidden_size, config.norm_eps, zero_centered=config.norm_zero_centered)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.mtp = None
        if config.mtp is not None:
            # Numbered after the decoder's blocks, as the checkpoints store them (so they are MoE blocks).
            self.mtp = MultiTokenPrediction(config, [
                Block(config, config.num_layers + i, kind=config.mtp.layer_kind) for i in range(config.mtp.num_layers)
            ])

    def set_experts_backend(self, backend: str) -> None:
        """Run every MoE layer's experts with `backend` from now on (`EXPERT_BACKENDS`; they share the
        parameters, so a benchmark can compare them on the same weights)."""
        self.config = replace(self.config, moe=replace(self.config.moe, experts_backend=backend))
        for module in self.modules():
            if isinstance(module, MoE):  # each keeps its own layer's SwiGLU limits
                module.config = replace(module.config, experts_backend=backend)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialisation in place on the model's device: normal(0, init_std) for matrices,
        layer-specific for KDA. Deterministic for a seed and a device type (the CPU and CUDA
        generators draw different streams). The MTP layers come last from the same generator, so the
        decoder's weights are those of the model without them."""
        device = next(self.parameters()).device
        generator = torch.Generator(device=device).manual_seed(seed)
        # The decoder's parameters and modules, then the MTP layers' (the module "mtp").
        parts = [([(n, p) for n, p in self.named_parameters() if not n.startswith("mtp.")],
                  [m for n, m in self.named_modules() if n != "mtp" and not n.startswith("mtp.")])]
        if self.mtp is not None:
            parts.append((list(self.mtp.named_parameters()), list(self.mtp.modules())))
        for parameters, modules in parts:
            for name, parameter in parameters:
                if parameter.dim() >= 2:
                    parameter.normal_(0.0, self.config.init_std, generator=generator)
                elif name.endswith(".bias"):
                    parameter.zero_()
                elif name.endswith("norm.weight") or name.endswith(".weight"):
                    parameter.fill_(1.0)
            for module in modules:
                if isinstance(module, KDALayer):
                    module.reset_kda_parameters(generator)
                if isinstance(module, GDNLayer):
                    module.reset_gdn_parameters(generator)
                if isinstance(module, RMSNorm) and module.zero_centered:
                    module.weight.zero_()
                if isinstance(module, MoE) and module.expert_bias is not None:
                    module.expert_bias.zero_()

    def forward(
        self, input_ids_R: torch.Tensor, layout: Layout, *, recompute: bool = False,
        recompute_blocks: int | None = None, keep_attention: bool = False, mtp_layouts: list | None = None,
    ) -> tuple[torch.Tensor, list[MoEAux]] | tuple[torch.Tensor, list[MoEAux], list[torch.Tensor]]:
        """(final hidden states [R, D], MoE aux of every MoE block); with `mtp_layouts` (harts.runtime.mtp, one per
        MTP depth run) also the MTP layers' final hidden states, one [R_k, D] per depth, their MoE aux appended."""
        x_RD, auxes = self.run_blocks(
            self.embed(input_ids_R), layout, range(len(self.blocks)), recompute=recompute,
            recompute_blocks=recompute_blocks, keep_attention=keep_attention,
        )
        hidden_RD = self.final_norm(x_RD)
        if mtp_layouts is None:
            return hidden_RD, auxes
        if self.mtp is None:
            raise ValueError(f"model {self.config.name!r}: MTP layouts given, but the model has no MTP layers")
        mtp_hidden, mtp_auxes = self.mtp(self.embed, hidden_RD, mtp_layouts, recompute=recompute)
        return hidden_RD, auxes + mtp_auxes, mtp_hidden

    def run_blocks(
        self, x_RD: torch.Tensor, layout: Layout, indices: Iterable[int], *, recompute: bool = False,
        recompute_blocks: int | None = None, keep_attention: bool = False,
    ) -> tuple[torch.Tensor, list[MoEAux]]:
        """Blocks `indices` in order over the rows (with `recompute`, each recomputed in backward, or only
        those numbered below `recompute_blocks`; with `keep_attention`, the recomputed MLA blocks keep their
        attention outputs); the MoE aux of every MoE block. A pipeline stage runs its own range of them."""
        if self.config.linear_kind == "gdn":
            # Before any block: fla refuses its GDN kernel's backward only after the forward ran, and an error
            # inside a checkpointed block would leave the checkpoint's hooks installed (harts.ops.kda.compact).
            layout.check_gdn_kernel()
        auxes: list[MoEAux] = []
        for index in indices:
            block = self.blocks[index]
            recomputed = recompute and (recompute_blocks is None or index < recompute_blocks)
            if recomputed and torch.is_grad_enabled():
                kept = ({"context_fn": keep_attention_context(layout.attention_backend)}
                        if keep_attention and block.kind in ATTENTION_KINDS else {})
                run = _keeping_kda_intermediates(block) if layout.keep_kda_intermediates else block
                with keeper_scope():
                    x_RD, aux = checkpoint(run, x_RD, layout, use_reentrant=False, **kept)
            else:
                x_RD, aux = block(x_RD, layout)
            if aux is not None:
                auxes.append(aux)
        return x_RD, auxes


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside wrappers that keep it as `.module` (DistributedDataParallel) or `._orig_mod`
    (torch.compile), else `model` itself (FSDP2's `fully_shard` keeps the class). Read the config and the LM head
    from it, but call the wrapper for the forward (DDP prepares its gradient reduction there)."""
    while not isinstance(model, HybridModel):
        wrapped = getattr(model, "module", None)
        if wrapped is None:
            wrapped = getattr(model, "_orig_mod", None)
        if not isinstance(wrapped, nn.Module):
            return model
        model = wrapped
    return model
