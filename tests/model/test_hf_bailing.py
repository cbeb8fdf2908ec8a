"""harts.model.hf's BailingHybrid layout: round trips, the real Ling-3.0-tiny config, and every refused input.

(The logits against transformers' BailingHybridForCausalLM are tests/model/test_hf_bailing_reference.py.)
- Round trip: bailing-tiny saved sharded, as one file, tied and in bf16, then loaded: the config equal, every tensor
  bitwise equal (bf16: its bf16 rounding; the fp32 tensors of FP32_SUFFIXES exact), the logits bitwise equal.
- Multi-token-prediction layers: stored as model.layers.{num_hidden_layers + j}.* (enorm, hnorm, eh_proj, an MLA or
  KDA decoder layer with the MoE, final_layernorm), read from num_nextn_predict_layers / num_mtp_layers,
  mtp_use_kda and mtp_loss_scaling_factor; round trips as above; declared but not stored is refused by tensor name.
- Every shipped config of the layout is expressible in it, the Hub's Ling-3.0-tiny config.json reads to the shipped
  ling3-tiny with its one MTP layer, and a model config picks its layout by `hf_layout`.
- Each unsupported config.json value is a one-line ValueError naming the file and the field; each model feature the
  layout cannot express is refused on saving, by name; the Kimi-Linear layout refuses BailingHybrid's features.
"""

import json
from dataclasses import replace

import pytest
import torch

from harts.config import shipped_configs
from harts.model.config import MTPConfig, load_model_config
from harts.model.hf import (
    architecture_for, bailing, check_exportable, hf_config_from_model, kimi, load_hf_checkpoint, model_config_from_hf,
    qwen3_5_moe, qwen3_next, save_hf_checkpoint,
)
from tests.model.test_hf import logits, random_model
from tests.model.test_hf_bailing_reference import hub_config, transformers_config


def _hub() -> dict:
    return hub_config(transformers_config())


@pytest.mark.parametrize("case", ["sharded", "tied-one-file", "bf16", "mtp-mla", "mtp-kda-bf16"])
def test_round_trip_is_bitwise(tmp_path, case):
    config = load_model_config("bailing-tiny")
    if case == "tied-one-file":
        config = replace(config, tie_embeddings=True)
    if case.startswith("mtp"):
        kind = case.split("-")[1]
        config = replace(config, mtp=MTPConfig(num_layers=2, loss_scaling_factor=0.25, layer_kind=kind))
    model = random_model(config)
    dtype = torch.bfloat16 if case.endswith("bf16") else None
    save_hf_checkpoint(model, tmp_path / "out", max_shard_bytes=20_000 if case == "sharded" else 10**9, dtype=dtype)
    loaded, loaded_config = load_hf_checkpoint(tmp_path / "out")
    assert loaded_config == config
    for (name, want), got in zip(model.state_dict().items(), loaded.state_dict().values()):
        kept = name.endswith(("A_log", "dt_bias", "_conv", "router_weight", "expert_bias"))
        expected = want if dtype is None or kept else want.to(dtype).float()
        assert torch.equal(got, expected), name
    if dtype is None:
        assert torch.equal(logits(loaded), logits(model))


@pytest.mark.parametrize("name", sorted(name for name in shipped_configs("models")
                                        if load_model_config(name).hf_layout == "bailing_hybrid"))
def test_every_shipped_bailing_config_exports(name):
    """Each shipped model config of the BailingHybrid layout is expressible in it: its config.json reads back to it."""
    config = load_model_config(name)
    assert model_config_from_hf(hf_config_from_model(config), f"{name}/config.json") == replace(config)


LING3_TINY_HUB = {
    # Ling-3.0-tiny's config.json, the values public code quotes from the Hub (configs/models/ling3-tiny.yaml).
    "architectures": ["BailingMoeV3ForCausalLM"], "model_type": "bailing_hybrid", "vocab_size": 157184,
    "hidden_size": 1536, "intermediate_size": 4608, "num_hidden_layers": 24, "num_attention_heads": 16,
    "num_key_value_heads": 16, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 6000000.0,
    "partial_rotary_factor": 0.5, "rotary_dim": 64, "rope_interleave": True, "use_qk_norm": True, "q_lora_rank": 256,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "qk_head_dim": 192, "v_head_dim": 128,
    "use_mla_nope": False, "gated_attention_proj_granularity_type": "head_wise", "layer_group_size": 4,
    "no_kda_lora": True, "kda_safe_gate": True, "kda_lower_bound": -5.0, "short_conv_kernel_size": 4,
    "num_experts": 128, "num_experts_per_tok": 8, "num_shared_experts": 1, "moe_intermediate_size": 512,
    "moe_shared_expert_intermediate_size": 512, "first_k_dense_replace": 1, "moe_router_enable_expert_bias": True,
    "norm_topk_prob": True, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc", "score_function": "sigmoid",
    "routed_scaling_factor": 2.5, "router_dtype": "fp32", "num_nextn_predict_layers": 1, "mtp_loss_scaling_factor": 0,
    "hidden_act": "silu", "tie_word_embeddings": False, "max_position_embeddings": 131072,
    "eos_token_id": 156895, "pad_token_id": 156892,
}


