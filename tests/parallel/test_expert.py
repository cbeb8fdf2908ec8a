"""ParallelMoE on 2 gloo ranks against the plain MoE on the same rows in one process.

Scenarios (the groups of a config): dp2-ep2 (each rank its own rows, experts split between the
ranks), tp2 (replicated rows, expert and shared-expert columns split), tp2-sp (row shards,
columns split), ep2 (row shards, experts split). For tiny's MoE and bailing-tiny's last MoE layer
(group-limited routing, 2 of 4 groups of 2 experts a row, whichever EP rank holds them; routed and shared
SwiGLU clipped), with the loop, grouped and lean expert backends
(lean is refused under expert parallelism), random multiplicities and a non-zero expert bias, each rank checks
in fp32: its output rows, the
gradient of its input rows, the z- and load-balancing losses, the load-balancing statistics (probability mass and
top-k counts, of the whole microbatch's rows on every rank), the expert-bias counts (summed
over shards) and, after summing partial gradients as `ParallelModel.reduce_gradients` does, every
parameter gradient (cut ones against their slice of the full gradient). A third MoE ("statistics": tiny's with its
own load-balancing loss off and `moe.balance_statistics` on) back-propagates transformers' pooled loss of its
statistics instead.
"""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from harts.model.config import load_model_config
from harts.model.moe import MoE, pooled_load_balancing_loss
from harts.parallel.comm import all_reduce_, pad_rows
from harts.parallel.config import ParallelConfig, load_parallel_config
from harts.parallel.expert import MoEParallelism, parallelize_moe
from harts.parallel.groups import build_groups
from harts.parallel.launch import launch
from harts.parallel.tensor import Sharder

SCENARIOS = ("dp2-ep2", "tp2", "tp2-sp", "ep2")
BACKENDS = ("loop", "grouped", "lean")
MOES = ("tiny", "bailing-tiny", "statistics")
"""Beside the two models' MoEs, "statistics": tiny's without its own load-balancing loss, reporting its statistics
(`moe.balance_statistics`) for transformers' pooled loss, which the backward then adds."""
# Under expert parallelism the lean experts are refused (test_lean_experts_are_refused_under_expert_parallelism).
CASES = [(s, b, m) for s in SCENARIOS for b in BACKENDS for m in MOES if not ("ep" in s and b == "lean")]
ROWS = 11
QUANTITIES = ("output", "input_grad", "z_loss", "load_balancing_loss", "balance_mass", "balance_counts", "counts",
              "param_grads")


def _plain_moe(backend: str, model: str = "tiny") -> MoE:
    """The MoE of `model`'s last layer (bailing-tiny's: its SwiGLU limits), weights scaled up so that its limits
    clip."""
    torch.manual_seed(42)
    config = load_model_config("tiny" if model == "statistics" else model)
    moe_config = replace(config.moe_for_layer(config.num_layers - 1), experts_backend=backend)
    if model == "statistics":
        moe_config = replace(moe_config, aux_loss_coeff=0.0, balance_statistics=True)
    moe = MoE(moe_config)
    moe.expert_bias.copy_(torch.randn(moe.config.num_experts) * 0.05)
    if model == "bailing-tiny":
        with torch.no_grad():
            for parameter in (moe.gate_up_proj, moe.shared_gate_up_proj):
                parameter.mul_(10.0)
    return moe


def _rows(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, 64, generator=generator)
    q = torch.randint(1, 4, (ROWS,), generator=generator).float()
    upstream = torch.randn(ROWS, 64, generator=generator)
    return x, q, upstream


def _balance_loss(moe: MoE, aux):
    """The layer's load-balancing loss: its own, or transformers' pooled one of its statistics (one layer)."""
    return aux.load_balancing_loss if moe.config.aux_loss_coeff > 0 else pooled_load_balancing_loss([aux])


def _reference(moe: MoE, x, q, upstream):
    x = x.clone().requires_grad_()
    out, aux = moe(x, multiplicity_N=q)
    ((out * upstream).sum() + aux.z_loss + _balance_loss(moe, aux)).backward()
    return out.detach(), x.grad, aux


def _error(actual, expected) -> float:
    return float((actual - expected).norm() / expected.norm().clamp(min=1e-30))


