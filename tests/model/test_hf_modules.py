"""harts.model.hf_modules: HARTS's HybridModel on a live transformers KimiLinearForCausalLM's own tensors.

References: transformers' forward of the same model (log-probs within fp32 rounding, 1e-5 of the largest, as
tests/model/test_hf_reference.py), and harts.model.hf's checkpoint loading of the model's `save_pretrained`
(every bound tensor bitwise equal to the loaded model's, so the in-memory mapping and the checkpoint mapping
agree). Gradients reach the Hugging Face parameters and equal transformers' own (1e-4 relative per tensor);
an optimizer step on the Hugging Face parameters is seen by the next binding (no stale copy).
"""

import pytest
import torch
import transformers

from harts import api
from harts.model.config import load_model_config
from harts.model.hf import load_hf_checkpoint, save_hf_checkpoint
from harts.model.hf_modules import HFParameterView, without_moe_losses
from harts.model.model import HybridModel
from tests.fixtures import one_thread  # noqa: F401  (autouse fixture)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """transformers' KimiLinearForCausalLM of a kimi-tiny model with random weights (HARTS's init, exported)."""
    model = HybridModel(load_model_config("kimi-tiny"))
    model.init_weights(seed=11)
    with torch.no_grad():  # a visible expert bias and spread norms, so that a swapped tensor shows
        for block in model.blocks:
            if block.is_moe:
                block.mlp.expert_bias.copy_(torch.randn(block.mlp.expert_bias.shape) * 0.3)
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.mul_(1 + 0.3 * torch.randn(parameter.shape))
    path = tmp_path_factory.mktemp("kimi") / "checkpoint"
    save_hf_checkpoint(model, path)
    return transformers.AutoModelForCausalLM.from_pretrained(path)


def batch():
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 256, (3, 40), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :5] = 0  # left padding
    attention_mask[1, 30:] = 0  # right padding
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def transformers_logprobs(hf_model, data):
    logits = hf_model(**data).logits
    return torch.log_softmax(logits.float(), dim=-1)[:, :-1].gather(2, data["input_ids"][:, 1:, None])[..., 0]


def test_bound_tensors_are_the_checkpoint_loaders(hf_model, tmp_path):
    """Each HybridModel tensor bound from the live model equals, bitwise, the one harts.model.hf loads from the
    model's own `save_pretrained` (transformers' conversion to the checkpoint layout)."""
    hf_model.save_pretrained(tmp_path)
    loaded, _ = load_hf_checkpoint(tmp_path)
    expected = dict(loaded.named_parameters()) | dict(loaded.named_buffers())
    view = HFParameterView(hf_model)
    with view.bound() as model:
        bound = dict(model.named_parameters()) | dict(model.named_buffers())
    assert bound.keys() == expected.keys()
    for name, tensor in bound.items():
        assert torch.equal(tensor, expected[name]), name
    # Outside the block nothing is held.
    assert all(p.is_meta for p in view.model.parameters())


def test_logprobs_and_gradients_are_transformers(hf_model):
    data = batch()
    view = HFParameterView(hf_model)
    hf_model.zero_grad(set_to_none=True)
    with view.bound() as model:
        out = api.logprobs(model, data)
    mask = out.mask[:, 1:]
    (out.log_probs[:, 1:] * mask).sum().backward()
    got = {n: p.grad.clone() for n, p in hf_model.named_parameters() if p.grad is not None}
    hf_model.zero_grad(set_to_none=True)
    expected = transformers_logprobs(hf_model, data)
    (expected * mask).sum().backward()
    want = {n: p.grad.clone() for n, p in hf_model.named_parameters() if p.grad is not None}
    hf_model.zero_grad(set_to_none=True)

    scale = float(expected.detach().abs().max())
    assert float(((out.log_probs[:, 1:] - expected).abs() * mask).max().detach()) <= 1e-5 * scale
    assert got.keys() == want.keys() == {n for n, _ in hf_model.named_parameters()}
    assert max(float((got[n] - want[n]).norm() / want[n].norm()) for n in want) <= 1e-4


def test_an_update_is_seen_by_the_next_binding(hf_model):
    data = batch()
    view = HFParameterView(hf_model)
    with torch.no_grad():
        with view.bound() as model:
            before = api.logprobs(model, data).log_probs
        shared = hf_model.model.layers[0].mlp.gate_proj.weight  # bound through a concatenation (a copy)
        saved = shared.clone()
        shared.mul_(1.5)
        with view.bound() as model:
            after = api.logprobs(model, data).log_probs
        shared.copy_(saved)
    assert not torch.allclose(before, after)


def test_config_and_moe_losses(hf_model):
    view = HFParameterView(hf_model, config=without_moe_losses(HFParameterView(hf_model).config))
    assert view.config.moe.aux_loss_coeff == view.config.moe.z_loss_coeff == 0.0
    with torch.no_grad(), view.bound() as model:
        assert float(api.policy_loss(model, dict(batch(), loss_mask=batch()["attention_mask"] * 0,
                                                 advantages=torch.ones(3))).moe_loss) == 0.0


def test_a_model_of_another_layout_is_refused(hf_model):
    class Renamed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = hf_model.config
            self.inner = hf_model

    with pytest.raises(ValueError, match="Renamed: no tensor 'model.embed_tokens.weight'"):
        HFParameterView(Renamed())