def test_ling3_tiny_is_the_hub_config():
    """The Hub's Ling-3.0-tiny config.json reads to the shipped ling3-tiny-mtp config (up to HARTS's training fields,
    which config.json does not carry, and the MTP loss factor: the Hub's 0, the shipped config's 0.1), with its one
    MTP layer (MLA); ling3-tiny is the same without it."""
    read = model_config_from_hf(LING3_TINY_HUB, "Ling-3.0-tiny/config.json")
    assert read.mtp == MTPConfig(num_layers=1, loss_scaling_factor=0.0, layer_kind="mla")
    for name in ("ling3-tiny-mtp", "ling3-tiny"):
        shipped = load_model_config(name)
        mtp = None if shipped.mtp is None else replace(read.mtp, loss_scaling_factor=shipped.mtp.loss_scaling_factor)
        training = dict(name=shipped.name, kda=replace(read.kda, chunk_size=shipped.kda.chunk_size),
                        moe=replace(read.moe, aux_loss_coeff=shipped.moe.aux_loss_coeff,
                                    z_loss_coeff=shipped.moe.z_loss_coeff), mtp=mtp)
        assert replace(read, **training) == shipped, name
    no_mtp = model_config_from_hf({**LING3_TINY_HUB, "num_nextn_predict_layers": 0}, "Ling-3.0-tiny/config.json")
    assert no_mtp.mtp is None


MTP_READINGS = {
    # id: (changes to the Hub config, the MTPConfig read)
    "hub-key": ({"num_nextn_predict_layers": 1}, MTPConfig(num_layers=1, loss_scaling_factor=0.0)),
    "transformers-key": ({"num_nextn_predict_layers": None, "num_mtp_layers": 2}, MTPConfig(num_layers=2,
                                                                                           loss_scaling_factor=0.0)),
    "transformers-default": ({"num_nextn_predict_layers": None}, MTPConfig(num_layers=1, loss_scaling_factor=0.0)),
    "kda-and-factor": ({"num_nextn_predict_layers": 1, "mtp_use_kda": True, "mtp_loss_scaling_factor": 0.3},
                       MTPConfig(num_layers=1, loss_scaling_factor=0.3, layer_kind="kda")),
    "none": ({"num_nextn_predict_layers": 0, "mtp_loss_scaling_factor": 0.3}, None),
}


@pytest.mark.parametrize("case", MTP_READINGS)
def test_mtp_layers_are_read(case):
    changes, expected = MTP_READINGS[case]
    assert model_config_from_hf({**_hub(), **changes}, "hub/config.json").mtp == expected


def test_a_model_config_picks_its_layout():
    assert architecture_for(load_model_config("bailing-tiny")) is bailing
    assert architecture_for(load_model_config("kimi-tiny")) is kimi
    assert architecture_for(load_model_config("tiny")) is kimi
    assert architecture_for(load_model_config("gdn-tiny")) is qwen3_next
    assert architecture_for(load_model_config("gdn-h200")) is qwen3_5_moe
    with pytest.raises(ValueError, match="model.hf_layout must be one of kimi_linear, bailing_hybrid, qwen3_next, "
                                         "qwen3_5_moe_text, got 'llama'"):
        replace(load_model_config("tiny"), hf_layout="llama")


def test_hub_config_reads_every_feature():
    config = model_config_from_hf(_hub(), "hub/config.json")
    assert config.hf_layout == "bailing_hybrid"
    assert (config.kda.full_rank_gates, config.kda.gate_lower_bound, config.kda.output_gate_bias) == (True, -5.0, False)
    assert (config.mla.output_gate, config.mla.rope_interleave, config.mla.latent_norm_eps) == (True, True, 1e-6)
    assert (config.moe.num_groups, config.moe.topk_groups, config.moe.topk_scaling_factor) == (4, 2, 2.446)
    assert config.kda.head_dim == 16 and config.mla.qk_rope_head_dim == 8 and config.layers_per_group == 2
    limits = model_config_from_hf({**_hub(), "expert_swiglu_limit_list": [0, 0, 7, 0, 5]}, "hub/config.json")
    assert limits.expert_swiglu_limits == [0, 0, 7.0, 0, 5.0] and limits.shared_expert_swiglu_limits is None


