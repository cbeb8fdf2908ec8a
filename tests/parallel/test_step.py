"""The parallel step with every degree 1 is exactly `run_step`; replica assignment; bad microbatches.

In this process (a gloo group of one rank): the same loss, log-probs, expert counts and bitwise
the same gradients as `run_step` for both executions, ± recomputation, and without backward.
"""

import numpy as np
import pytest
import torch

from harts.model.config import load_model_config
from harts.model.model import HybridModel
from harts.objective.step import StepConfig, run_step
from harts.parallel.model import parallelize
from harts.parallel.step import check_microbatches, replica_microbatches, run_parallel_step
from tests.parallel.helpers import tree_step_and_microbatches


def _model():
    model = HybridModel(load_model_config("tiny"))
    model.init_weights(7)
    return model


RECOMPUTE = {"plain": {}, "recompute": {"recompute": True},
             "keep-attention": {"recompute": True, "recompute_blocks": 3, "keep_attention": True},
             "by-rows": {"recompute": True, "recompute_blocks": 3, "recompute_by_rows": True}}


@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize("execution", ["baseline", "compact"])
def test_single_rank_is_run_step(groups, execution, recompute, monkeypatch):
    step, microbatches = tree_step_and_microbatches()
    config = StepConfig(execution=execution, **RECOMPUTE[recompute])
    settings = []
    run_blocks = HybridModel.run_blocks
    monkeypatch.setattr(HybridModel, "run_blocks", lambda self, *a, **k: settings.append(
        (k["recompute"], k["recompute_blocks"], k["keep_attention"])) or run_blocks(self, *a, **k))
    reference = _model()
    expected = run_step(reference, step, microbatches, config, collect_logprobs=True)
    expected_settings, settings[:] = list(settings), []
    pmodel = parallelize(_model(), groups)
    result = run_parallel_step(pmodel, step, microbatches, config, collect=True)
    assert settings == expected_settings
    if config.recompute_by_rows:  # the smaller microbatches recompute fewer blocks, as in run_step
        assert len({blocks for _, blocks, _ in settings}) > 1 and max(b for _, b, _ in settings) == 3, settings
    else:
        assert set(settings) == {(config.recompute, config.recompute_blocks, config.keep_attention)}
    assert result.loss == pytest.approx(expected.loss, rel=1e-12, abs=0)
    assert result.moe_loss == pytest.approx(expected.moe_loss, rel=1e-12, abs=0)
    assert result.num_rows == expected.num_rows and result.clip_fraction == pytest.approx(expected.clip_fraction)
    assert torch.equal(result.logprobs, expected.logprobs)
    for a, b in zip(result.tokens_per_expert, expected.tokens_per_expert, strict=True):
        assert torch.equal(a, b)
    grads = dict(reference.named_parameters())
    for name, parameter in pmodel.named_parameters():
        assert torch.equal(parameter.grad, grads[name].grad), name


def test_forward_only(groups):
    step, microbatches = tree_step_and_microbatches()
    config = StepConfig(execution="compact")
    pmodel = parallelize(_model(), groups)
    result = run_parallel_step(pmodel, step, microbatches, config, backward=False)
    expected = run_step(_model(), step, microbatches, config, backward=False)
    assert result.loss == pytest.approx(expected.loss, rel=1e-12)
    assert all(p.grad is None for _, p in pmodel.named_parameters())


def test_replica_microbatches():
    """The plan lists microbatches in (slot, replica) order: replica r takes every D-th from r."""
    assert replica_microbatches(6, 2, 0) == [0, 2, 4]
    assert replica_microbatches(6, 2, 1) == [1, 3, 5]
    assert replica_microbatches(3, 1, 0) == [0, 1, 2]


def test_bad_microbatches():
    step, microbatches = tree_step_and_microbatches()
    with pytest.raises(ValueError, match="cover every trajectory"):
        check_microbatches(step, microbatches[:-1], 1)
    with pytest.raises(ValueError, match="not a multiple of dp = 3"):
        check_microbatches(step, microbatches, 3)
    with pytest.raises(ValueError, match="empty microbatch"):
        check_microbatches(step, microbatches + [np.zeros(0, dtype=np.int64)], 1)
