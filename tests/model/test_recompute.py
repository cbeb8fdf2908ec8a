"""Activation recomputation of all blocks or of the first N (`StepConfig.recompute_blocks`, Megatron's
block method): the same step gives the same loss and bitwise the same gradients as without
recomputation (the recomputed forward repeats the same ops on CPU), and exactly blocks 0 … N − 1 run
their forward twice (a pre-forward hook counts: the recomputation stops early, after the last saved
tensor)."""

import numpy as np
import pytest
import torch

from harts.model.config import load_model_config
from harts.model.model import HybridModel
from harts.objective.step import StepConfig, run_step
from tests.objective.helpers import random_tree_step

SETTINGS = {"none": {}, "all": {"recompute": True}, "first-1": {"recompute": True, "recompute_blocks": 1},
            "first-3": {"recompute": True, "recompute_blocks": 3}, "over": {"recompute": True, "recompute_blocks": 99}}


@pytest.fixture(scope="module")
def model_and_step():
    model = HybridModel(load_model_config("tiny"))
    model.init_weights(seed=42)
    step = random_tree_step(np.random.default_rng(42), num=6, max_len=40, vocab=3).step
    return model, step


def _run(model, step, settings):
    calls = [0] * len(model.blocks)
    hooks = [block.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
             for i, block in enumerate(model.blocks)]
    model.zero_grad(set_to_none=True)
    try:
        result = run_step(model, step, [np.arange(step.num_trajectories)], StepConfig(execution="compact", **settings))
    finally:
        for hook in hooks:
            hook.remove()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return result.loss, grads, calls


@pytest.mark.parametrize("name", SETTINGS)
def test_recomputed_blocks_and_gradients(model_and_step, name):
    model, step = model_and_step
    num_blocks = len(model.blocks)
    loss, grads, calls = _run(model, step, SETTINGS[name])
    reference_loss, reference_grads, _ = _run(model, step, SETTINGS["none"])
    recomputed = {"none": 0, "all": num_blocks, "first-1": 1, "first-3": 3, "over": num_blocks}[name]
    assert calls == [2] * recomputed + [1] * (num_blocks - recomputed)
    assert loss == reference_loss
    assert grads.keys() == reference_grads.keys()
    assert all(torch.equal(grads[k], reference_grads[k]) for k in grads)


@pytest.mark.parametrize("bad", [{"recompute_blocks": 1}, {"recompute": True, "recompute_blocks": 0},
                                 {"recompute": True, "recompute_blocks": True}],
                         ids=["without-recompute", "zero", "bool"])
def test_bad_recompute_blocks(bad):
    with pytest.raises(ValueError, match="recompute_blocks"):
        StepConfig(**bad)
