"""apply_update: clip, AdamW step and schedule step on a finite gradient norm; a non-finite one is a ValueError
naming the step, raised before any parameter, optimizer state or learning rate changes."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from harts.optim.adamw import MasterWeightAdamW, make_scheduler
from harts.optim.config import OptimizerConfig, ScheduleConfig
from harts.optim.update import apply_update


def _learner():
    torch.manual_seed(42)
    layer = nn.Linear(4, 3)
    optimizer = MasterWeightAdamW(layer.named_parameters(), OptimizerConfig(lr=0.1))
    scheduler = make_scheduler(optimizer, ScheduleConfig(warmup_steps=2), num_steps=4)
    # A model without MoE layers: update_expert_biases has no layer to update.
    return layer, SimpleNamespace(blocks=[], mtp=None), optimizer, scheduler


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_non_finite_gradient_norm_changes_nothing(bad):
    layer, model, optimizer, scheduler = _learner()
    layer(torch.ones(2, 4)).sum().backward()
    layer.weight.grad[0, 0] = bad
    before = [p.detach().clone() for p in layer.parameters()]
    with pytest.raises(ValueError, match=r"^step 3 \(x\): the gradient norm is (nan|inf)$"):
        apply_update(model, optimizer, scheduler, 1.0, [], "step 3 (x)")
    assert all(torch.equal(p, b) for p, b in zip(layer.parameters(), before))
    assert scheduler.last_epoch == 0 and not optimizer.optimizer.state


def test_a_finite_gradient_norm_steps_the_optimizer_and_the_schedule():
    layer, model, optimizer, scheduler = _learner()
    layer(torch.ones(2, 4)).sum().backward()
    expected = float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in layer.parameters()])))
    before = layer.weight.detach().clone()
    assert apply_update(model, optimizer, scheduler, 1.0, [], "step 1") == pytest.approx(expected, rel=1e-6)
    assert not torch.equal(layer.weight, before)
    assert scheduler.last_epoch == 1 and scheduler.get_last_lr()[0] == pytest.approx(0.1)


@pytest.mark.parametrize("with_mtp_counts", [True, False], ids=["all-layers", "decoder-only"])
def test_expert_biases_of_the_mtp_layers(with_mtp_counts):
    """The MTP layers' counts follow the decoder's; counts of the decoder's layers alone leave the MTP layers' biases
    as they are."""
    from dataclasses import replace

    from harts.model.config import MTPConfig, load_model_config
    from harts.model.model import HybridModel
    from harts.model.moe import updated_expert_bias
    from harts.optim.update import update_expert_biases

    config = load_model_config("tiny")
    model = HybridModel(replace(config, mtp=MTPConfig(num_layers=2)))
    model.init_weights(seed=0)
    layers = [b.mlp for b in model.blocks if b.is_moe] + [layer.block.mlp for layer in model.mtp.layers]
    num_decoder = len(layers) - 2
    generator = torch.Generator().manual_seed(0)
    counts = [torch.randint(0, 9, (config.moe.num_experts,), generator=generator).float() for _ in layers]
    counts = counts if with_mtp_counts else counts[:num_decoder]
    before = [layer.expert_bias.clone() for layer in layers]
    update_expert_biases(model, counts)
    rate = config.moe.bias_update_rate
    for i, layer in enumerate(layers):
        expected = updated_expert_bias(counts[i], before[i], rate) if i < len(counts) else before[i]
        assert torch.equal(layer.expert_bias, expected), i
        if i < len(counts):
            assert not torch.equal(expected, before[i]), i  # its counts moved it