REFUSED = {
    # id: (changes to the Hub config, the field the error names, words of its reason)
    "negative-mtp": ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers", "must be >= 0, got -1"),
    "mtp-keys-disagree": ({"num_nextn_predict_layers": 1, "num_mtp_layers": 2}, "num_nextn_predict_layers",
                          "disagrees with 'num_mtp_layers'"),
    "negative-mtp-factor": ({"mtp_loss_scaling_factor": -0.5}, "mtp_loss_scaling_factor", "finite number >= 0"),
    "mtp-kda-flag": ({"num_nextn_predict_layers": 1, "mtp_use_kda": "no"}, "mtp_use_kda", "must be"),
    "ling-2.5": ({"architectures": ["BailingMoeV2_5ForCausalLM"]}, "architectures", "lightning attention"),
    "other-model-type": ({"model_type": "bailing_moe"}, "model_type", "supported: kimi_linear, bailing_hybrid"),
    "quantised": ({"quantization_config": {"bits": 4}}, "quantization_config", "quantised"),
    "gelu": ({"hidden_act": "gelu"}, "hidden_act", "SwiGLU"),
    "low-rank-kda": ({"no_kda_lora": False}, "no_kda_lora", "full-rank"),
    "halves-rope": ({"rope_interleave": False}, "rope_interleave", "interleaved"),
    "nope-mla": ({"use_mla_nope": True}, "use_mla_nope", "rotated"),
    "elementwise-gate": ({"gated_attention_proj_granularity_type": "element_wise"},
                         "gated_attention_proj_granularity_type", "one sigmoid a head"),
    "qkv-bias": ({"use_qkv_bias": True}, "use_qkv_bias", "attention_bias"),
    "dropout": ({"attention_dropout": 0.1}, "attention_dropout", "dropout"),
    "no-expert-bias": ({"moe_router_enable_expert_bias": False}, "moe_router_enable_expert_bias", "expert bias"),
    "softmax": ({"score_function": "softmax"}, "score_function", "sigmoid"),
    "greedy": ({"topk_method": "greedy"}, "topk_method", "noaux_tc"),
    "bf16-router": ({"router_dtype": "bf16"}, "router_dtype", "fp32"),
    "pregate": ({"pregate_enabled": True}, "pregate_enabled", "pre-gate"),
    "unnormalised": ({"norm_topk_prob": False}, "norm_topk_prob", "renormalised"),
    "top-1": ({"num_experts_per_tok": 1}, "num_experts_per_tok", "single weight"),
    "no-shared": ({"num_shared_experts": 0}, "num_shared_experts", "shared expert"),
    "shared-size": ({"moe_shared_expert_intermediate_size": 40}, "moe_shared_expert_intermediate_size",
                    "disagrees with 'moe_intermediate_size'"),
    "yarn": ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, r"rope_parameters\.rope_type", "default"),
    "rope-scaling": ({"rope_scaling": {"type": "linear"}}, "rope_scaling", "default"),
    "rope-theta-disagree": ({"rope_parameters": {"rope_type": "default", "rope_theta": 20.0}}, "rope_theta",
                            "disagrees"),
    "rotary-dim": ({"rotary_dim": 16}, "rotary_dim", "qk_rope_head_dim = 8"),
    "gqa": ({"num_key_value_heads": 2}, "num_key_value_heads", "KV heads"),
    "kda-heads": ({"linear_num_heads": 2}, "linear_num_heads", "disagrees with 'num_attention_heads'"),
    "dense-after-moe": ({"mlp_layer_types": ["sparse", "dense", "sparse", "sparse", "sparse"],
                         "first_k_dense_replace": None}, "mlp_layer_types", "dense layers must come first"),
    "limits-length": ({"expert_swiglu_limit_list": [0, 1.0]}, "expert_swiglu_limit_list", "must list 5"),
    "experts-disagree": ({"num_local_experts": 16}, "num_experts", "disagrees with 'num_local_experts'"),
    "missing-experts": ({"num_experts": None}, "num_experts", r"\(or 'num_local_experts'\)"),
    "harts-key": ({"harts": {"kda.head_dim": 8}}, r"harts\.kda\.head_dim", "not a HARTS training field"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_refused_config_names_file_and_field(case):
    changes, field, reason = REFUSED[case]
    hf = {**_hub(), **changes}
    with pytest.raises(ValueError, match=rf"^hub/config\.json: (missing )?field '{field}'.*{reason}") as error:
        model_config_from_hf(hf, "hub/config.json")
    assert "\n" not in str(error.value)


def test_mtp_tensor_names():
    """Ling-3's names for its MTP layers (model.layers.{num_hidden_layers + j}.*), and HARTS's tensors they fill."""
    config = replace(load_model_config("bailing-tiny"), mtp=MTPConfig(num_layers=1))
    slots = bailing.layout(config)
    n = config.num_layers
    for own in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight"):
        assert slots[f"model.layers.{n}.{own}"].target == f"mtp.layers.0.{own}"
    assert slots[f"model.layers.{n}.eh_proj.weight"].shape == (config.hidden_size, 2 * config.hidden_size)
    for stored, ours in (("input_layernorm.weight", "block.mixer_norm.weight"),
                         ("attention.kv_a_proj_with_mqa.weight", "block.mixer.kv_a_proj.weight"),
                         ("attention.dense.weight", "block.mixer.o_proj.weight"),
                         ("post_attention_layernorm.weight", "block.mlp_norm.weight"),
                         ("mlp.gate.expert_bias", "block.mlp.expert_bias"),
                         ("mlp.shared_experts.down_proj.weight", "block.mlp.shared_down_proj")):
        assert slots[f"model.layers.{n}.{stored}"].target == f"mtp.layers.0.{ours}", stored
    assert not any(name.startswith(f"model.layers.{n + 1}.") for name in slots)
    assert bailing.layout_name(f"model.layers.{n}.attention.o_proj.weight", config) == (
        f"model.layers.{n}.attention.dense.weight"), "an MLA layer's output projection under either name"


def test_declared_but_absent_mtp_layers_are_refused_by_tensor(tmp_path):
    """A checkpoint whose config.json declares an MTP layer but stores none (transformers' save_pretrained writes
    none) is refused naming the first missing MTP tensor."""
    model = random_model(load_model_config("bailing-tiny"))
    root = tmp_path / "out"
    save_hf_checkpoint(model, root)
    hf = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**hf, "num_nextn_predict_layers": 1}))
    with pytest.raises(ValueError, match=rf"missing tensor 'model\.layers\.{model.config.num_layers}\.enorm\.weight'"):
        load_hf_checkpoint(root)


