"""Mixture-of-experts MLP on rows, with auxiliary losses weighted by multiplicity (DESIGN §4).

`MoE(config)` maps rows x_ND to (y_ND, MoEAux). In compact execution the N rows are the C
compact rows: routing, dispatch and expert compute happen once per compact token. The optional
`multiplicity_N` (q_c, Σ q = S) restores the semantics of the S positions in the auxiliary
losses and counts, so that with q = multiplicities of a compact map they equal the same
quantities computed on the expanded rows (row c repeated q_c times), and with q ≡ 1 they equal
megatron-core 0.16's:
- router z-loss  β_z · Σ q_c·lse(logits_c)² / Σ q_c                          (`z_loss_func`)
- load-balancing loss  β_aux · E/(k·S²) · Σ_e (Σ_c q_c·P_ce)(Σ_c q_c·f_ce)
  (`switch_load_balancing_loss_func`), with P the scores over all experts (softmax, or
  sigmoid normalised over all experts) and f the top-k of P without expert bias — megatron's
  `compute_routing_scores_for_aux_loss`;
- transformers' load-balancing loss (`load_balancing_loss_func` of Qwen3-Next and Qwen3.5-MoE, 5.25), every MoE
  layer's statistics pooled into one mean over L layers × S tokens: E/(L·S)² · Σ_e (Σ_l Σ_c q_c·f_lce)(Σ_l Σ_c
  q_c·P_lce) with P the softmax over all experts and f its top-k (`pooled_load_balancing_loss`, from the layers'
  `balance_mass_E` / `balance_counts_E`, which `balance_statistics` reports without the per-layer loss; linear in
  the mass for given counts, `pooled_balance_loss_of`, so pipeline stages holding different layers add up to it);
- expert-bias counts  Σ_c q_c·[expert e selected for c]  over the routing actually used, and
  the update b ← b + rate·sign(mean(counts) − counts) (`get_updated_expert_bias`).

Routing (megatron's `topk_routing_with_score_function`): router logits
in fp32 (fp64 for fp64 rows, the tests' exact mode; under bf16 autocast the product runs in bf16, as
megatron-core's default `moe_router_dtype` leaves it), the rows kept in their own dtype for the
backward; softmax scores: top-k of the logits then
softmax over the k (or, with `softmax_before_topk`, softmax over all experts then top-k,
unnormalised); sigmoid scores: top-k of sigmoid(logits) + expert bias (the bias picks the
experts only), combine weights = the k unbiased sigmoid scores normalised to sum 1 (when k > 1);
then × `topk_scaling_factor`. Group-limited routing (`num_groups` > 1, sigmoid scores: DeepSeek-V3's
`noaux_tc`, BailingHybrid's n_group / topk_group; megatron's `group_limited_topk`): the experts form
`num_groups` groups of consecutive experts, a group scores the sum of its two best selection scores
(sigmoid + bias), and each row picks its k experts among those of its `topk_groups` best groups. The
load-balancing loss's top-k stays over all experts (megatron's `compute_routing_scores_for_aux_loss`). Every
top-k is `harts.ops.routing.select_experts` (one Triton kernel on CUDA for the groups and the experts, where
torch's ops took about ten kernels): best first, ties to the lower index, where `torch.topk` leaves ties' order
unspecified.

Experts are SwiGLU MLPs, y = (silu(x·W_gate) ⊙ (x·W_up))·W_down, stored stacked: `gate_up_proj`
[E, D, 2F] (gate first) and `down_proj` [E, F, D]; an optional shared expert is added to every
row, with `shared_expert_gate` scaled per row by sigmoid(x·w_g) (Qwen3-Next / Qwen3.5's gated shared expert,
w_g `shared_gate_weight` [1, D]). The activation is `harts.ops.swiglu.swiglu` (one Triton kernel each way on CUDA),
clipped after the SiLU to `swiglu_limit` (routed experts) and `shared_swiglu_limit` (the shared expert) when set, on
every path (BailingHybrid's per-layer limits: `ModelConfig.moe_for_layer`).
Expert outputs are combined in the router's precision (`harts.ops.combine`: one Triton kernel each way on
CUDA). Two expert paths compute the same function:
- "loop" (the reference): for each expert, gather its rows, run its MLP, scatter-add back;
- "grouped": `dispatch` sorts the N·k (row, expert) pairs by expert once (tokens per expert
  give the group offsets), `grouped_experts` runs two `torch._grouped_mm` calls, `combine`
  puts the outputs back in (row, slot) order and takes each row's weighted sum of its k outputs
  (`harts.ops.combine.combine` over the [N, k, D] view). Both moves are gathers by a permutation (the sort
  order and its inverse) whose backward is the gather by the other one, and the k copies of a
  row meet in a sum over a [N, k, D] view: no scatter-add (atomics) forward or backward, and
  no weighted [N·k, D] temporary. An expert-parallel wrapper replaces `dispatch`/`combine`.
  `torch._grouped_mm(mat_a [R, K], mat_b [G, K, N], offs=int32 cumulative ends) -> [R, N]`
  exists in torch 2.11 (DESIGN §4 measures it on an H200) and 2.13; its meta checks ask for
  bf16 operands with 16-byte-aligned strides (D and F multiples of 8), so on CUDA run the layer
  in bf16; torch 2.13 also runs it on CPU in fp32 (the CPU test compares it with "loop").
- "lean": the grouped path's function in one autograd node (`_LeanExperts`) that keeps for the
  backward only the rows and the gate/up projection (the composed path also keeps the dispatched
  rows, the activation and the permuted expert outputs: at T = 65,536, D = 2,048, k = 8, F = 512
  that is 4.8 GB less per layer) and gathers or recomputes the rest; forward bit for bit the
  grouped path's, backward the same function rounded differently (the combine weight moves onto
  the activation: `harts.ops.swiglu.weighted_swiglu_backward`). Under expert parallelism, whose
  exchange sits between dispatch and combine, the experts run as "grouped".
"auto" picks "grouped" on CUDA and "loop" elsewhere. The layer holds no parallelism.

Legend: N rows, D hidden size, E experts, k = top_k, F expert hidden size, R = N·k routed rows.
Tests: routing and losses against megatron-core on the same logits, compact q-weighted vs
expanded rows (forward and gradients), grouped and lean vs loop (forward and gradients).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from harts.config.execution import EXPERT_BACKENDS
from harts.ops.attention.query_groups import inverse_permutation, permute_rows
from harts.ops.combine import combine as weighted_sum
from harts.ops.combine import gather_combine
from harts.ops.routing import select_experts
from harts.ops.swiglu import swiglu, weighted_swiglu_backward

SCORE_FUNCTIONS = ("softmax", "sigmoid")


def resolve_experts_backend(backend: str, cuda: bool) -> str:
    """The experts backend a layer runs: "auto" is "grouped" on CUDA and "loop" elsewhere."""
    if backend == "auto":
        return "grouped" if cuda else "loop"
    return backend


@dataclass(kw_only=True)
class MoEConfig:
    """One MoE MLP layer."""

    hidden_size: int
    """D, the model width."""
    num_experts: int
    """E, routed experts."""
    top_k: int
    """k, experts per row."""
    expert_hidden_size: int
    """F, the intermediate size of each routed expert."""
    score_function: str = "softmax"
    """"softmax" or "sigmoid"."""
    softmax_before_topk: bool = False
    """Softmax over all experts before top-k (megatron's pre-softmax); needed for softmax with k = 1."""
    topk_scaling_factor: float | None = None
    """Multiplies the combine weights (e.g. 2.5 in DeepSeek-V3-style sigmoid routing)."""
    shared_expert_hidden_size: int = 0
    """Intermediate size of the shared expert applied to every row (0 = none)."""
    shared_expert_gate: bool = False
    """Scale the shared expert's output per row by sigmoid(x·w_g), w_g [1, D] (Qwen3-Next, Qwen3.5)."""
    expert_bias: bool = False
    """Aux-loss-free balancing: a per-expert bias added to sigmoid scores for selection only."""
    bias_update_rate: float = 1e-3
    """Step of the sign update of the expert bias."""
    aux_loss_coeff: float = 0.0
    """Coefficient of the switch-style load-balancing loss (0 = not computed)."""
    z_loss_coeff: float = 0.0
    """Coefficient of the router z-loss (0 = not computed)."""
    balance_statistics: bool = False
    """Report the load-balancing loss's probability mass and counts (`MoEAux.balance_mass_E`, `.balance_counts_E`)
    even when `aux_loss_coeff` is 0: for a pooled reading over layers (`pooled_load_balancing_loss`). The
    expert-parallel layer (harts.parallel.expert) reports them too, of the whole microbatch's rows."""
    experts_backend: str = "auto"
    """"loop", "grouped", "lean" (grouped in one autograd node that keeps less) or "auto" (grouped on CUDA)."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of every weight."""
    num_groups: int = 1
    """Expert groups of group-limited routing (E/num_groups consecutive experts each; needs sigmoid scores and at
    least two experts a group). 1: every expert is a candidate."""
    topk_groups: int = 1
    """The groups a row's experts may come from: its topk_groups best by the sum of their two best selection
    scores (at most num_groups)."""
    swiglu_limit: float | None = None
    """Clip the routed experts' SwiGLU after the activation: min(silu(gate), L) ⊙ clamp(up, −L, L). None: none."""
    shared_swiglu_limit: float | None = None
    """The same for the shared expert."""

    def __post_init__(self) -> None:
        if min(self.hidden_size, self.num_experts, self.top_k, self.expert_hidden_size) < 1:
            raise ValueError(f"MoEConfig: sizes must be >= 1, got {self}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig: top_k {self.top_k} > num_experts {self.num_experts}")
        if self.score_function not in SCORE_FUNCTIONS:
            raise ValueError(
                f"MoEConfig: score_function must be one of {SCORE_FUNCTIONS}, got {self.score_function!r}"
            )
        if self.experts_backend not in EXPERT_BACKENDS:
            raise ValueError(
                f"MoEConfig: experts_backend must be one of {EXPERT_BACKENDS}, got {self.experts_backend!r}"
            )
        if self.shared_expert_gate and not self.shared_expert_hidden_size:
            raise ValueError("MoEConfig: shared_expert_gate needs a shared expert (shared_expert_hidden_size > 0)")
        if self.expert_bias and self.score_function != "sigmoid":
            raise ValueError("MoEConfig: expert_bias needs score_function 'sigmoid' (as in megatron-core)")
        if self.score_function == "softmax" and self.top_k == 1 and not self.softmax_before_topk:
            raise ValueError("MoEConfig: softmax after top-1 has zero gradient; set softmax_before_topk")
        if self.shared_expert_hidden_size < 0 or self.aux_loss_coeff < 0 or self.z_loss_coeff < 0:
            raise ValueError(f"MoEConfig: shared size and loss coefficients must be >= 0, got {self}")
        for name in ("bias_update_rate", "aux_loss_coeff", "z_loss_coeff", "init_std", "topk_scaling_factor"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"MoEConfig: {name} must be a finite number >= 0, got {value!r}")
        for name in ("swiglu_limit", "shared_swiglu_limit"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"MoEConfig: {name} must be a finite number > 0 (or null), got {value!r}")
        groups, chosen = self.num_groups, self.topk_groups
        if min(groups, chosen) < 1 or chosen > groups:
            raise ValueError(f"MoEConfig: need 1 <= topk_groups <= num_groups, got {chosen} and {groups}")
        if groups > 1:
            if self.score_function != "sigmoid":
                raise ValueError("MoEConfig: group-limited routing (num_groups > 1) needs score_function 'sigmoid'")
            if self.num_experts % groups or self.num_experts // groups < 2:
                raise ValueError(f"MoEConfig: num_groups {groups} must divide num_experts {self.num_experts} into "
                                 "groups of at least two experts")
            if self.top_k > chosen * (self.num_experts // groups):
                raise ValueError(f"MoEConfig: top_k {self.top_k} exceeds the experts of topk_groups {chosen} groups")


@dataclass(frozen=True, eq=False)
class Routing:
    """Top-k routing of N rows."""

    experts_NK: torch.Tensor
    """int64 selected experts of each row."""
    probs_NK: torch.Tensor
    """fp32 combine weights (differentiable w.r.t. the router logits)."""


@dataclass(frozen=True, eq=False)
class DispatchPlan:
    """Rows sorted by expert: routed row r is (row token_R[r], slot order_R[r] of the N·k pairs)."""

    order_R: torch.Tensor
    """int64 flat (row·k + slot) indices of the routed pairs, sorted by expert (stable)."""
    inverse_R: torch.Tensor
    """int64 inverse permutation of `order_R`: the routed row of pair (row·k + slot)."""
    token_R: torch.Tensor
    """int64 source row of each routed row."""
    tokens_per_expert_E: torch.Tensor
    """int64 routed rows per expert (unweighted); cumulative sums are the group ends."""


@dataclass(frozen=True, eq=False)
class MoEAux:
    """Auxiliary outputs of one MoE forward (losses already multiplied by their coefficients)."""

    z_loss: torch.Tensor | None
    """Router z-loss (None when its coefficient is 0)."""
    load_balancing_loss: torch.Tensor | None
    """Switch-style load-balancing loss (None when its coefficient is 0)."""
    tokens_per_expert_E: torch.Tensor
    """fp32 q-weighted routed assignments per expert (no grad): the expert-bias update counts."""
    num_tokens: torch.Tensor | None = None
    """Σ q of the rows (no grad): the tokens the losses are means over (`step_share`)."""
    balance_mass_E: torch.Tensor | None = None
    """Σ q·P_e, the load-balancing loss's probability mass per expert (with grad; when that loss is computed)."""
    balance_counts_E: torch.Tensor | None = None
    """Σ q·f_e, its top-k assignment counts per expert (no grad; when that loss is computed)."""

    @property
    def loss(self) -> torch.Tensor:
        """The sum of the enabled losses (a zero tensor when none is)."""
        total = self.tokens_per_expert_E.new_zeros(())
        for term in (self.z_loss, self.load_balancing_loss):
            if term is not None:
                total = total + term
        return total


def topk_routing(
    logits_NE: torch.Tensor,
    *,
    top_k: int,
    score_function: str,
    softmax_before_topk: bool = False,
    topk_scaling_factor: float | None = None,
    expert_bias_E: torch.Tensor | None = None,
    num_groups: int = 1,
    topk_groups: int = 1,
) -> Routing:
    """Selected experts and combine weights from fp32 router logits (module docstring)."""
    if score_function == "softmax":
        if expert_bias_E is not None:
            raise ValueError("topk_routing: expert bias needs the sigmoid score function")
        if softmax_before_topk:
            scores = torch.softmax(logits_NE, dim=-1)
            experts = select_experts(scores, top_k)
            probs = scores.gather(1, experts)
        else:
            experts = select_experts(logits_NE, top_k)
            probs = torch.softmax(logits_NE.gather(1, experts), dim=-1)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits_NE)
        selection = scores if expert_bias_E is None else scores + expert_bias_E
        experts = select_experts(selection, top_k, num_groups, topk_groups)
        probs = scores.gather(1, experts)
        if top_k > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"topk_routing: unknown score function {score_function!r}")
    if topk_scaling_factor:
        probs = probs * topk_scaling_factor
    return Routing(experts_NK=experts, probs_NK=probs)


