"""harts.model.hf_modules: HARTS's HybridModel on a live transformers model's own tensors, for each architecture.

Models: tiny configs built by transformers (those of tests/model/test_hf_reference.py, test_hf_bailing_reference.py
and test_hf_qwen3_next.py) with those files' random weights: `KimiLinearForCausalLM`; `BailingHybridForCausalLM` with
low-rank queries, the gated MLA, group-limited routing (2 of 4 groups), a dense first layer and a shared expert, and
once with full-rank queries, MLA biases, two shared experts, SwiGLU limits that clip and two dense layers;
`Qwen3NextForCausalLM` (GDN with grouped values, gated GQA with partial rotary, the gated shared expert, a dense
first layer), once with tied embeddings; `Qwen3_5MoeForCausalLM`.

References: transformers' forward of the same model (logits within 1e-5 of the largest, fp32, each sequence alone
and in batches padded on either side, as the reference tests); harts.model.hf's checkpoint loading of the model's
`save_pretrained` (every bound tensor bitwise equal to the loaded model's, so the in-memory mapping and the
checkpoint mapping agree); the loaded model's gradients of the same log-probs (each Hugging Face parameter's
gradient, made into HARTS's tensors by the view's own mapping, within 1e-5 relative of the loaded model's: the same
computation on the same values, measured 0 for the GDN family and up to 9.0e-7 where the bound experts are transposed
views) and transformers' own backward (1e-4 relative per tensor; measured 2.9e-6 to 2.4e-5). Measured logits: 1.0e-6
to 4.7e-6 of the largest from transformers'. An optimizer step on the
Hugging Face parameters is seen by the next binding (no stale copy), also through the tensors bound by a copy.
BailingHybrid's MTP layers: transformers' model holds none, so the view binds the decoder (refusing a HARTS config
with MTP layers, and a module tree that holds MTP tensors, by name).
"""

import dataclasses

import numpy as np
import pytest
import torch
import transformers

from harts import api
from harts.model.hf import load_hf_checkpoint
from harts.model.hf_modules import HFParameterView, hf_model_config, without_moe_losses
from tests.fixtures import one_thread  # noqa: F401  (autouse fixture)
from tests.model import test_hf_bailing_reference as bailing_reference
from tests.model import test_hf_qwen3_next as qwen_reference
from tests.model import test_hf_reference as kimi_reference
from tests.model.test_hf_reference import PADDINGS, TRANSFORMERS_TOLERANCE, harts_logits, max_error, padded_logits

CASES = {
    # id: (a transformers model of a tiny config with random weights, a tensor bound through a copy)
    "kimi": (lambda: kimi_reference.transformers_model(kimi_reference.transformers_config(q_lora_rank=16), seed=5),
             "model.layers.0.mlp.gate_proj.weight"),
    "bailing-gated-mla-group-routing": (
        lambda: bailing_reference.transformers_model(bailing_reference.transformers_config(), seed=5),
        "model.layers.1.mlp.shared_experts.up_proj.weight"),
    "bailing-mla-bias-two-shared-clipped-two-dense": (
        lambda: bailing_reference.transformers_model(bailing_reference.transformers_config(
            q_lora_rank=None, attention_bias=True, n_shared_experts=2, first_k_dense_replace=2,
            swiglu_limits=[0, 0, 0.5, 0, 0.8], swiglu_limits_shared=[0, 0, 0.3, 0, 0.6]), seed=5),
        "model.layers.1.mlp.up_proj.weight"),
    "qwen3-next": (lambda: qwen_reference.transformers_model(qwen_reference.transformers_config("qwen3_next"), seed=5),
                   "model.layers.1.linear_attn.in_proj_ba.weight"),
    "qwen3-next-tied": (lambda: qwen_reference.transformers_model(qwen_reference.transformers_config(
        "qwen3_next", tie_word_embeddings=True), seed=5), "model.layers.2.mlp.shared_expert.gate_proj.weight"),
    "qwen3.5-moe": (lambda: qwen_reference.transformers_model(qwen_reference.transformers_config(
        "qwen3_5_moe_text"), seed=5), "model.layers.0.linear_attn.in_proj_z.weight"),
}


@pytest.fixture(scope="module", params=CASES)
def case(request):
    """(case id, the transformers model, the name of a tensor the view binds through a copy)."""
    make, copied = CASES[request.param]
    return request.param, make(), copied


