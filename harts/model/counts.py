"""Parameter counts of a model config: in total, and active per token.

`parameter_counts(config) -> ParameterCounts` counts the parameters of `HybridModel(config)` built on the meta device
(nothing allocated): `total` is every parameter once (a tied head is the embedding); `active` what one token's
forward multiplies, every parameter but the routed experts it is not sent to, (E − k)/E of each MoE layer's routed
experts, with the embedding table counted whole, as model cards count "activated parameters" (Ling-3.0-tiny's card:
7.9B total, 1.3B activated). A model with MTP layers counts them in `total` and `active`, and apart in `mtp` and
`mtp_active` (`without_mtp`: the counts of the decoder alone, as model cards give them: Ling-3.0-tiny's 7.9B leaves
its MTP layer out). Buffers (the MoE expert bias) are not parameters. Tested against a closed-form count of the shapes
(tests/model/test_counts.py) and against Ling-3.0-tiny's published figures.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harts.model.config import ModelConfig
from harts.model.model import HybridModel
from harts.model.moe import MoE


@dataclass(frozen=True)
class ParameterCounts:
    total: int
    """Every parameter once."""
    active: int
    """The parameters one token uses: `total` less the routed experts it is not routed to."""
    embedding: int
    """The input embedding table."""
    head: int
    """The LM head (0 when tied to the embedding)."""
    mtp: int = 0
    """The MTP layers' parameters (in `total`; 0 without MTP layers)."""
    mtp_active: int = 0
    """What one token uses of the MTP layers (in `active`): every depth's layer, less the routed experts it skips."""

    @property
    def active_non_embedding(self) -> int:
        """`active` without the embedding table and the LM head."""
        return self.active - self.embedding - self.head

    @property
    def without_mtp(self) -> ParameterCounts:
        """The counts of the decoder alone (the MTP layers left out)."""
        return ParameterCounts(total=self.total - self.mtp, active=self.active - self.mtp_active,
                               embedding=self.embedding, head=self.head)


def parameter_counts(config: ModelConfig) -> ParameterCounts:
    """The parameter counts of a model of `config` (module docstring)."""
    with torch.device("meta"):
        model = HybridModel(config)
    total, unused = _count(model)
    mtp, mtp_unused = (0, 0) if model.mtp is None else _count(model.mtp)
    head = 0 if config.tie_embeddings else model.lm_head.weight.numel()
    return ParameterCounts(total=total, active=total - unused, embedding=model.embed.weight.numel(), head=head,
                           mtp=mtp, mtp_active=mtp - mtp_unused)


def _count(module: torch.nn.Module) -> tuple[int, int]:
    """(parameters of `module`, those of its routed experts that one row is not routed to)."""
    unused = 0
    for layer in module.modules():
        if isinstance(layer, MoE):
            moe = layer.config
            routed = layer.gate_up_proj.numel() + layer.down_proj.numel()
            unused += routed // moe.num_experts * (moe.num_experts - moe.top_k)
    return sum(p.numel() for p in module.parameters()), unused