def _weights(multiplicity_N: torch.Tensor | None, logits_NE: torch.Tensor) -> torch.Tensor:
    """q per row in fp32 at least (fp64 for fp64 logits): under bf16 autocast the logits are bf16, and bf16 weights
    would round the token count and the per-expert counts the losses divide by (exact only up to 256)."""
    dtype = torch.promote_types(logits_NE.dtype, torch.float32)
    if multiplicity_N is None:
        return torch.ones(logits_NE.shape[0], dtype=dtype, device=logits_NE.device)
    return multiplicity_N.to(dtype)


def router_z_loss(logits_NE: torch.Tensor, multiplicity_N: torch.Tensor | None, coeff: float) -> torch.Tensor:
    """coeff · Σ q_c·lse_c² / Σ q_c (megatron's `z_loss_func` when q ≡ 1)."""
    q = _weights(multiplicity_N, logits_NE)
    return (q * torch.logsumexp(logits_NE, dim=-1).square()).sum() / _row_total(q.sum()) * coeff


def aux_loss_scores(
    logits_NE: torch.Tensor, *, top_k: int, score_function: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores_NE, top-k map_NE) for the load-balancing loss: scores over all experts, no bias."""
    if score_function == "softmax":
        scores = torch.softmax(logits_NE, dim=-1)
    else:
        scores = torch.sigmoid(logits_NE)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    top = select_experts(scores, top_k)
    selected = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top, True)
    return scores, selected


def balance_parts(
    scores_NE: torch.Tensor, selected_NE: torch.Tensor, multiplicity_N: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ q·P_e, Σ q·f_e) per expert: the two factors of the load-balancing loss (the counts without grad)."""
    q = _weights(multiplicity_N, scores_NE)
    probability_mass_E = (q[:, None] * scores_NE).sum(dim=0)
    assignments_E = (q[:, None] * selected_NE.to(q.dtype)).sum(dim=0).detach()
    return probability_mass_E, assignments_E