def sequences(vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, vocab_size, n).tolist() for n in (70, 37, 5)]


def batch(vocab_size: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab_size, (3, 40), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :5] = 0  # left padding
    attention_mask[1, 30:] = 0  # right padding
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def transformers_logprobs(hf_model, data):
    logits = hf_model(**data).logits
    return torch.log_softmax(logits.float(), dim=-1)[:, :-1].gather(2, data["input_ids"][:, 1:, None])[..., 0]


def every_tensor(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))


def test_logits_are_transformers(case):
    _, hf_model, _ = case
    data = sequences(hf_model.config.vocab_size)
    with torch.no_grad(), HFParameterView(hf_model).bound() as model:
        actual = harts_logits(model, data)
    for side in PADDINGS:
        expected = padded_logits(hf_model, data, side)
        assert max_error(actual, expected) <= TRANSFORMERS_TOLERANCE, side


def test_bound_tensors_are_the_checkpoint_loaders(case, tmp_path):
    """Each HybridModel tensor bound from the live model equals, bitwise, the one harts.model.hf loads from the
    model's own `save_pretrained` (transformers' conversion to the checkpoint layout)."""
    _, hf_model, _ = case
    hf_model.save_pretrained(tmp_path)
    loaded, _ = load_hf_checkpoint(tmp_path)
    expected = every_tensor(loaded)
    view = HFParameterView(hf_model)
    with view.bound() as model:
        bound = every_tensor(model)
    assert bound.keys() == expected.keys()
    for name, tensor in bound.items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name
    # Outside the block nothing is held.
    assert all(p.is_meta for p in view.model.parameters())


def test_gradients_are_the_loaded_models_and_transformers(case, tmp_path):
    _, hf_model, _ = case
    data = batch(hf_model.config.vocab_size)
    view = HFParameterView(hf_model)
    hf_model.zero_grad(set_to_none=True)
    with view.bound() as model:
        out = api.logprobs(model, data)
    mask = out.mask[:, 1:]
    (out.log_probs[:, 1:] * mask).sum().backward()
    got = {n: p.grad.clone() for n, p in hf_model.named_parameters(remove_duplicate=False) if p.grad is not None}
    hf_model.zero_grad(set_to_none=True)

    hf_model.save_pretrained(tmp_path)
    loaded, _ = load_hf_checkpoint(tmp_path)
    loaded_out = api.logprobs(loaded, data)
    (loaded_out.log_probs[:, 1:] * mask).sum().backward()
    # The view's own mapping turns the Hugging Face gradients into HARTS's tensors (each source is a
    # rearrangement: every element lands in exactly one place).
    sources = view._sources
    parameters = dict(loaded.named_parameters(remove_duplicate=False))
    assert set(parameters) | {n for n, _ in loaded.named_buffers()} == set(sources)
    for name, parameter in parameters.items():
        mapped = sources[name](got.__getitem__)
        assert float((mapped - parameter.grad).norm() / parameter.grad.norm()) <= 1e-5, name

    expected = transformers_logprobs(hf_model, data)
    (expected * mask).sum().backward()
    want = {n: p.grad.clone() for n, p in hf_model.named_parameters(remove_duplicate=False) if p.grad is not None}
    hf_model.zero_grad(set_to_none=True)
    scale = float(expected.detach().abs().max())
    assert float(((out.log_probs[:, 1:] - expected).abs() * mask).max().detach()) <= 1e-5 * scale
    assert got.keys() == want.keys() == {n for n, _ in hf_model.named_parameters(remove_duplicate=False)}
    assert max(float((got[n] - want[n]).norm() / want[n].norm()) for n in want) <= 1e-4


def test_an_update_is_seen_by_the_next_binding(case):
    _, hf_model, copied = case
    data = batch(hf_model.config.vocab_size)
    view = HFParameterView(hf_model)
    parameters = dict(hf_model.named_parameters())
    with torch.no_grad():
        with view.bound() as model:
            before = api.logprobs(model, data).log_probs
        for name in (copied, "model.layers.1.post_attention_layernorm.weight"):  # a copy, then a view
            saved = parameters[name].clone()
            parameters[name].mul_(1.5)
            with view.bound() as model:
                after = api.logprobs(model, data).log_probs
            parameters[name].copy_(saved)
            assert not torch.allclose(before, after), name


