"""harts.model.hf's Gated DeltaNet layouts (Qwen3-Next, Qwen3.5-MoE text) on their own: round trips bitwise
(one file, sharded, tied, irregular attention layers, unnormalised routing, Qwen3.5), the fp32 tensors of a bf16
save, transformers' default Qwen3.5-35B-A3B config read to its sizes, and one check per refused config.json field
and per feature a save cannot express (transformers' own classes: tests/model/test_hf_qwen3_next.py)."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors import safe_open

from harts.model.config import load_model_config
from harts.model.hf import (
    hf_config_from_model, hf_tensor_shapes, load_hf_checkpoint, model_config_from_hf, save_hf_checkpoint,
)
from harts.model.hf.qwen3_next import FP32_SUFFIXES
from harts.model.model import HybridModel
from tests.model.test_hf import logits, random_model


def gdn_variant(**changes):
    return replace(load_model_config("gdn-tiny"), **changes)


def qwen35(**changes):
    return gdn_variant(num_dense_layers=0, dense_hidden_size=0, hf_layout="qwen3_5_moe_text", **changes)


def _moe(**changes):
    return replace(load_model_config("gdn-tiny").moe, **changes)


ROUND_TRIPS = {
    "gdn-tiny-one-file": (gdn_variant, {}, None),
    "gdn-tiny-sharded-tied": (gdn_variant, {"tie_embeddings": True}, 20_000),
    "irregular-attention-unnormalised": (gdn_variant, {"mla_layers": [1, 2], "moe": _moe(softmax_before_topk=True)},
                                         30_000),
    "qwen3.5-sharded": (qwen35, {}, 20_000),
}


@pytest.mark.parametrize("case", ROUND_TRIPS)
def test_round_trip_is_bitwise(tmp_path, case):
    make, changes, budget = ROUND_TRIPS[case]
    config = make(**changes)
    model = random_model(config)
    files = save_hf_checkpoint(model, tmp_path / "ckpt", max_shard_bytes=budget or 10**9)
    assert (len([f for f in files if f.suffix == ".safetensors"]) > 1) == (budget is not None)
    hf = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert hf["model_type"] == config.hf_layout
    loaded, loaded_config = load_hf_checkpoint(tmp_path / "ckpt")
    assert loaded_config == config
    expected, actual = model.state_dict(), loaded.state_dict()
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name
    assert torch.equal(logits(loaded), logits(model))


def test_bf16_save_keeps_the_decay_parameters_fp32(tmp_path):
    model = random_model(gdn_variant())
    save_hf_checkpoint(model, tmp_path / "ckpt", dtype=torch.bfloat16)
    with safe_open(tmp_path / "ckpt" / "model.safetensors", "pt") as handle:
        dtypes = {name: handle.get_slice(name).get_dtype() for name in handle.keys()}
    kept = {name for name, dtype in dtypes.items() if dtype == "F32"}
    assert kept == {name for name in dtypes if name.endswith(FP32_SUFFIXES)} and len(kept) == 6


def test_transformers_default_qwen3_5_config_is_35b_a3b():
    """transformers' `Qwen3_5MoeTextConfig()` (Qwen3.5-35B-A3B's text model) read into HARTS's sizes: 40 layers,
    GDN 16 key heads × 128 with 32 value heads × 128, gated GQA 16 heads over 2 KV heads of 256 with 64 rotated,
    256 experts top-8 of 512 and a gated shared expert of 512; 35B parameters, 3B active."""
    import transformers

    hf = transformers.Qwen3_5MoeTextConfig().to_dict()
    config = model_config_from_hf(hf, "Qwen3.5-35B-A3B/config.json")
    assert (config.num_layers, config.hidden_size, config.vocab_size, config.layers_per_group) == (40, 2048, 248320, 4)
    gdn, attention, moe = config.gdn, config.gated_attention, config.moe
    assert (gdn.num_key_heads, gdn.num_value_heads, gdn.key_head_dim, gdn.value_head_dim) == (16, 32, 128, 128)
    assert (attention.num_heads, attention.num_kv_heads, attention.head_dim, attention.rotary_dim) == (16, 2, 256, 64)
    assert (moe.num_experts, moe.top_k, moe.expert_hidden_size, moe.shared_expert_hidden_size) == (256, 8, 512, 512)
    total = sum(int(np.prod(shape)) for shape in hf_tensor_shapes(config).values())
    expert = 3 * config.hidden_size * moe.expert_hidden_size
    active = total - config.num_layers * (moe.num_experts - moe.top_k) * expert
    assert 34.0e9 < total < 36.0e9 and 2.5e9 < active < 3.5e9, (total, active)


REFUSED_FEATURES = {
    "plain-norms": (gdn_variant(norm_zero_centered=False), "norm_zero_centered: true"),
    "sigmoid-routing": (gdn_variant(moe=_moe(score_function="sigmoid", expert_bias=True)),
                        "moe.score_function: softmax"),
    "ungated-shared-expert": (gdn_variant(moe=_moe(shared_expert_gate=False)), "moe.shared_expert_gate: true"),
    "qwen3.5-dense-layer": (gdn_variant(hf_layout="qwen3_5_moe_text"), "num_dense_layers: 0"),
    "qwen3.5-unnormalised": (qwen35(moe=_moe(softmax_before_topk=True)), "moe.softmax_before_topk: false"),
}


@pytest.mark.parametrize("feature", REFUSED_FEATURES)
def test_save_refuses_what_the_layout_cannot_express(tmp_path, feature):
    config, setting = REFUSED_FEATURES[feature]
    with torch.device("meta"):
        model = HybridModel(config)
    with pytest.raises(ValueError) as error:
        save_hf_checkpoint(model, tmp_path / "ckpt")
    text = str(error.value)
    assert "\n" not in text and setting in text and "configs/models/gdn-tiny.yaml" in text, text
    assert not (tmp_path / "ckpt").exists()


CONFIG_ERRORS = {
    "activation": ({"hidden_act": "gelu"}, "field 'hidden_act' = \"gelu\" is not supported"),
    "attention-bias": ({"attention_bias": True}, "field 'attention_bias' = true is not supported"),
    "dropout": ({"attention_dropout": 0.1}, "field 'attention_dropout' is not 0"),
    "mtp": ({"mtp_num_hidden_layers": 1}, "field 'mtp_num_hidden_layers' is not 0"),
    "dense-model": ({"num_experts": 0}, "field 'num_experts' is 0"),
    "sparse-step": ({"decoder_sparse_step": 2}, "field 'decoder_sparse_step' = 2 is not supported"),
    "dense-layer-later": ({"mlp_only_layers": [2]}, "field 'mlp_only_layers' = [2] is not supported"),
    "no-shared-expert": ({"shared_expert_intermediate_size": 0}, "field 'shared_expert_intermediate_size' is 0"),
    "top-1-normalised": ({"num_experts_per_tok": 1}, "field 'num_experts_per_tok' = 1 with renormalised"),
    "yarn": ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
             "field 'rope_type' = \"yarn\" is not supported"),
    "rope-scaling": ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "field 'rope_scaling' is set"),
    "quantised": ({"quantization_config": {"quant_method": "fp8"}}, "field 'quantization_config' is set"),
    "value-heads": ({"linear_num_value_heads": 3}, "gdn.num_value_heads (3) must be a multiple of num_key_heads (2)"),
    "missing-key-heads": ({"linear_num_key_heads": None}, "missing field 'linear_num_key_heads'"),
    "odd-rotary": ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.3125}},
                   "gated_attention.rotary_dim must be an even integer"),
    "layer-types": ({"layer_types": ["linear_attention"] * 3}, "field 'layer_types' must list 4 entries"),
    "unknown-harts-field": ({"harts": {"gdn.num_key_heads": 4}}, "field 'harts.gdn.num_key_heads' is not a HARTS"),
    "wrong-model-type": ({"model_type": "qwen3_5_moe"}, "field 'model_type' = \"qwen3_5_moe\" is not supported"),
}


@pytest.mark.parametrize("case", CONFIG_ERRORS)
def test_load_rejects_an_unsupported_config(tmp_path, case):
    save_hf_checkpoint(random_model(gdn_variant()), tmp_path / "ckpt")
    changes, message = CONFIG_ERRORS[case]
    config_path = tmp_path / "ckpt" / "config.json"
    data = json.loads(config_path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key)
        else:
            data[key] = value
    config_path.write_text(json.dumps(data))
    with pytest.raises(ValueError) as error:
        load_hf_checkpoint(tmp_path / "ckpt")
    text = str(error.value)
    assert "\n" not in text and text.startswith(f"{config_path}: ") and message in text, text


def test_config_json_names_transformers_class():
    for config, architecture in ((gdn_variant(), "Qwen3NextForCausalLM"), (qwen35(), "Qwen3_5MoeForCausalLM")):
        hf = hf_config_from_model(config)
        assert hf["architectures"] == [architecture] and hf["harts"]["name"] == "gdn-tiny"
        assert hf["rope_parameters"]["partial_rotary_factor"] == 0.25