def balance_loss_of(
    probability_mass_E: torch.Tensor, assignments_E: torch.Tensor, num_tokens: torch.Tensor | float, *, top_k: int,
    coeff: float,
) -> torch.Tensor:
    """coeff · E/(k·S²) · Σ_e mass_e·count_e for S = `num_tokens`."""
    total = torch.as_tensor(num_tokens, dtype=probability_mass_E.dtype, device=probability_mass_E.device)
    num_experts = probability_mass_E.shape[0]
    return (probability_mass_E * assignments_E).sum() * (num_experts * coeff / top_k) / _row_total(total * total)


def load_balancing_loss(
    scores_NE: torch.Tensor,
    selected_NE: torch.Tensor,
    multiplicity_N: torch.Tensor | None,
    *,
    top_k: int,
    coeff: float,
) -> torch.Tensor:
    """coeff · E/(k·S²) · Σ_e (Σ q·P_e)(Σ q·f_e), S = Σ q (megatron's switch loss when q ≡ 1)."""
    probability_mass_E, assignments_E = balance_parts(scores_NE, selected_NE, multiplicity_N)
    total = _weights(multiplicity_N, scores_NE).sum()
    return balance_loss_of(probability_mass_E, assignments_E, total, top_k=top_k, coeff=coeff)


