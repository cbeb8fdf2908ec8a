"""Multi-token prediction (MTP): DeepSeek-V3's sequential MTP modules, as megatron-core and Ling-3.0 build them.

Depth k = 1 .. D (`MTPConfig.num_layers`) turns the row at position t into
    h^k_t = final_layernorm(block(eh_proj([enorm(embed(x_{t+k})); hnorm(h^{k-1}_t)])))
where h^0 is the main model's final hidden state after its final norm (megatron-core hands its MTP block the decoder's
output, final layernorm included) and h^{k-1} for k >= 2 the previous depth's output after its own final_layernorm;
the embedding comes first in the concatenation (megatron-core's `_concat_embeddings`, sglang's Bailing NextN). `embed`
and the LM head are the main model's (shared): h^k_t predicts x_{t+k+1}. The block is one decoder `Block` (the model
builds it, numbered after its decoder's blocks, so with the MoE MLP) with the token mixer `MTPConfig.layer_kind`: full
attention (MLA) for Ling-3.0, whose Bailing-hybrid NextN layer is an MLA layer with the sparse MLP (sglang's
bailing_moe_nextn).

Which rows a depth has and which row of the previous depth each one reads is its layout's (harts.runtime.mtp): per
trajectory, the positions t < L - k; under a tree, one row per trie node of depth >= k. The MTP loss is
harts.objective.mtp's; tests/objective/test_mtp.py checks both executions against each other and a dense
per-sequence reference.

Parameter names (checkpoint mapping): `mtp.layers.{i}.{enorm, hnorm, eh_proj, final_layernorm}.weight` and the block
under `mtp.layers.{i}.block`, which Ling-3.0 (and DeepSeek-V3) checkpoints store as
`model.layers.{num_hidden_layers + i}.{enorm, hnorm, eh_proj, final_layernorm}.weight` and that index's decoder-layer
names; their `embed_tokens` and `shared_head.head` copies, where present, are the main model's.
Legend: R_k rows of depth k, D hidden size.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from harts.model.config import ModelConfig
from harts.model.layers import RMSNorm
from harts.model.moe import MoEAux
from harts.runtime.layout import Layout


class MTPLayer(nn.Module):
    """One MTP depth: the two input norms, the projection of their concatenation, a block (harts.model.model's
    `Block`, built by the model) and the output norm."""

    def __init__(self, config: ModelConfig, block: nn.Module) -> None:
        super().__init__()
        dim, eps = config.hidden_size, config.norm_eps
        self.enorm = RMSNorm(dim, eps)
        self.hnorm = RMSNorm(dim, eps)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        self.final_layernorm = RMSNorm(dim, eps)

    def combine(self, embedded_RD: torch.Tensor, previous_RD: torch.Tensor) -> torch.Tensor:
        """The block's input: eh_proj([enorm(embedding); hnorm(previous hidden state)])."""
        return self.eh_proj(torch.cat([self.enorm(embedded_RD), self.hnorm(previous_RD)], dim=-1))

    def forward(self, embedded_RD: torch.Tensor, previous_RD: torch.Tensor,
                layout: Layout) -> tuple[torch.Tensor, MoEAux | None]:
        """h^k of the rows from the embeddings of their tokens x_{t+k} and the previous depth's h^{k-1}_t."""
        x_RD, aux = self.block(self.combine(embedded_RD, previous_RD), layout)
        return self.final_layernorm(x_RD), aux


class MultiTokenPrediction(nn.Module):
    """The D MTP layers of a model (`HybridModel.mtp`), one per block of `blocks` (depth 1 first)."""

    def __init__(self, config: ModelConfig, blocks: list[nn.Module]) -> None:
        super().__init__()
        assert config.mtp is not None and len(blocks) == config.mtp.num_layers
        self.layers = nn.ModuleList(MTPLayer(config, block) for block in blocks)

    def forward(self, embed: nn.Embedding, hidden_RD: torch.Tensor, layouts: list, *,
                recompute: bool = False) -> tuple[list[torch.Tensor], list[MoEAux]]:
        """The final hidden states of depths 1 .. len(layouts) (harts.runtime.mtp's `MTPLayout`s, in depth order;
        a microbatch whose trajectories are all short has fewer depths than layers) from the main model's
        `hidden_RD`, and the MoE aux of their blocks. With `recompute`, each depth's layer is recomputed in
        backward (megatron-core's MTP recomputation)."""
        assert len(layouts) <= len(self.layers), (len(layouts), len(self.layers))
        outputs: list[torch.Tensor] = []
        auxes: list[MoEAux] = []
        for layer, mtp_layout in zip(self.layers, layouts):
            previous_RD = hidden_RD.index_select(0, mtp_layout.hidden_rows)
            embedded_RD = embed(mtp_layout.layout.input_ids)
            if recompute and torch.is_grad_enabled():
                hidden_RD, aux = checkpoint(layer, embedded_RD, previous_RD, mtp_layout.layout, use_reentrant=False)
            else:
                hidden_RD, aux = layer(embedded_RD, previous_RD, mtp_layout.layout)
            outputs.append(hidden_RD)
            if aux is not None:
                auxes.append(aux)
        return outputs, auxes
