"""transformers' pooled load-balancing loss of a microbatch on the ranks of a parallel step (`PooledBalance`).

`harts.model.moe.pooled_load_balancing_loss` pools every MoE layer's router statistics of a forward (q-weighted
softmax mass Σ_l mass_l and top-k counts Σ_l counts_l) before its product E/(L·S)² · Σ_e counts_e·mass_e, so it is
not a sum of per-layer terms. Under a parallel configuration each rank's `ParallelMoE` reports the statistics of
the microbatch's rows (summed over the sequence-parallel shards, whole on every tensor-parallel rank, its own
microbatch's on a data- or expert-parallel replica); what is left is the pipeline, whose stages hold different
layers. For given counts the loss is linear in the mass: with the counts of ALL layers, the stages' terms
E/(L·S)² · Σ_e counts_e·mass_stage,e add up to the loss, value and gradient. So each stage sends the running sums
(counts, detached mass) forward with its output rows, the last stage forms the loss's value and its own term, and
the step's counts go back with the input gradient, where each earlier stage forms its term in its backward. Every
term is × coefficient ÷ K, as `harts.objective.step.run_step` adds it.

Reference (tests/parallel/test_pooled_balance.py): `run_step`'s pooled loss and gradients in one process, under
every shipped configuration. Legend: E experts, L MoE layers of the model, S the microbatch's tokens (Σ q).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harts.model.moe import MoEAux, pooled_balance_loss_of, pooled_balance_statistics
from harts.parallel.pipeline import PipelineLink


@dataclass(eq=False)
class MicrobatchBalance:
    """One microbatch's pooled statistics on this stage."""

    mass_E: torch.Tensor | None
    """Σ mass of this stage's MoE layers (with grad); None on a stage without one."""
    counts_E: torch.Tensor | None
    """fp64 Σ counts of all the model's MoE layers: the last stage's from the forward, an earlier one's from the
    backward."""
    value: torch.Tensor | None
    """fp64 the loss without coefficient (detached; the last stage's)."""
    num_tokens: float
    scale: float
    """coefficient ÷ K."""
    num_layers: int

    def share(self, counts_E: torch.Tensor) -> torch.Tensor:
        """This stage's term of the loss, × coefficient ÷ K, for the counts of all layers."""
        if self.mass_E is None:
            return counts_E.new_zeros((), dtype=torch.float32)
        return self.scale * pooled_balance_loss_of(self.mass_E, counts_E, self.num_tokens, self.num_layers)


class PooledBalance:
    """The pooled loss of a parallel step's microbatches, carried through a stage's pipeline link."""

    def __init__(self, scale: float, num_experts: int, num_layers: int, link: PipelineLink,
                 device: torch.device) -> None:
        self.scale, self.num_experts, self.num_layers = scale, num_experts, num_layers
        self.link, self.device = link, device

    @property
    def on(self) -> bool:
        return self.scale > 0

    def forward(self, auxes: list[MoEAux], num_tokens: float, *, first: bool, last: bool) -> MicrobatchBalance:
        """After a microbatch's stage forward (and its output's send): the running sums in, this stage's added,
        sent on (or, on the last stage, the loss's value)."""
        sums = (torch.zeros(2, self.num_experts, dtype=torch.float64, device=self.device) if first
                else self.link.receive_forward((2, self.num_experts), torch.float64, self.device))
        mass_E = None
        if auxes:
            mass_E, counts_E = pooled_balance_statistics(auxes)
            sums = sums + torch.stack([counts_E.detach(), mass_E.detach()]).double()
        balance = MicrobatchBalance(mass_E=mass_E, counts_E=None, value=None, num_tokens=num_tokens,
                                    scale=self.scale, num_layers=self.num_layers)
        if last:
            balance.counts_E = sums[0]
            balance.value = pooled_balance_loss_of(sums[1], sums[0], num_tokens, self.num_layers)
        else:
            self.link.send_forward(sums)
        return balance

    def receive_counts(self) -> torch.Tensor:
        """The step's counts of a microbatch from the next stage (after its input gradient)."""
        return self.link.receive_backward((self.num_experts,), torch.float64, self.device)

    def send_counts(self, counts_E: torch.Tensor) -> None:
        """The counts on to the previous stage (after the input gradient)."""
        self.link.send_backward(counts_E)