def step_share(
    aux: MoEAux, config: MoEConfig, *, step_tokens: float, step_balance_counts_E: torch.Tensor | None
) -> torch.Tensor:
    """This forward's share of the MoE losses of a step whose forwards (microbatches) together hold `step_tokens`
    tokens (Σ q) and `step_balance_counts_E` load-balancing assignments (the sum of their `balance_counts_E`): its
    z-loss numerator over the step's tokens, and its probability mass times the step's counts over the step's
    tokens squared. The shares of a step's forwards add up, value and gradient, to the losses of all their rows in
    one forward (the load-balancing loss is not a sum over rows: each share needs the step's counts)."""
    total = aux.tokens_per_expert_E.new_zeros(())
    if aux.z_loss is not None:
        if aux.num_tokens is None:
            raise ValueError("step_share: this MoE forward did not report its tokens (num_tokens)")
        total = total + aux.z_loss * (aux.num_tokens / step_tokens)
    if aux.load_balancing_loss is not None:
        if aux.balance_mass_E is None or step_balance_counts_E is None:
            raise ValueError("step_share: the load-balancing share needs this forward's probability mass and the "
                             "step's assignment counts")
        total = total + balance_loss_of(aux.balance_mass_E, step_balance_counts_E.to(aux.balance_mass_E.dtype),
                                        step_tokens, top_k=config.top_k, coeff=config.aux_loss_coeff)
    return total


