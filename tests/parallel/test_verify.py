"""Every parallel configuration equals the single-process baseline, in both executions, ± recomputation.

One launch of 2 gloo ranks runs dp2, tp2, tp2-sp, pp2, ep2 and dp2-ep2 (groups for each built over
the same world), another the same on gdn-tiny (the Gated DeltaNet family: GDN and gated GQA cut by heads, the
gated shared expert); slow launches of 4 ranks run the 4-rank combinations on both models. For each configuration,
execution (baseline, compact) and recomputation flag (not for dp2, whose blocks hold no
collective), the parallel step on the tiny model in fp32 (a tree step with shared prefixes,
4 microbatches, off-policy GRPO with clipping active) is compared by `verify_on_rank` with
`run_step` of the plain model in one process on the same microbatches: full-vocabulary logit
cosine >= 0.99999, |Δloss| <= 1e-6 relative, |Δλ| <= 1e-5, MoE loss, expert-bias counts, every
reassembled gradient <= 1e-4 relative, and all copies of a reduced gradient equal. dp2 and tp2-sp also run PPO with per-sequence aggregation and GRPO with a
KL term (other normalisers and loss terms through the data-parallel sum and the SP gather).
`full_gradients` itself (reassembly, worst replica disagreement) is checked on hand-built rank entries.
"""

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import numpy as np
import torch
import torch.distributed as dist

from harts.model.config import load_model_config
from harts.objective.losses import GRPOConfig, PPOConfig
from harts.objective.step import StepConfig
from harts.parallel.config import load_parallel_config
from harts.parallel.groups import build_groups
from harts.parallel.launch import launch
from harts.parallel.tensor import ShardSpec
from harts.parallel.verify import full_gradients, verify_on_rank
from tests.parallel.helpers import tree_step_and_microbatches

TWO_RANKS = ("dp2", "tp2", "tp2-sp", "pp2", "ep2", "dp2-ep2")
FOUR_RANKS = ("dp2-tp2-sp", "tp2-sp-pp2", "dp2-pp2-ep2")
EXECUTIONS = [StepConfig(execution=e, recompute=r) for e in ("baseline", "compact") for r in (False, True)]
RECOMPUTE = ("tp2", "tp2-sp", "pp2", "ep2", "dp2-ep2") + FOUR_RANKS
"""Configs whose recomputation is checked: those with collectives or stage transfers around recomputed blocks."""
LOSSES = {
    "ppo-seq-mean": StepConfig(execution="compact", loss="ppo", ppo=PPOConfig(aggregation="seq-mean-token-mean")),
    "grpo-kl": StepConfig(execution="compact", grpo=GRPOConfig(kl_coef=0.1)),
}
WITH_LOSSES = ("dp2", "tp2-sp")


def _candidates(name: str) -> list[StepConfig]:
    executions = [c for c in EXECUTIONS if name in RECOMPUTE or not c.recompute]
    return executions + (list(LOSSES.values()) if name in WITH_LOSSES else [])


def _verify_all(groups, names, step, microbatches, model="tiny"):
    reports = {}
    for name in names:
        config = load_parallel_config(name)
        reports[name] = verify_on_rank(build_groups(config, groups.device), load_model_config(model), 0, step,
                                       microbatches, _candidates(name))
    return reports


def _launch(names, model="tiny"):
    step, microbatches = tree_step_and_microbatches()
    world = load_parallel_config(names[0])
    assert all(load_parallel_config(n).world_size == world.world_size for n in names)
    return launch(_verify_all, world, names, step, microbatches, model)


@pytest.fixture(scope="module")
def two_rank_reports():
    return _launch(TWO_RANKS)


@pytest.fixture(scope="module")
def gdn_two_rank_reports():
    return _launch(TWO_RANKS, "gdn-tiny")


@pytest.fixture(scope="module")
def gdn_four_rank_reports():
    return _launch(FOUR_RANKS, "gdn-tiny")


@pytest.fixture(scope="module")
def four_rank_reports():
    return _launch(FOUR_RANKS)


def _cases(names):
    cases = []
    for name in names:
        for k, candidate in enumerate(_candidates(name)):
            label = next((key for key, c in LOSSES.items() if c is candidate), None)
            label = label or f"{candidate.execution}{'-recompute' if candidate.recompute else ''}"
            cases.append(pytest.param(name, k, id=f"{name}-{label}"))
    return cases


def check_verify_report(report):
    assert report["logit_cosine_min"] >= 0.99999, report
    assert report["loss_rel_diff"] <= 1e-6, report
    assert report["max_abs_logprob_diff"] <= 1e-5, report
    assert report["moe_loss_abs_diff"] <= 1e-6 * max(1.0, abs(report["loss"])), report
    assert report["grad_rel_diff"] <= 1e-4, report
    assert report["replica_grad_max_rel_diff"] <= 1e-6, report
    assert report["tokens_per_expert_max_abs_diff"] == 0.0, report
    if report["execution"] == "compact":
        assert report["candidate_rows"] < report["reference_rows"], report
    else:
        assert report["candidate_rows"] == report["reference_rows"], report


