"""transformers' pooled load-balancing loss (`StepConfig.pooled_balance_coeff`) under every parallel configuration
equals `run_step`'s in one process.

The model is gdn-tiny (softmax routing; one dense and three MoE layers of 4 experts, top-2, so pp2 puts one MoE
layer on the first stage and two on the last) with its layers' own MoE losses off, `moe.balance_statistics` on and
the router weights scaled up (routing far from uniform: a per-layer or per-shard reading differs from the pooled
one). The step (a tree step with shared prefixes, 4 microbatches) has zero advantages, so the policy loss and its
gradient are 0 and every gradient is the pooled loss's (coefficient 2). For each configuration, execution and
recomputation flag, fp32 on gloo: the step's pooled loss (the mean over microbatches of each one's) within 1e-6
relative, the MoE loss (2 × it), every MoE layer's router-weight gradient within 1e-5 relative (reassembled,
after the step's reduction), every other gradient within 1e-4 relative where the reference's is not zero and zero
where it is, and the replicas' copies equal. Two-rank configurations in one launch; the 4-rank ones slow.
Beside them: a model that cannot give the loss (sigmoid routing, no statistics) is refused by name, with the
configuration's, before any forward.
"""

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from harts.model.config import load_model_config
from harts.model.model import HybridModel
from harts.objective.step import StepConfig, run_step
from harts.parallel.config import load_parallel_config
from harts.parallel.groups import build_groups
from harts.parallel.launch import launch
from harts.parallel.model import parallelize
from harts.parallel.step import run_parallel_step
from harts.parallel.verify import full_gradients, verify_on_rank
from tests.parallel.helpers import tree_step_and_microbatches
from tests.parallel.test_verify import check_verify_report

TWO_RANKS = ("dp2", "tp2", "tp2-sp", "pp2", "ep2", "dp2-ep2")
FOUR_RANKS = ("dp2-tp2-sp", "tp2-sp-pp2", "dp2-pp2-ep2")
COEFF = 2.0
CANDIDATES = {
    "baseline": StepConfig(execution="baseline", pooled_balance_coeff=COEFF),
    "compact": StepConfig(execution="compact", pooled_balance_coeff=COEFF),
    "compact-recompute": StepConfig(execution="compact", recompute=True, pooled_balance_coeff=COEFF),
}
SEED = 5


def model_config():
    config = load_model_config("gdn-tiny")
    return replace(config, moe=replace(config.moe, aux_loss_coeff=0.0, z_loss_coeff=0.0, balance_statistics=True))


def _model() -> HybridModel:
    model = HybridModel(model_config())
    model.init_weights(SEED)
    with torch.no_grad():
        for block in model.blocks:
            if block.is_moe:
                block.mlp.router_weight.mul_(40.0)
    return model


def step_without_advantages():
    step, microbatches = tree_step_and_microbatches()
    return replace(step, advantage_per_token=np.zeros_like(step.advantage_per_token)), microbatches


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm().clamp(min=1e-30))


def _compare(result, grads, replica_diff, reference, reference_grads) -> dict[str, float]:
    routers = [name for name in reference_grads if name.endswith("router_weight")]
    others = [name for name in reference_grads if name not in routers]
    nonzero = [name for name in others if float(reference_grads[name].norm()) > 0]
    return {
        "pooled_rel_diff": abs(result.pooled_balance_loss - reference.pooled_balance_loss)
        / abs(reference.pooled_balance_loss),
        "moe_loss_rel_diff": abs(result.moe_loss - reference.moe_loss) / abs(reference.moe_loss),
        "router_grad_rel_diff": max(_relative(grads[name], reference_grads[name]) for name in routers),
        "grad_rel_diff": max(_relative(grads[name], reference_grads[name]) for name in nonzero),
        "zero_grad_max_abs": max((float(grads[name].abs().max()) for name in others if name not in nonzero),
                                 default=0.0),
        "replica_grad_max_rel_diff": replica_diff,
        "policy_loss": abs(result.policy_loss),
        "num_routers": len(routers),
        "pooled": reference.pooled_balance_loss,
    }