def pooled_load_balancing_loss(auxes: list[MoEAux]) -> torch.Tensor:
    """transformers' load-balancing loss (`load_balancing_loss_func`, Qwen3-Next / Qwen3.5-MoE) of the rows of one
    forward: E/(L·S)² · Σ_e (Σ_l counts_le)(Σ_l mass_le) over the L MoE layers' `balance_counts_E` and
    `balance_mass_E` (q-weighted, so S = Σ q is every semantic token once per trajectory); no coefficient. Unlike
    the per-layer loss it has no 1/k and pools the layers before the product: it is not a sum of layer terms."""
    if not auxes:
        raise ValueError("pooled_load_balancing_loss: the forward has no MoE layer")
    mass_E, counts_E = pooled_balance_statistics(auxes)
    return pooled_balance_loss_of(mass_E, counts_E, auxes[0].num_tokens, len(auxes))


def pooled_balance_statistics(auxes: list[MoEAux]) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ_l mass_le, Σ_l counts_le) of some MoE layers of one forward (the counts without grad, in the mass's
    dtype): the two factors of `pooled_load_balancing_loss`, which a pipeline stage sums over its own layers."""
    if any(aux.balance_mass_E is None or aux.num_tokens is None for aux in auxes):
        raise ValueError("pooled_load_balancing_loss: the MoE layers did not report their load-balancing statistics "
                         "(set moe.balance_statistics or aux_loss_coeff > 0)")
    mass_E = torch.stack([aux.balance_mass_E for aux in auxes]).sum(dim=0)
    counts_E = torch.stack([aux.balance_counts_E.to(mass_E.dtype) for aux in auxes]).sum(dim=0)
    return mass_E, counts_E


def pooled_balance_loss_of(mass_E: torch.Tensor, counts_E: torch.Tensor, num_tokens: torch.Tensor | float,
                           num_layers: int) -> torch.Tensor:
    """E/(L·S)² · Σ_e counts_e·mass_e for L = `num_layers` and S = `num_tokens`: `pooled_load_balancing_loss` of
    the layers' pooled statistics. Linear in the mass for given counts, so with the counts of all L layers, the
    terms of disjoint sets of layers' masses add up to the loss, value and gradient."""
    total = torch.as_tensor(num_tokens, dtype=mass_E.dtype, device=mass_E.device) * num_layers
    return (mass_E * counts_E.to(mass_E.dtype)).sum() * mass_E.shape[0] / _row_total(total * total)


def _row_total(total: torch.Tensor) -> torch.Tensor:
    """A loss's denominator Σ q (or its square); for rows of no weight at all (no rows) the smallest positive
    number instead of 0, so that the loss is 0 (its numerator is a sum over the same rows), not 0/0."""
    return total.clamp(min=torch.finfo(total.dtype).tiny)


@torch.no_grad()
def expert_assignment_counts(
    experts_NK: torch.Tensor, multiplicity_N: torch.Tensor | None, num_experts: int
) -> torch.Tensor:
    """fp32 [E] Σ_c q_c·[e ∈ experts_c]: the q-weighted top-k counts."""
    if multiplicity_N is None:
        multiplicity_N = torch.ones(experts_NK.shape[0], device=experts_NK.device)
    weights = multiplicity_N.to(torch.float32)[:, None].expand(experts_NK.shape)
    return torch.zeros(num_experts, device=experts_NK.device).index_add_(
        0, experts_NK.reshape(-1), weights.reshape(-1)
    )


@torch.no_grad()
def updated_expert_bias(
    tokens_per_expert_E: torch.Tensor, expert_bias_E: torch.Tensor, update_rate: float
) -> torch.Tensor:
    """b + rate·sign(mean(counts) − counts): raise under-loaded experts, lower over-loaded ones.

    `tokens_per_expert_E` are the counts of the whole global batch (summed over microbatches and
    data-parallel ranks by the caller); works on stacked [L, E] inputs too.
    """
    mean = tokens_per_expert_E.sum(dim=-1, keepdim=True) / tokens_per_expert_E.shape[-1]
    return expert_bias_E + torch.sign(mean - tokens_per_expert_E) * update_rate


