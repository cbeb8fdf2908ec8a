"""MoE under tensor, sequence and expert parallelism (`ParallelMoE`, a subclass of `MoE`).

`parallelize_moe(sharder, moe, ...)` turns a plain `MoE` in place into a `ParallelMoE` (the
class is swapped, as FSDP2's `fully_shard` does, so parameter names stay those of the plain
model) holding this rank's share of the experts. The router, routing, dispatch plan, expert
MLPs and combine are the plain layer's methods; what changes is where rows and experts live:

- Sequence parallelism: the layer sees this rank's shard of P rows (zero-padded at the end).
  Routing is per row, so it runs on the shard; the q-weighted sums the losses are made of
  (Σ q·lse², Σ q·P_e, Σ q·f_e, Σ q) are summed over the TP group before the losses are
  formed (`reduce_from_group`: every rank then holds the full loss and back-propagates its own
  rows' share), so the z-loss and load-balancing loss equal the unsharded ones. Padding rows
  get q = 0: they count nowhere. The expert-bias counts stay per shard (the step sums them).
  The load-balancing statistics (`MoEAux.balance_mass_E`, `.balance_counts_E`) are reported whenever
  the plain layer reports them (`aux_loss_coeff` > 0 or `balance_statistics`: transformers' pooled
  loss reads them, harts.parallel.balance), likewise of the group's rows under SP; without SP they
  are this rank's rows' (replicated rows under TP, its own microbatch under DP/EP) and are summed
  over no group.
- ep = 1, tp > 1 (experts split by columns): the routed and shared experts need every row, so
  the rows and the routing are gathered (SP) or entered with `copy_to_group` (replicated rows),
  each rank computes its columns' partial output and the partial sums are reduce-scattered (SP)
  or all-reduced. The routing is computed before the region (on replicated or sharded rows),
  so the router's gradient is full (replicated rows) or partial over the shard (SP).
- ep > 1: rank j of the EP group owns experts [j·E/ep, (j+1)·E/ep), whole. Each rank routes its
  own rows (its microbatch under DP, its shard under SP), sorts the N·k routed rows by expert
  (the plain `dispatch`: each compact row once per selected expert), exchanges the per-expert
  counts, sends the rows to the owners (`all_to_all_rows`), runs its experts on what it
  received (grouped by expert), sends the outputs back by the reverse exchange and combines
  them locally with the plain `combine`. The shared expert stays whole on every rank.
  Expert gradients are complete on their owner (every row routed to an expert reaches it);
  they are summed only over the expert-data-parallel group. Routing, group-limited too, runs on
  each row's whole router logits before the exchange, so expert groups need not match EP ranks.

Reference (tests/parallel/test_expert.py, test_step.py): outputs, MoE losses, counts and
gradients against the plain `MoE` on the same rows in one process.
Legend: N rows (of this rank), D hidden, E experts, k top_k, R routed rows, F expert hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from harts.model.moe import (
    MoE,
    MoEAux,
    Routing,
    _swiglu,
    aux_loss_scores,
    balance_loss_of,
    balance_parts,
    expert_assignment_counts,
    router_z_loss,
)
from harts.parallel.comm import (
    all_reduce_,
    all_to_all_counts,
    all_to_all_rows,
    copy_to_group,
    gather_rows,
    gather_rows_no_grad,
    group_size,
    pad_rows,
    reduce_from_group,
    reduce_scatter_rows,
)
from harts.parallel.config import LEAN_UNDER_EP
from harts.parallel.tensor import Sharder, head_index, halves_index

ROUTED_EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True, eq=False)
class MoEParallelism:
    tp_group: dist.ProcessGroup
    ep_group: dist.ProcessGroup
    sequence_parallel: bool

    @property
    def tp(self) -> int:
        return group_size(self.tp_group)

    @property
    def ep(self) -> int:
        return group_size(self.ep_group)


def parallelize_moe(
    sharder: Sharder, moe: MoE, parallelism: MoEParallelism, *, tp_rank: int, ep_rank: int
) -> list[str]:
    """Shard `moe` in place; returns the names of its whole parameters with partial gradients over TP."""
    c = moe.config
    shared = moe.shared_gate_up_proj is not None
    if parallelism.ep > 1 and c.experts_backend == "lean":
        raise ValueError(LEAN_UNDER_EP.format(ep=parallelism.ep))
    if parallelism.ep > 1:
        per_rank = c.num_experts // parallelism.ep
        experts = torch.arange(ep_rank * per_rank, (ep_rank + 1) * per_rank)
        for attribute in ROUTED_EXPERT_PARAMETERS:
            sharder.cut(moe, attribute, 0, experts)
    elif parallelism.tp > 1:
        tp = parallelism.tp
        sharder.cut(moe, "gate_up_proj", 2, halves_index(c.expert_hidden_size, tp_rank, tp))
        sharder.cut(moe, "down_proj", 1, head_index(c.expert_hidden_size, 1, tp_rank, tp))
        if shared:
            sharder.cut(moe, "shared_gate_up_proj", 1, halves_index(c.shared_expert_hidden_size, tp_rank, tp))
            sharder.cut(moe, "shared_down_proj", 0, head_index(c.shared_expert_hidden_size, 1, tp_rank, tp))
    moe.__class__ = ParallelMoE
    moe.parallelism = parallelism
    partial = []
    gate = moe.shared_gate_weight
    if parallelism.sequence_parallel:
        partial.append(moe.router_weight)
        if shared and parallelism.ep > 1:
            partial += [moe.shared_gate_up_proj, moe.shared_down_proj] + ([gate] if gate is not None else [])
    if gate is not None and parallelism.ep == 1 and parallelism.tp > 1:
        # The whole gate scales each rank's partial sum of the sharded shared expert: its gradient is partial too.
        partial.append(gate)
    return [sharder.name(p) for p in partial]


class ParallelMoE(MoE):
    """A `MoE` whose rows and experts are spread over process groups (module docstring)."""

    parallelism: MoEParallelism

    def _global_sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallelism.sequence_parallel:
            return reduce_from_group(x, self.parallelism.tp_group)
        return x

    def _local_multiplicity(self, multiplicity_R: torch.Tensor | None, num_rows: int) -> torch.Tensor | None:
        """q of this rank's rows: under SP the shard of q padded with zeros (q is never None there)."""
        p = self.parallelism
        if not p.sequence_parallel:
            return multiplicity_R
        assert multiplicity_R is not None, "sequence parallelism needs explicit multiplicities (see ParallelModel)"
        rank = dist.get_rank(p.tp_group)
        padded = pad_rows(multiplicity_R, num_rows * p.tp)
        return padded[rank * num_rows : (rank + 1) * num_rows]

    def _losses(self, logits_NE: torch.Tensor, q_N: torch.Tensor | None) -> dict:
        """The MoEAux loss fields of these rows (under SP, of the whole sequence-parallel group's rows)."""
        c = self.config
        statistics = c.aux_loss_coeff > 0 or c.balance_statistics
        if not self.parallelism.sequence_parallel:
            q = q_N.to(logits_NE.dtype) if q_N is not None else logits_NE.new_ones(logits_NE.shape[0])
            z_loss = router_z_loss(logits_NE, q_N, c.z_loss_coeff) if c.z_loss_coeff > 0 else None
            total = q.sum().detach()
            mass_E = assignments_E = None
            if statistics:
                scores, selected = aux_loss_scores(logits_NE, top_k=c.top_k, score_function=c.score_function)
                mass_E, assignments_E = balance_parts(scores, selected, q_N)
        else:
            q = q_N.to(logits_NE.dtype)
            total = all_reduce_(q.sum().detach().clone(), self.parallelism.tp_group)
            z_loss = mass_E = assignments_E = None
            if c.z_loss_coeff > 0:
                numerator = self._global_sum((q * torch.logsumexp(logits_NE, dim=-1).square()).sum())
                z_loss = numerator / total * c.z_loss_coeff
            if statistics:
                scores, selected = aux_loss_scores(logits_NE, top_k=c.top_k, score_function=c.score_function)
                mass_E, assignments_E = balance_parts(scores, selected, q)
                mass_E = self._global_sum(mass_E)
                assignments_E = all_reduce_(assignments_E, self.parallelism.tp_group)
        balance = None
        if c.aux_loss_coeff > 0:
            balance = balance_loss_of(mass_E, assignments_E, total, top_k=c.top_k, coeff=c.aux_loss_coeff)
        return dict(z_loss=z_loss, load_balancing_loss=balance, num_tokens=total, balance_mass_E=mass_E,
                    balance_counts_E=assignments_E)

    def _tensor_parallel_experts(self, x_ND: torch.Tensor, routing: Routing) -> torch.Tensor:
        p = self.parallelism
        if p.sequence_parallel:
            x_full = gather_rows(x_ND, p.tp_group, grad="reduce_scatter")
            routing = Routing(
                experts_NK=gather_rows_no_grad(routing.experts_NK, p.tp_group),
                probs_NK=gather_rows(routing.probs_NK, p.tp_group, grad="reduce_scatter"),
            )
        else:
            x_full = copy_to_group(x_ND, p.tp_group)
            routing = Routing(experts_NK=routing.experts_NK, probs_NK=copy_to_group(routing.probs_NK, p.tp_group))
        shared = self.shared_expert(x_full) if self.shared_gate_up_proj is not None else None
        out = self.routed_experts(x_full, routing, shared)
        if p.sequence_parallel:
            return reduce_scatter_rows(out, p.tp_group)
        return reduce_from_group(out, p.tp_group)

    def _local_experts(self, x_RD: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """This rank's experts on rows grouped by local expert."""
        if self._backend(x_RD) != "loop":
            counts = torch.tensor(tokens_per_expert, device=x_RD.device)
            return self.grouped_experts(x_RD, counts)
        pieces = torch.split(x_RD, tokens_per_expert)
        return torch.cat([
            _swiglu(rows, self.gate_up_proj[e], self.down_proj[e], self.config.swiglu_limit)
            for e, rows in enumerate(pieces)
        ])

    def _expert_parallel_experts(self, x_ND: torch.Tensor, routing: Routing) -> torch.Tensor:
        group = self.parallelism.ep_group
        ep = self.parallelism.ep
        if self.config.experts_backend == "lean":  # set after `parallelize_moe` checked it
            raise ValueError(LEAN_UNDER_EP.format(ep=ep))
        x_RD, plan = self.dispatch(x_ND, routing)
        send_E = plan.tokens_per_expert_E.view(ep, -1)
        receive_E = all_to_all_counts(send_E, group).cpu().numpy()
        input_splits = send_E.sum(dim=1).tolist()
        output_splits = receive_E.sum(axis=1).tolist()
        received = all_to_all_rows(x_RD, output_splits, input_splits, group)
        # Received rows come grouped by source rank, then by local expert; run them grouped by expert.
        starts = np.concatenate([[0], np.cumsum(receive_E.reshape(-1))[:-1]]).reshape(receive_E.shape)
        by_expert = np.concatenate([
            np.arange(starts[src, e], starts[src, e] + receive_E[src, e])
            for e in range(receive_E.shape[1]) for src in range(ep)
        ]).astype(np.int64)
        order = torch.from_numpy(by_expert).to(x_ND.device)
        y_sorted = self._local_experts(received.index_select(0, order), receive_E.sum(axis=0).tolist())
        y_received = torch.empty_like(y_sorted).index_copy(0, order, y_sorted)
        y_RD = all_to_all_rows(y_received, input_splits, output_splits, group)
        out = self.combine(y_RD, routing, plan, x_ND.shape[0])
        if self.shared_gate_up_proj is not None:
            out = out + self.shared_expert(x_ND).to(out.dtype)
        return out

    def forward(
        self, x_ND: torch.Tensor, multiplicity_N: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, MoEAux]:
        c = self.config
        q_N = self._local_multiplicity(multiplicity_N, x_ND.shape[0])
        logits = self.router_logits(x_ND)
        routing = self.route(logits)
        if self.parallelism.ep > 1:
            out = self._expert_parallel_experts(x_ND, routing)
        else:
            out = self._tensor_parallel_experts(x_ND, routing)
        counts = expert_assignment_counts(routing.experts_NK, q_N, c.num_experts)
        return out.to(x_ND.dtype), MoEAux(tokens_per_expert_E=counts, **self._losses(logits, q_N))