def test_two_names_of_one_output_projection_are_refused(tmp_path):
    model = random_model(load_model_config("bailing-tiny"))
    save_hf_checkpoint(model, tmp_path / "out")
    from safetensors import safe_open
    from safetensors.torch import save_file

    file = tmp_path / "out" / "model.safetensors"
    with safe_open(file, "pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    tensors["model.layers.0.attention.dense.weight"] = tensors["model.layers.0.attention.o_proj.weight"].clone()
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="two names of one tensor"):
        load_hf_checkpoint(tmp_path / "out")


def test_export_refuses_what_the_layout_cannot_express():
    """tiny (HARTS's own KDA gates and MLA) has no BailingHybrid equivalent: every missing feature is named, with the
    setting to train with instead."""
    config = replace(load_model_config("tiny"), hf_layout="bailing_hybrid")
    with pytest.raises(ValueError) as error:
        check_exportable(config)
    message = str(error.value)
    for words in ("kda.full_rank_gates: true", "kda.output_gate_bias: false", "mla.rope_interleave: true",
                  "mla.output_gate: true", "configs/models/bailing-tiny.yaml"):
        assert words in message, words
    single = replace(load_model_config("bailing-tiny"), moe=replace(load_model_config("bailing-tiny").moe, top_k=1,
                                                                    num_groups=1, topk_groups=1))
    with pytest.raises(ValueError, match="moe.top_k: 1"):
        hf_config_from_model(single)


def test_kimi_layout_refuses_bailing_features():
    config = replace(load_model_config("bailing-tiny"), hf_layout="kimi_linear")
    with pytest.raises(ValueError) as error:
        check_exportable(config)
    for words in ("kda.full_rank_gates: false", "kda.gate_lower_bound: null", "mla.output_gate: false",
                  "moe.num_groups: 1", "expert_swiglu_limits: null"):
        assert words in str(error.value), words