def _accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for fp32/bf16/fp16 rows, fp64 for fp64 rows (the tests' exact mode)."""
    return torch.promote_types(x.dtype, torch.float32)


class _DispatchRows(torch.autograd.Function):
    """x[token_R] for token_R = order_R // k (each row k times, in expert order); the backward
    gathers the gradients back into (row, slot) order by the inverse permutation and sums each
    row's k slots, instead of indexing's accumulating scatter."""

    @staticmethod
    def forward(ctx, x_ND, token_R, inverse_R, top_k):
        ctx.save_for_backward(inverse_R)
        ctx.top_k = top_k
        return x_ND.index_select(0, token_R)

    @staticmethod
    def backward(ctx, grad_RD):
        (inverse_R,) = ctx.saved_tensors
        grad_NKD = grad_RD.index_select(0, inverse_R).view(-1, ctx.top_k, grad_RD.shape[1])
        return grad_NKD.sum(dim=1), None, None, None


class _RouterLogits(torch.autograd.Function):
    """x·Wᵀ in fp32 (fp64 for fp64 rows), as `x.float() @ w.float().T` computes it and its autograd
    differentiates it (the same products in the same layouts), but keeping for the backward the rows the
    product reads, in the narrowest dtype that holds them: the rows themselves (bf16 rows: not their fp32
    copy, 0.5 GB per layer at T = 65,536, D = 2,048) or, for fp32 rows under autocast, autocast's copy."""

    @staticmethod
    def forward(ctx, x_ND, weight_ED):
        dtype = _accumulation_dtype(x_ND)
        kept = x_ND
        device = x_ND.device.type
        if x_ND.dtype == torch.float32 and torch.is_autocast_enabled(device):
            kept = x_ND.to(torch.get_autocast_dtype(device))  # the values autocast's product reads
        ctx.x_dtype = x_ND.dtype
        ctx.save_for_backward(kept, weight_ED)
        return x_ND.to(dtype) @ weight_ED.to(dtype).T

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_NE):
        kept_ND, weight_ED = ctx.saved_tensors
        dtype = grad_NE.dtype
        grad_x = (grad_NE @ weight_ED.to(dtype)).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            # autograd's mm backward for the transposed weight view computes gradᵀ·x (the view's layout)
            grad_weight = (grad_NE.T @ kept_ND.to(dtype)).to(weight_ED.dtype)
        return grad_x, grad_weight


class _LeanExperts(torch.autograd.Function):
    """The grouped experts path (dispatch, two grouped GEMMs, combine) as one autograd node that keeps
    only the rows x_ND (which the shared expert and the router keep anyway) and the gate/up projection
    h_R2F: the backward gathers the rows again and recomputes the activation, where the composed path
    keeps the dispatched rows, the activation and the permuted expert outputs (two [R, D] and one
    [R, F] tensor more). The expert outputs stay in expert order: `gather_combine` reads them through
    the inverse permutation (and sums the routed rows' input gradients per row the same way), where the
    composed path writes a permuted copy each way. The forward is the composed path's, bit for bit
    (the same weighted sum over the same values). The backward moves each
    routed row's combine weight w onto its activation (out = Σ_k w·(a·W_down) = Σ_k (w·a)·W_down), so
    the routing-weight gradient is dw = Σ_f a·(g·W_downᵀ) and needs no expert output:
    `weighted_swiglu_backward` gives d h, dw and w·a in one pass. An addend (the shared expert's output) joins
    the combine's fp32 sum and the result is rounded once to `out_dtype` there: bit for bit the composed
    `(out + shared.to(out.dtype)).to(out_dtype)`, without its three passes over an fp32 [N, D] tensor each way
    (the addend's gradient is the output's, cast to its dtype)."""

    @staticmethod
    def forward(ctx, x_ND, probs_NK, gate_up, down, token_R, order_R, inverse_R, ends_E, limit, add_ND, out_dtype):
        num_rows, top_k = probs_NK.shape
        h_R2F = torch._grouped_mm(x_ND.index_select(0, token_R), gate_up, offs=ends_E)
        y_RD = torch._grouped_mm(swiglu(h_R2F, limit), down, offs=ends_E)
        out = gather_combine(probs_NK, y_RD, inverse_R.view(num_rows, top_k), add_ND, out_dtype)
        ctx.save_for_backward(x_ND, probs_NK, gate_up, down, token_R, order_R, inverse_R, ends_E, h_R2F)
        ctx.limit = limit
        ctx.add_dtype = None if add_ND is None else add_ND.dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_ND):
        x_ND, probs_NK, gate_up, down, token_R, order_R, inverse_R, ends_E, h_R2F = ctx.saved_tensors
        num_rows, top_k = probs_NK.shape
        grad_add = grad_ND.to(ctx.add_dtype) if ctx.add_dtype is not None and ctx.needs_input_grad[9] else None
        grad_RD = grad_ND.to(h_R2F.dtype).index_select(0, token_R)
        grad_a_RF = torch._grouped_mm(grad_RD, down.transpose(1, 2), offs=ends_E)
        weight_R = probs_NK.reshape(-1).index_select(0, order_R)
        grad_h, grad_weight_R, weighted_a_RF = weighted_swiglu_backward(h_R2F, weight_R, grad_a_RF, ctx.limit)
        del grad_a_RF
        grad_down = torch._grouped_mm(weighted_a_RF.t(), grad_RD, offs=ends_E)
        del grad_RD, weighted_a_RF
        grad_x = gather_combine(None, torch._grouped_mm(grad_h, gate_up.transpose(1, 2), offs=ends_E),
                                inverse_R.view(num_rows, top_k))
        grad_gate_up = torch._grouped_mm(x_ND.index_select(0, token_R).t(), grad_h, offs=ends_E)
        grad_probs = grad_weight_R.index_select(0, inverse_R).view(num_rows, top_k)
        return grad_x, grad_probs, grad_gate_up, grad_down, None, None, None, None, None, grad_add, None


def _swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    return swiglu(x @ gate_up, limit) @ down