def test_config_and_moe_losses(case):
    _, hf_model, _ = case
    view = HFParameterView(hf_model, config=without_moe_losses(hf_model_config(hf_model)))
    assert view.config.moe.aux_loss_coeff == view.config.moe.z_loss_coeff == 0.0
    data = batch(hf_model.config.vocab_size)
    with torch.no_grad(), view.bound() as model:
        result = api.policy_loss(model, dict(data, loss_mask=data["attention_mask"] * 0, advantages=torch.ones(3)))
    assert float(result.moe_loss) == 0.0


@pytest.fixture(scope="module")
def bailing_with_mtp():
    """transformers' BailingHybridForCausalLM of a config declaring one MTP layer (as the Hub's Ling-3 configs)."""
    config = bailing_reference.transformers_config(num_mtp_layers=1)
    return bailing_reference.transformers_model(config, seed=5)


def test_bailing_mtp_layers_are_not_bound(bailing_with_mtp):
    """transformers' model holds no MTP layers (its config keeps num_mtp_layers 1): the view binds the decoder, to
    transformers' logits; a HARTS config with the MTP layer is refused by name."""
    hf_model = bailing_with_mtp
    assert hf_model.config.num_mtp_layers == 1
    assert not any(name.startswith(f"model.layers.{hf_model.config.num_hidden_layers}.")
                   for name, _ in hf_model.named_parameters())
    view = HFParameterView(hf_model)
    assert view.config.mtp is None and view.model.mtp is None
    data = sequences(hf_model.config.vocab_size)
    with torch.no_grad(), view.bound() as model:
        actual = harts_logits(model, data)
    assert max_error(actual, padded_logits(hf_model, data, None)) <= TRANSFORMERS_TOLERANCE
    from harts.model.hf import model_config_from_hf

    declared = model_config_from_hf(hf_model.config.to_dict(), "config")
    assert declared.mtp is not None and dataclasses.replace(declared, mtp=None) == view.config
    with pytest.raises(ValueError, match="BailingHybridForCausalLM: HARTS's model config '.*' has 1 MTP layers, "
                                         "which transformers' BailingHybridForCausalLM does not hold"):
        HFParameterView(hf_model, config=declared)


def test_a_module_tree_with_mtp_tensors_is_refused(bailing_with_mtp):
    """Another implementation that holds the MTP layer (e.g. remote code) has tensors the decoder has no place
    for: refused, naming the first."""
    hf_model = bailing_with_mtp
    extra = torch.nn.Module()
    extra.enorm = torch.nn.Linear(1, hf_model.config.hidden_size, bias=False)
    hf_model.model.layers.append(extra)
    try:
        with pytest.raises(ValueError, match=r"BailingHybridForCausalLM: tensor 'model\.layers\.5\.enorm\.weight' "
                                             r"has no place in HARTS's model \(1 unread\)"):
            HFParameterView(hf_model)
    finally:
        del hf_model.model.layers[-1]


def test_another_model_type_or_layout_is_refused(case):
    name, hf_model, _ = case

    class Renamed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = hf_model.config
            self.inner = hf_model

    with pytest.raises(ValueError, match="Renamed: no tensor 'model.embed_tokens.weight' .*module layout"):
        HFParameterView(Renamed())
    other = kimi_reference.transformers_config() if not name.startswith("kimi") else (
        bailing_reference.transformers_config())
    with pytest.raises(ValueError, match=f"{type(hf_model).__name__}: HARTS's model config .* is of the "
                                         f".* layout, the model of {hf_model.config.model_type}"):
        HFParameterView(hf_model, config=hf_model_config(_configured(other)))


def _configured(config):
    """A stand-in with only a transformers config (hf_model_config reads nothing else)."""
    holder = torch.nn.Module()
    holder.config = config
    return holder


def test_an_unsupported_model_type_is_refused():
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM: model_type 'llama' has no HARTS module layout "
                                         r"\(supported: KimiLinearForCausalLM \(kimi_linear\), "
                                         r"BailingHybridForCausalLM \(bailing_hybrid\), Qwen3NextForCausalLM "
                                         r"\(qwen3_next\), Qwen3_5MoeForCausalLM \(qwen3_5_moe_text\)\)"):
        HFParameterView(transformers.LlamaForCausalLM(config))