@pytest.mark.parametrize(("name", "k"), _cases(TWO_RANKS))
def test_two_rank_config_equals_single_process(two_rank_reports, name, k):
    check_verify_report(two_rank_reports[name][k])


@pytest.mark.parametrize(("name", "k"), _cases(TWO_RANKS))
def test_two_rank_config_equals_single_process_gdn(gdn_two_rank_reports, name, k):
    check_verify_report(gdn_two_rank_reports[name][k])


@pytest.mark.slow
@pytest.mark.parametrize(("name", "k"), _cases(FOUR_RANKS))
def test_four_rank_config_equals_single_process(four_rank_reports, name, k):
    check_verify_report(four_rank_reports[name][k])


@pytest.mark.slow
@pytest.mark.parametrize(("name", "k"), _cases(FOUR_RANKS))
def test_four_rank_config_equals_single_process_gdn(gdn_four_rank_reports, name, k):
    check_verify_report(gdn_four_rank_reports[name][k])


def test_comparison_is_not_degenerate(two_rank_reports):
    """Clipping is active and the compact execution ran fewer rows (a sharing step)."""
    report = two_rank_reports["dp2"][1]
    assert 0 < report["clip_fraction"] < 1 and report["loss"] != 0


def _check_every(reports, names, candidates):
    for name in names:
        assert len(reports[name]) == len(candidates)
        for report in reports[name]:
            check_verify_report(report)


KEPT_ATTENTION = [StepConfig(execution=e, recompute=True, keep_attention=True) for e in ("baseline", "compact")]


def _verify_kept_attention(groups, names, step, microbatches):
    # Equal q/k and v head dims, so that SDPA's fused CPU kernel runs and the recomputation keeps its outputs.
    config = load_model_config("tiny")
    model = replace(config, mla=replace(config.mla, qk_nope_head_dim=8))
    return {name: verify_on_rank(build_groups(load_parallel_config(name), groups.device), model, 0, step, microbatches,
                                 KEPT_ATTENTION) for name in names}


BY_ROWS = [StepConfig(execution=e, recompute=True, recompute_blocks=3, recompute_by_rows=True)
           for e in ("baseline", "compact")]


def _verify_by_rows(groups, names, step, microbatches):
    return {name: verify_on_rank(build_groups(load_parallel_config(name), groups.device), load_model_config("tiny"),
                                 0, step, microbatches, BY_ROWS) for name in names}


def test_recompute_by_rows_under_parallelism():
    """`recompute_by_rows` with microbatches of unequal sizes: under dp2-ep2 the two replicas run different
    microbatches in one slot while their MoE layers exchange rows, so they must recompute the same blocks (a
    rank that recomputes a block its peer keeps exchanges rows again in the backward: gloo's sizes mismatch);
    under pp2 and tp2-sp the ranks of one replica decide alike. The same comparison as without it."""
    step, _ = tree_step_and_microbatches()
    microbatches = [np.arange(0, 5), np.arange(5, 6), np.arange(6, 7), np.arange(7, 8)]  # replica 0: 0 and 2
    names = ("dp2-ep2", "pp2", "tp2-sp")
    _check_every(launch(_verify_by_rows, load_parallel_config(names[0]), names, step, microbatches), names, BY_ROWS)


def test_kept_attention_under_parallelism():
    """Recomputation that keeps the attention (torch's selective checkpoint) beside the collectives of tensor
    and sequence parallelism, pipeline stages and expert parallelism: the same comparison. (A policy that also
    kept the collectives' in-place outputs fails here: torch refuses a kept tensor that was mutated.)"""
    step, microbatches = tree_step_and_microbatches()
    names = ("tp2-sp", "pp2", "ep2")
    _check_every(launch(_verify_kept_attention, load_parallel_config(names[0]), names, step, microbatches), names,
                 KEPT_ATTENTION)


BAILING = [StepConfig(execution=e) for e in ("baseline", "compact")]


def _verify_bailing(groups, names, step, microbatches):
    return {name: verify_on_rank(build_groups(load_parallel_config(name), groups.device),
                                 load_model_config("bailing-tiny"), 0, step, microbatches, BAILING) for name in names}


def test_bailing_model_under_parallelism():
    """bailing-tiny (BailingHybrid's features: gated MLA cut by heads, full-rank KDA gates, the bounded gate,
    group-limited routing with clipped SwiGLU) under tensor, sequence and expert parallelism: the same comparison."""
    step, microbatches = tree_step_and_microbatches()
    names = ("tp2", "tp2-sp", "ep2")
    _check_every(launch(_verify_bailing, load_parallel_config(names[0]), names, step, microbatches), names, BAILING)