class MoE(nn.Module):
    """Top-k routed SwiGLU experts (+ optional shared expert) on rows [N, D]."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.router_weight = nn.Parameter(torch.empty(c.num_experts, c.hidden_size))
        self.gate_up_proj = nn.Parameter(torch.empty(c.num_experts, c.hidden_size, 2 * c.expert_hidden_size))
        self.down_proj = nn.Parameter(torch.empty(c.num_experts, c.expert_hidden_size, c.hidden_size))
        if c.shared_expert_hidden_size:
            shared = c.shared_expert_hidden_size
            self.shared_gate_up_proj = nn.Parameter(torch.empty(c.hidden_size, 2 * shared))
            self.shared_down_proj = nn.Parameter(torch.empty(shared, c.hidden_size))
        else:
            self.shared_gate_up_proj = self.shared_down_proj = None
        self.shared_gate_weight = nn.Parameter(torch.empty(1, c.hidden_size)) if c.shared_expert_gate else None
        self.register_buffer("expert_bias", torch.zeros(c.num_experts) if c.expert_bias else None)
        for parameter in self.parameters():
            nn.init.normal_(parameter, std=c.init_std)

    def _apply(self, fn, recurse=True):
        # Module-wide casts (.to(bf16), .half()) move the expert bias but keep it fp32, like
        # megatron's router: tiny sign updates vanish in bf16.
        bias = self.expert_bias
        super()._apply(fn, recurse)
        if bias is not None and self.expert_bias.dtype != bias.dtype:
            self.expert_bias = bias.to(device=self.expert_bias.device)
        return self

    def router_logits(self, x_ND: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, E] (fp64 for fp64 rows) of the rows in their own dtype (`_RouterLogits`)."""
        return _RouterLogits.apply(x_ND, self.router_weight)

    def route(self, logits_NE: torch.Tensor) -> Routing:
        c = self.config
        return topk_routing(
            logits_NE,
            top_k=c.top_k,
            score_function=c.score_function,
            softmax_before_topk=c.softmax_before_topk,
            topk_scaling_factor=c.topk_scaling_factor,
            expert_bias_E=None if self.expert_bias is None else self.expert_bias.to(logits_NE.dtype),
            num_groups=c.num_groups,
            topk_groups=c.topk_groups,
        )

    def dispatch_plan(self, routing: Routing) -> DispatchPlan:
        """The N·k (row, expert) pairs sorted by expert."""
        flat_experts = routing.experts_NK.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)
        inverse = inverse_permutation(order)
        token = torch.div(order, self.config.top_k, rounding_mode="floor")
        counts = torch.bincount(flat_experts, minlength=self.config.num_experts)
        return DispatchPlan(order_R=order, inverse_R=inverse, token_R=token, tokens_per_expert_E=counts)

    def dispatch(self, x_ND: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, DispatchPlan]:
        """Routed rows sorted by expert, and the plan to combine them."""
        plan = self.dispatch_plan(routing)
        return _DispatchRows.apply(x_ND, plan.token_R, plan.inverse_R, self.config.top_k), plan

    def _grouped_operands(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, gate_up, down) for `torch._grouped_mm`, in the autocast dtype under CUDA autocast."""
        c = self.config
        if c.hidden_size % 8 or c.expert_hidden_size % 8:
            raise ValueError(
                f"grouped experts need hidden_size and expert_hidden_size multiples of 8 (16-byte strides), "
                f"got {c.hidden_size} and {c.expert_hidden_size}"
            )
        gate_up, down = self.gate_up_proj, self.down_proj
        if x.is_cuda and torch.is_autocast_enabled("cuda"):
            # _grouped_mm is not an autocast op: apply the autocast dtype (bf16 on sm90) by hand.
            dtype = torch.get_autocast_dtype("cuda")
            x, gate_up, down = x.to(dtype), gate_up.to(dtype), down.to(dtype)
        return x, gate_up, down

    def grouped_experts(self, x_RD: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """Expert MLPs on rows sorted by expert, two grouped GEMMs."""
        ends = torch.cumsum(tokens_per_expert_E, dim=0).to(torch.int32)
        x_RD, gate_up, down = self._grouped_operands(x_RD)
        return torch._grouped_mm(swiglu(torch._grouped_mm(x_RD, gate_up, offs=ends), self.config.swiglu_limit), down,
                                 offs=ends)

    def lean_experts(
        self, x_ND: torch.Tensor, routing: Routing, add_ND: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """[N, D] in `out_dtype` (default the combine dtype): the grouped path's function, plus `add_ND` in the
        combine's sum, as one autograd node that keeps two [R, D] and one [R, F] tensor less for the backward
        (`_LeanExperts`)."""
        plan = self.dispatch_plan(routing)
        ends = torch.cumsum(plan.tokens_per_expert_E, dim=0).to(torch.int32)
        x_ND, gate_up, down = self._grouped_operands(x_ND)
        return _LeanExperts.apply(
            x_ND, routing.probs_NK, gate_up, down, plan.token_R, plan.order_R, plan.inverse_R, ends,
            self.config.swiglu_limit, add_ND, out_dtype,
        )

    def combine(
        self, y_RD: torch.Tensor, routing: Routing, plan: DispatchPlan, num_rows: int
    ) -> torch.Tensor:
        """[N, D] in the combine dtype (fp32; fp64 for fp64 rows): Σ_experts weight · output."""
        probs_NK = routing.probs_NK
        y_NKD = permute_rows(y_RD, plan.inverse_R, plan.order_R).view(num_rows, probs_NK.shape[1], y_RD.shape[-1])
        return weighted_sum(probs_NK, y_NKD)

    def loop_experts(self, x_ND: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Reference path: [N, D] in the combine dtype, one gather / MLP / scatter-add per expert."""
        out = x_ND.new_zeros(x_ND.shape, dtype=routing.probs_NK.dtype)
        for expert in range(self.config.num_experts):
            token, slot = torch.nonzero(routing.experts_NK == expert, as_tuple=True)
            if len(token):
                y = _swiglu(x_ND[token], self.gate_up_proj[expert], self.down_proj[expert], self.config.swiglu_limit)
                out.index_add_(0, token, y.to(out.dtype) * routing.probs_NK[token, slot][:, None])
        return out

    def routed_experts(
        self, x_ND: torch.Tensor, routing: Routing, add_ND: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """[N, D]: Σ over each row's k experts of weight · expert MLP, by the backend, plus `add_ND` (the shared
        expert's output) in the combine dtype (fp32; fp64 for fp64 rows), rounded once to `out_dtype` (default
        the combine dtype). The lean experts add and round in their combine kernel."""
        backend = self._backend(x_ND)
        if backend == "lean":
            return self.lean_experts(x_ND, routing, add_ND, out_dtype)
        if backend == "grouped":
            x_RD, plan = self.dispatch(x_ND, routing)
            out = self.combine(self.grouped_experts(x_RD, plan.tokens_per_expert_E), routing, plan, x_ND.shape[0])
        else:
            out = self.loop_experts(x_ND, routing)
        if add_ND is not None:
            out = out + add_ND.to(out.dtype)
        return out if out_dtype is None else out.to(out_dtype)

    def shared_expert(self, x_ND: torch.Tensor) -> torch.Tensor:
        """The shared expert's SwiGLU MLP of every row (clipped to `shared_swiglu_limit` when set), times
        sigmoid(x·w_g) per row when it is gated."""
        y_ND = _swiglu(x_ND, self.shared_gate_up_proj, self.shared_down_proj, self.config.shared_swiglu_limit)
        if self.shared_gate_weight is not None:
            y_ND = torch.sigmoid(x_ND @ self.shared_gate_weight.T) * y_ND
        return y_ND

    def _backend(self, x_ND: torch.Tensor) -> str:
        return resolve_experts_backend(self.config.experts_backend, x_ND.is_cuda)

    def forward(
        self, x_ND: torch.Tensor, multiplicity_N: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, MoEAux]:
        """(y_ND in x's dtype, aux); `multiplicity_N` (q, default 1) weights the losses and counts."""
        c = self.config
        if x_ND.dim() != 2 or x_ND.shape[1] != c.hidden_size:
            raise ValueError(f"MoE: expected rows [N, {c.hidden_size}], got {tuple(x_ND.shape)}")
        if multiplicity_N is not None and multiplicity_N.shape != (x_ND.shape[0],):
            raise ValueError(
                f"MoE: multiplicity has shape {tuple(multiplicity_N.shape)}, expected ({x_ND.shape[0]},)"
            )
        logits = self.router_logits(x_ND)
        routing = self.route(logits)
        shared = self.shared_expert(x_ND) if self.shared_gate_up_proj is not None else None
        out = self.routed_experts(x_ND, routing, shared, x_ND.dtype)

        z_loss = router_z_loss(logits, multiplicity_N, c.z_loss_coeff) if c.z_loss_coeff > 0 else None
        num_tokens = _weights(multiplicity_N, logits).sum().detach()
        balance = mass = assignments = None
        if c.aux_loss_coeff > 0 or c.balance_statistics:
            scores, selected = aux_loss_scores(logits, top_k=c.top_k, score_function=c.score_function)
            mass, assignments = balance_parts(scores, selected, multiplicity_N)
            if c.aux_loss_coeff > 0:
                balance = balance_loss_of(mass, assignments, num_tokens, top_k=c.top_k, coeff=c.aux_loss_coeff)
        counts = expert_assignment_counts(routing.experts_NK, multiplicity_N, c.num_experts)
        aux = MoEAux(z_loss=z_loss, load_balancing_loss=balance, tokens_per_expert_E=counts, num_tokens=num_tokens,
                     balance_mass_E=mass, balance_counts_E=assignments)
        return out, aux

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert_E: torch.Tensor) -> None:
        """Apply the aux-loss-free update after a step, from the step's summed `tokens_per_expert_E`."""
        if self.expert_bias is None:
            raise ValueError("MoE.update_expert_bias: this layer has no expert bias (config.expert_bias)")
        rate = self.config.bias_update_rate
        self.expert_bias.copy_(updated_expert_bias(tokens_per_expert_E.float(), self.expert_bias, rate))
