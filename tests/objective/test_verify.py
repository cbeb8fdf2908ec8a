"""The verification metrics themselves (`agreement`, `logit_cosines`) on hand-built inputs.

Every execution comparison passes its reports through these functions and then asserts the
figures are small, so a metric that under-reports (the best parameter instead of the worst, a
signed instead of an absolute difference, the reference's rows used for both executions)
passes them all. Here the inputs differ by known amounts, chosen so that each figure is an
exact binary fraction, and every field is checked exactly.
"""

import numpy as np
import pytest
import torch

from harts.objective.step import StepResult
from harts.objective.verify import agreement, logit_cosines


def _result(num_rows, logprobs, loss, moe_loss, tokens_per_expert=()):
    return StepResult(
        loss=loss, policy_loss=loss - moe_loss, moe_loss=moe_loss, clip_fraction=0.0, num_rows=num_rows,
        num_semantic_tokens=len(logprobs), seconds={}, layout_info=[],
        tokens_per_expert=[torch.tensor(counts) for counts in tokens_per_expert], logprobs=torch.tensor(logprobs),
    )


def test_agreement_reports_the_worst_of_each_figure():
    reference = _result(10, [-1.0, -2.0, -0.5, -3.0], loss=-2.0, moe_loss=0.25,
                        tokens_per_expert=[[3.0, 5.0], [4.0, 4.0]])
    # λ differs by +0.25 and -0.5 (the largest |Δ| is the negative one); loss by -0.5; MoE loss by -0.125;
    # expert counts by 2 in the first layer (negative) and 1 in the second.
    candidate = _result(7, [-1.0, -2.5, -0.25, -3.0], loss=-2.5, moe_loss=0.125,
                        tokens_per_expert=[[5.0, 3.0], [4.0, 3.0]])
    # First the parameter without gradient: a NaN there would poison Python's max.
    reference_grads = {
        "unused": torch.zeros(2),
        "barely": torch.tensor([0.0, 8.0]),
        "much": torch.tensor([0.0, 4.0]),
    }
    candidate_grads = {
        "unused": torch.zeros(2),  # 0, not 0 / 0
        "barely": torch.tensor([0.0, 8.0078125]),  # ‖Δ‖ / ‖g‖ = 2⁻⁷ / 8 = 2⁻¹⁰
        "much": torch.tensor([2.0, 4.0]),  # 2 / 4
    }
    cosines = np.array([1.0, 0.5, 0.75, 0.75])
    assert agreement(reference, candidate, reference_grads, candidate_grads, cosines) == {
        "reference_rows": 10,
        "candidate_rows": 7,
        "max_abs_logprob_diff": 0.5,
        "loss": -2.0,
        "loss_rel_diff": 0.25,
        "moe_loss_abs_diff": 0.125,
        "grad_rel_diff": 0.5,
        "tokens_per_expert_max_abs_diff": 2.0,
        "logit_cosine_min": 0.5,
        "logit_cosine_mean": 0.75,
    }


def test_agreement_of_identical_results_is_zero():
    result = _result(4, [-1.0, -2.0], loss=0.0, moe_loss=0.0)
    grads = {"unused": torch.zeros(3), "w": torch.tensor([1.0, -1.0])}
    report = agreement(result, result, grads, grads, np.ones(2))
    assert report["max_abs_logprob_diff"] == report["loss_rel_diff"] == report["moe_loss_abs_diff"] == 0.0
    assert report["grad_rel_diff"] == 0.0
    assert report["logit_cosine_min"] == report["logit_cosine_mean"] == 1.0


@pytest.mark.parametrize("chunk", [1, 2, 2048])
def test_logit_cosines_pair_each_semantic_position(chunk):
    """With W = I the logits are the hidden rows; the candidate holds its rows in another order,
    and its semantic rows say where: cosines 1, 0, -1 (first microbatch), 1, then 0 (second)."""
    weight = torch.eye(2)
    reference = [
        (torch.tensor([[1.0, 0.0], [3.0, 4.0], [1.0, 1.0]]), torch.tensor([0, 1, 2])),
        (torch.tensor([[0.0, 5.0], [2.0, 1.0]]), torch.tensor([1, 0])),
    ]
    candidate = [
        (torch.tensor([[-1.0, -1.0], [2.0, 0.0], [4.0, -3.0], [9.0, 9.0]]), torch.tensor([1, 2, 0])),
        (torch.tensor([[4.0, 2.0], [3.0, 0.0]]), torch.tensor([0, 1])),
    ]
    cosines = logit_cosines(reference, candidate, weight, chunk=chunk)
    assert cosines.dtype == np.float64
    np.testing.assert_allclose(cosines, [1.0, 0.0, -1.0, 1.0, 0.0], rtol=0, atol=1e-15)


def test_agreement_does_not_skip_a_nan_gradient():
    """A NaN in the candidate's gradient of a later parameter makes grad_rel_diff NaN (so every
    `<= tolerance` check fails), rather than being passed over by the maximum."""
    result = _result(4, [-1.0, -2.0], loss=1.0, moe_loss=0.0)
    reference_grads = {"w": torch.tensor([1.0, -1.0]), "v": torch.tensor([2.0, 0.0])}
    candidate_grads = {"w": torch.tensor([1.0, -1.0]), "v": torch.tensor([2.0, float("nan")])}
    report = agreement(result, result, reference_grads, candidate_grads, np.ones(2))
    assert np.isnan(report["grad_rel_diff"])
    counted = _result(4, [-1.0, -2.0], loss=1.0, moe_loss=0.0, tokens_per_expert=[[1.0, 2.0], [3.0, 4.0]])
    nan_counts = _result(4, [-1.0, -2.0], loss=1.0, moe_loss=0.0,
                         tokens_per_expert=[[2.0, 2.0], [3.0, float("nan")]])
    assert np.isnan(agreement(counted, nan_counts, reference_grads, reference_grads, np.ones(2))[
        "tokens_per_expert_max_abs_diff"])