def _reference(step, microbatches, config):
    model = _model()
    result = run_step(model, step, microbatches, config)
    return result, {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _run_all(groups, names, step, microbatches):
    runs = {}
    for name in names:
        pmodel = parallelize(_model(), build_groups(load_parallel_config(name), groups.device))
        for label, config in CANDIDATES.items():
            pmodel.model.zero_grad(set_to_none=True)
            result = run_parallel_step(pmodel, step, microbatches, config)
            runs[name, label] = (result, full_gradients(pmodel))
    if dist.get_rank() != 0:
        return None
    references = {label: _reference(step, microbatches, config) for label, config in CANDIDATES.items()}
    return {key: _compare(result, *gathered, *references[key[1]]) for key, (result, gathered) in runs.items()}


def _launch(names):
    step, microbatches = step_without_advantages()
    return launch(_run_all, load_parallel_config(names[0]), names, step, microbatches)


@pytest.fixture(scope="module")
def two_rank_reports():
    return _launch(TWO_RANKS)


@pytest.fixture(scope="module")
def four_rank_reports():
    return _launch(FOUR_RANKS)


def _check(report):
    assert report["num_routers"] == 3 and report["pooled"] > 0 and report["policy_loss"] == 0, report
    assert report["pooled_rel_diff"] <= 1e-6, report
    assert report["moe_loss_rel_diff"] <= 1e-6, report
    assert report["router_grad_rel_diff"] <= 1e-5, report
    assert report["grad_rel_diff"] <= 1e-4, report
    assert report["zero_grad_max_abs"] == 0.0, report
    assert report["replica_grad_max_rel_diff"] <= 1e-6, report


CASES = [pytest.param(name, label, id=f"{name}-{label}") for name in TWO_RANKS for label in CANDIDATES]


@pytest.mark.parametrize(("name", "label"), CASES)
def test_pooled_balance_under_two_ranks_equals_one_process(two_rank_reports, name, label):
    _check(two_rank_reports[name, label])


@pytest.mark.slow
@pytest.mark.parametrize(("name", "label"), [pytest.param(name, label, id=f"{name}-{label}")
                                             for name in FOUR_RANKS for label in CANDIDATES])
def test_pooled_balance_under_four_ranks_equals_one_process(four_rank_reports, name, label):
    _check(four_rank_reports[name, label])


WITH_POLICY = ("tp2-sp", "pp2", "dp2-ep2")


def _verify_with_policy(groups, names, step, microbatches):
    config = load_model_config("gdn-tiny")
    config = replace(config, moe=replace(config.moe, balance_statistics=True))
    candidates = [StepConfig(execution="compact", pooled_balance_coeff=COEFF)]
    return {name: verify_on_rank(build_groups(load_parallel_config(name), groups.device), config, 0, step,
                                 microbatches, candidates) for name in names}


def test_with_the_policy_loss_and_the_layers_own_moe_losses():
    """The pooled loss beside the policy loss (the step's own advantages) and gdn-tiny's own z- and load-balancing
    losses, through `verify_on_rank` (harts verify --parallel): test_verify's comparison, and the pooled loss within
    1e-6."""
    step, microbatches = tree_step_and_microbatches()
    reports = launch(_verify_with_policy, load_parallel_config(WITH_POLICY[0]), WITH_POLICY, step, microbatches)
    for name in WITH_POLICY:
        (report,) = reports[name]
        check_verify_report(report)
        assert report["pooled_balance_loss_abs_diff"] <= 1e-6, (name, report)


@pytest.mark.parametrize("statistics", [False, True], ids=["sigmoid", "no-statistics"])
def test_a_model_that_cannot_give_it_is_refused_before_running(groups, statistics):
    """The parallel step names its configuration and the model, before any forward (in this process, one rank)."""
    config = load_model_config("tiny")
    if statistics:
        config = replace(model_config(), moe=replace(model_config().moe, balance_statistics=False))
    model = HybridModel(config)
    model.init_weights(SEED)
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))
    message = ("its MoE layers do not report their load-balancing statistics" if statistics
               else "transformers' load-balancing loss is the softmax one; the model routes with sigmoid scores")
    step, microbatches = step_without_advantages()
    with pytest.raises(ValueError, match=rf"run_parallel_step under 'single': pooled_balance_coeff 2.0 on model "
                                         rf"'{config.name}': {message}"):
        run_parallel_step(parallelize(model, groups), step, microbatches, CANDIDATES["compact"])
    assert not calls