def _case(groups, backend: str, model: str) -> list[float]:
    config = groups.config
    me = dist.get_rank()
    sp = config.sequence_parallel
    full = _plain_moe(backend, model)
    moe = _plain_moe(backend, model)
    sharder = Sharder(moe)
    parallelism = MoEParallelism(tp_group=groups.tp, ep_group=groups.ep, sequence_parallel=sp)
    partial = set(parallelize_moe(sharder, moe, parallelism, tp_rank=groups.layout.tp_rank,
                                  ep_rank=groups.layout.ep_rank))
    if config.dp > 1:
        ranks = [_rows(seed) for seed in range(config.dp)]
        references = [_reference(full, *rows) for rows in ranks]
        x, q, upstream = ranks[me]
        want_out, want_grad, want_aux = references[me]
        rows = slice(None)
    else:
        x, q, upstream = _rows(0)
        want_out, want_grad, want_aux = _reference(full, x, q, upstream)
        rows = slice(None)
        if sp:
            shard = -(-ROWS // config.tp)
            rows = slice(me * shard, (me + 1) * shard)
            x, upstream = pad_rows(x, shard * config.tp)[rows], pad_rows(upstream, shard * config.tp)[rows]
            want_out = pad_rows(want_out, shard * config.tp)[rows]
            want_grad = pad_rows(want_grad, shard * config.tp)[rows]
    x = x.clone().requires_grad_()
    out, aux = moe(x, multiplicity_N=q)
    balance = _balance_loss(moe, aux)
    ((out * upstream).sum() + aux.z_loss + balance).backward()
    counts = aux.tokens_per_expert_E.clone()
    if sp:
        all_reduce_(counts, groups.tp)
    want_counts = want_aux.tokens_per_expert_E
    worst_param = 0.0
    for name, parameter in moe.named_parameters():
        grad = parameter.grad.clone()
        if name in partial:
            all_reduce_(grad, groups.tp)
        if config.dp > 1 and name not in ("gate_up_proj", "down_proj"):
            all_reduce_(grad, groups.dp)
        expected = dict(full.named_parameters())[name].grad
        spec = sharder.specs.get(name)
        if spec is not None:
            expected = expected.index_select(spec.dim, spec.index)
        worst_param = max(worst_param, _error(grad, expected))
    return [
        _error(out.detach(), want_out), _error(x.grad, want_grad),
        _error(aux.z_loss.detach(), want_aux.z_loss.detach()),
        _error(balance.detach(), _balance_loss(full, want_aux).detach()),
        _error(aux.balance_mass_E.detach(), want_aux.balance_mass_E.detach()),
        _error(aux.balance_counts_E, want_aux.balance_counts_E), _error(counts, want_counts), worst_param,
    ]


def _lean_refused(groups) -> bool:
    """Whether the lean experts are refused with a ValueError naming the all-to-all exchange: by
    `parallelize_moe`, and by the forward of a layer switched to lean after it was parallelized."""
    parallelism = MoEParallelism(tp_group=groups.tp, ep_group=groups.ep,
                                 sequence_parallel=groups.config.sequence_parallel)
    refusals = []
    for backend in ("lean", "grouped"):
        moe = _plain_moe(backend)
        try:
            parallelize_moe(Sharder(moe), moe, parallelism, tp_rank=groups.layout.tp_rank,
                            ep_rank=groups.layout.ep_rank)
            moe.config = replace(moe.config, experts_backend="lean")
            x, q, _ = _rows(0)
            moe(x, multiplicity_N=q)
        except ValueError as error:
            refusals.append("all-to-all" in str(error))
    return refusals == [True, True]


def _all_cases(groups) -> dict[tuple[str, str, str], dict[str, float] | bool]:
    results = {}
    for name in SCENARIOS:
        scenario_groups = build_groups(load_parallel_config(name), groups.device)
        for backend in BACKENDS:
            if (name, backend, "tiny") not in CASES:
                results[name, backend, "tiny"] = _lean_refused(scenario_groups)
                continue
            for model in MOES:
                errors = torch.tensor(_case(scenario_groups, backend, model), dtype=torch.float64)
                all_reduce_(errors, dist.group.WORLD, op=dist.ReduceOp.MAX)
                results[name, backend, model] = dict(zip(QUANTITIES, errors.tolist()))
    return results


@pytest.fixture(scope="module")
def errors():
    return launch(_all_cases, ParallelConfig(name="two-ranks", dp=2))


@pytest.mark.parametrize("scenario, backend, model", CASES, ids=[f"{s}-{b}-{m}" for s, b, m in CASES])
def test_parallel_moe_equals_plain(errors, scenario, backend, model):
    report = errors[scenario, backend, model]
    assert max(report.values()) <= 1e-5, report


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if "ep" in s])
def test_lean_experts_are_refused_under_expert_parallelism(errors, scenario):
    """Expert parallelism runs the grouped experts on the rows it receives: a lean configuration is an error,
    not a record that says lean while grouped ran."""
    assert errors[scenario, "lean", "tiny"] is True