GPU_CONFIGS = ("dp2", "tp2", "tp2-sp", "pp2", "ep2", "dp2-ep2", "dp2-tp2-sp", "tp2-sp-pp2", "dp2-pp2-ep2")


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_nccl_config_equals_single_process(name):
    """The same comparison on GPUs over NCCL, in fp32 with the CPU math (torch KDA, SDPA attention,
    loop experts: grouped GEMMs need bf16)."""
    config = load_parallel_config(name)
    if not torch.cuda.is_available() or torch.cuda.device_count() < config.world_size:
        pytest.skip(f"needs {config.world_size} GPUs")
    step, microbatches = tree_step_and_microbatches()
    model = load_model_config("tiny")
    model = replace(model, moe=replace(model.moe, experts_backend="loop"))
    candidates = [replace(c, kda_backend="torch", attention_backend="sdpa") for c in EXECUTIONS]
    reports = launch(verify_on_rank, config, model, 0, step, microbatches, candidates, device="cuda")
    for report in reports:
        check_verify_report(report)


def _rank_entries(grads: dict[str, torch.Tensor], specs: dict[str, ShardSpec]) -> list:
    return [(name, specs.get(name), grad) for name, grad in grads.items()]


def test_full_gradients_reassembles_and_reports_the_worst_replica(monkeypatch):
    """`full_gradients` on hand-built rank entries (the gather faked, three ranks): a TP-sharded
    parameter is put together from its parts, and replica_grad_max_rel_diff is the largest
    disagreement between two copies of one part (‖Δ‖ / ‖g‖ of the later rank's copy), exactly:
    0.75 for "far" (Δ = [3, 0] against [0, 4]), not the 2⁻¹⁰ of "near" or the 0 of "same"."""
    half = [ShardSpec(dim=0, index=torch.tensor([0, 1]), full_shape=(4,)),
            ShardSpec(dim=0, index=torch.tensor([2, 3]), full_shape=(4,))]
    ranks = [  # (gradients, shard specs) of ranks 0, 1, 2; rank 2 is rank 0's DP replica
        ({"same": torch.tensor([0.0, 4.0]), "near": torch.tensor([0.0, 8.0078125]), "far": torch.tensor([3.0, 4.0]),
          "sharded": torch.tensor([1.0, 2.0])}, {"sharded": half[0]}),
        ({"same": torch.tensor([0.0, 4.0]), "near": torch.tensor([0.0, 8.0]), "far": torch.tensor([0.0, 4.0]),
          "sharded": torch.tensor([3.0, 4.0])}, {"sharded": half[1]}),
        ({"same": torch.tensor([0.0, 4.0]), "near": torch.tensor([0.0, 8.0]), "far": torch.tensor([0.0, 4.0]),
          "sharded": torch.tensor([1.0, 2.0])}, {"sharded": half[0]}),
    ]
    full, worst = _full_gradients_of(ranks, monkeypatch)
    assert worst == 0.75
    assert torch.equal(full["sharded"], torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert torch.equal(full["same"], torch.tensor([0.0, 4.0]))

    # A NaN in the last copy compared (after finite disagreements) makes the figure NaN, not 0.75.
    ranks[2][0]["sharded"] = torch.tensor([1.0, float("nan")])
    _, worst = _full_gradients_of(ranks, monkeypatch)
    assert math.isnan(worst)


def _full_gradients_of(ranks, monkeypatch):
    """`full_gradients` with the gather faked: `ranks` holds (gradients, shard specs) per rank."""
    parameters = {name: torch.nn.Parameter(torch.zeros_like(grad)) for name, grad in ranks[0][0].items()}
    for name, parameter in parameters.items():
        parameter.grad = ranks[0][0][name].clone()
    pmodel = SimpleNamespace(named_parameters=parameters.items, shard_specs=ranks[0][1])

    def gather_object(entries, gathered, dst):
        assert dst == 0
        gathered[:] = [entries] + [_rank_entries(grads, specs) for grads, specs in ranks[1:]]

    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: len(ranks))
    monkeypatch.setattr(dist, "gather_object", gather_object)
    return full_gradients(pmodel)


def test_reference_config_runs_without_recomputation():
    """The reference of a candidate that recomputes (with every option of the recomputation) is the baseline
    without recomputation, and a valid config."""
    from harts.parallel.verify import reference_config

    candidate = StepConfig(execution="compact", recompute=True, recompute_blocks=2, keep_attention=True,
                           keep_kda_intermediates=True, kda_backend="fla", replay=False, recompute_by_rows=True)
    reference = reference_config(candidate)
    assert (reference.execution, reference.recompute, reference.recompute_blocks, reference.keep_attention,
            reference.keep_kda_intermediates, reference.replay, reference.recompute_by_rows) == (
        "baseline", False, None, False, False, True, False)
