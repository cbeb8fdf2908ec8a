"""harts.model.hf: round trips, the real Kimi-Linear-48B config, and every refused input.

(The logits against transformers' Kimi-Linear are tests/model/test_hf_reference.py.)
- Round trip: the shipped tiny and cpu-small configs in their Kimi-Linear variant (no output-gate
  bias, NoPE MLA, latent eps 1e-6: the shipped configs themselves have a gate bias and RoPE, which
  the layout cannot express and `save_hf_checkpoint` refuses) saved sharded, as one file, tied, and
  in bf16, then loaded: the config equal, every tensor bitwise equal (bf16: equal to its bf16
  rounding, the fp32 tensors exact), the logits bitwise equal, shards within their byte budget.
- Kimi-Linear-48B-A3B's config.json maps to the architecture it describes (its 27th layer is MLA).
- Each unsupported config.json value, model feature, and each damaged checkpoint (missing, extra,
  mis-shaped or integer tensor, index naming a missing file, index and files disagreeing,
  unreadable index) is a one-line ValueError naming the file and the tensor or field.
"""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from harts.model.config import ModelConfig, load_model_config
from harts.model.hf import (
    FP32_SUFFIXES, hf_config_from_model, hf_tensor_shapes, load_hf_checkpoint, model_config_from_hf,
    save_hf_checkpoint,
)
from harts.model.model import HybridModel
from harts.runtime.layout import baseline_layout
from tests.trees.helpers import make_step


def kimi_variant(config: ModelConfig, **changes) -> ModelConfig:
    """`config` with Kimi-Linear's KDA output gate and MLA (the options that reproduce it)."""
    kda = replace(config.kda, gate_rank=config.kda.head_dim, output_gate_bias=False)
    mla = replace(config.mla, use_rope=False, latent_norm_eps=1e-6)
    return replace(config, kda=kda, mla=mla, **changes)


def random_model(config: ModelConfig, seed: int = 0) -> HybridModel:
    model = HybridModel(config)
    model.init_weights(seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith(("expert_bias", "norm.weight")):  # initialised constant: make them distinct
                tensor.add_(0.1 * torch.randn(tensor.shape, generator=generator))
    return model


def logits(model: HybridModel) -> torch.Tensor:
    rng = np.random.default_rng(7)
    step = make_step([rng.integers(0, model.config.vocab_size, n).tolist() for n in (23, 9)])
    layout = baseline_layout(step, np.arange(2), conv_size=model.config.kda.conv_size,
                             chunk_size=model.config.kda.chunk_size)
    with torch.no_grad():
        hidden, _ = model(layout.input_ids, layout)
        return model.lm_head(hidden)


ROUND_TRIPS = {
    "tiny-sharded": dict(config="tiny", max_shard_bytes=20_000),
    "tiny-tied-one-file": dict(config="tiny", tie=True),
    "cpu-small-sharded": dict(config="cpu-small", max_shard_bytes=1_000_000),
    "tiny-irregular-mla-layers": dict(config="tiny", mla_layers=[2, 3], max_shard_bytes=50_000),
}


@pytest.mark.parametrize("case", ROUND_TRIPS)
def test_round_trip_is_bitwise(tmp_path, case):
    settings = ROUND_TRIPS[case]
    changes = {"tie_embeddings": settings.get("tie", False)}
    if "mla_layers" in settings:
        changes["mla_layers"] = settings["mla_layers"]
    config = kimi_variant(load_model_config(settings["config"]), **changes)
    model = random_model(config)
    budget = settings.get("max_shard_bytes", 10**9)
    files = save_hf_checkpoint(model, tmp_path / "ckpt", max_shard_bytes=budget)
    shards = [f for f in files if f.suffix == ".safetensors"]
    index_path = tmp_path / "ckpt" / "model.safetensors.index.json"
    if "max_shard_bytes" in settings:
        assert len(shards) > 1 and index_path.is_file()
        index = json.loads(index_path.read_text())
        assert set(index["weight_map"]) == set(hf_tensor_shapes(config))
        sizes = {}
        for shard in shards:
            with safe_open(shard, "pt") as handle:
                names = list(handle.keys())
                sizes[shard] = sum(handle.get_tensor(n).nbytes for n in names)
            assert sizes[shard] <= budget or len(names) == 1, (shard, sizes[shard])
        assert index["metadata"]["total_size"] == sum(sizes.values())
    else:
        assert [f.name for f in shards] == ["model.safetensors"] and not index_path.exists()

    loaded, loaded_config = load_hf_checkpoint(tmp_path / "ckpt")
    assert loaded_config == config
    expected, actual = model.state_dict(), loaded.state_dict()
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype and torch.equal(actual[name], tensor), name
    assert (loaded.lm_head.weight is loaded.embed.weight) == config.tie_embeddings
    assert torch.equal(logits(loaded), logits(model))


def test_bf16_save_keeps_the_fp32_tensors(tmp_path):
    config = kimi_variant(load_model_config("tiny"))
    model = random_model(config)
    save_hf_checkpoint(model, tmp_path / "ckpt", dtype=torch.bfloat16)
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(tmp_path / "ckpt" / "model.safetensors", "pt") as handle:
        dtypes = {name: handle.get_slice(name).get_dtype() for name in handle.keys()}
    kept = {name for name, dtype in dtypes.items() if dtype == "F32"}
    assert kept == {name for name in dtypes if name.endswith(FP32_SUFFIXES)} and kept
    assert set(dtypes.values()) == {"F32", "BF16"}
    loaded, _ = load_hf_checkpoint(tmp_path / "ckpt")
    expected = model.state_dict()
    exact = {"A_log", "dt_bias", "router_weight", "expert_bias"}
    for name, tensor in loaded.state_dict().items():
        want = expected[name] if name.rsplit(".", 1)[-1] in exact else expected[name].bfloat16().float()
        assert torch.equal(tensor, want), name


KIMI_LINEAR_48B = {
    # moonshotai/Kimi-Linear-48B-A3B-Instruct's config.json (the fields after qk_rope_head_dim are
    # transformers' KimiLinearConfig defaults, which it documents for this checkpoint).
    "architectures": ["KimiLinearForCausalLM"], "bos_token_id": 163584, "dtype": "bfloat16",
    "eos_token_id": 163586, "first_k_dense_replace": 1, "head_dim": 72, "hidden_act": "silu", "hidden_size": 2304,
    "initializer_range": 0.02, "intermediate_size": 9216, "kv_lora_rank": 512,
    "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128,
                           "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
                           "num_heads": 32, "short_conv_kernel_size": 4},
    "mla_use_nope": True, "model_max_length": 1048576, "model_type": "kimi_linear", "moe_intermediate_size": 1024,
    "moe_layer_freq": 1, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
    "num_attention_heads": 32, "num_expert_group": 1, "num_experts": 256, "num_experts_per_token": 8,
    "num_hidden_layers": 27, "num_key_value_heads": 32, "num_nextn_predict_layers": 0, "num_shared_experts": 1,
    "pad_token_id": 163839, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-5, "routed_scaling_factor": 2.446, "tie_word_embeddings": False, "topk_group": 1,
    "use_grouped_topk": True, "v_head_dim": 128, "vocab_size": 163840,
}


def test_kimi_linear_48b_config():
    config = model_config_from_hf(KIMI_LINEAR_48B, "Kimi-Linear-48B-A3B-Instruct/config.json")
    assert config.layer_kinds() == ["mla" if i in (3, 7, 11, 15, 19, 23, 26) else "kda" for i in range(27)]
    assert (config.num_dense_layers, config.dense_hidden_size, config.norm_eps) == (1, 9216, 1e-5)
    assert (config.kda.num_heads, config.kda.head_dim, config.kda.gate_rank, config.kda.conv_size) == (32, 128, 128, 4)
    assert not config.kda.output_gate_bias and not config.mla.use_rope and config.mla.latent_norm_eps == 1e-6
    assert (config.mla.num_heads, config.mla.q_lora_rank, config.mla.kv_lora_rank) == (32, None, 512)
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.expert_hidden_size, moe.shared_expert_hidden_size) == (256, 8, 1024, 1024)
    assert (moe.score_function, moe.expert_bias, moe.topk_scaling_factor) == ("sigmoid", True, 2.446)
    shapes = hf_tensor_shapes(config)
    assert shapes["model.layers.26.self_attn.kv_a_proj_with_mqa.weight"] == (576, 2304)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (9216, 2304)
    assert shapes["model.layers.1.block_sparse_moe.experts.255.w2.weight"] == (2304, 1024)
    assert shapes["model.layers.1.self_attn.A_log"] == (1, 1, 32, 1)
    assert 49.0e9 < sum(int(np.prod(s)) for s in shapes.values()) < 49.2e9  # "48B" (49.1B counted)
    written = hf_config_from_model(config, torch.bfloat16)
    for key, value in KIMI_LINEAR_48B.items():
        if key not in ("head_dim", "model_max_length", "pad_token_id", "bos_token_id", "eos_token_id",
                       "use_grouped_topk"):
            assert written[key] == value, key


def test_mla_layers_are_validated():
    base = kimi_variant(load_model_config("tiny"))
    for bad in ([3, 1], [4], [2, 2]):
        with pytest.raises(ValueError, match="mla_layers must rise strictly"):
            replace(base, mla_layers=bad)


REFUSED_FEATURES = {
    "output-gate-bias": (lambda c: replace(c, kda=replace(c.kda, output_gate_bias=True)), "output_gate_bias"),
    "rope": (lambda c: replace(c, mla=replace(c.mla, use_rope=True)), "use_rope"),
    "gate-rank": (lambda c: replace(c, kda=replace(c.kda, gate_rank=8)), "gate_rank"),
    "latent-eps": (lambda c: replace(c, mla=replace(c.mla, latent_norm_eps=1e-5)), "latent norm eps"),
    "softmax-routing": (lambda c: replace(c, moe=replace(c.moe, score_function="softmax", expert_bias=False)),
                        "routing"),
    "no-expert-bias": (lambda c: replace(c, moe=replace(c.moe, expert_bias=False)), "routing"),
    "shared-size": (lambda c: replace(c, moe=replace(c.moe, shared_expert_hidden_size=48)),
                    "shared_expert_hidden_size"),
}


@pytest.mark.parametrize("feature", REFUSED_FEATURES)
def test_save_refuses_what_the_layout_cannot_express(tmp_path, feature):
    change, message = REFUSED_FEATURES[feature]
    model = HybridModel(change(kimi_variant(load_model_config("tiny"))))
    with pytest.raises(ValueError, match=message) as error:
        save_hf_checkpoint(model, tmp_path / "ckpt")
    assert "no Kimi-Linear equivalent" in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "ckpt").exists()


def test_shipped_configs_are_refused_by_name(tmp_path):
    """tiny and cpu-small have an output-gate bias and RoPE: not Kimi-Linear checkpoints."""
    for name in ("tiny", "cpu-small"):
        with pytest.raises(ValueError, match=f"'{name}': kda.output_gate_bias"):
            save_hf_checkpoint(HybridModel(load_model_config(name)), tmp_path / name)


def test_save_refuses_an_existing_checkpoint(tmp_path):
    model = HybridModel(kimi_variant(load_model_config("tiny")))
    save_hf_checkpoint(model, tmp_path / "ckpt")
    with pytest.raises(ValueError, match="already holds a checkpoint"):
        save_hf_checkpoint(model, tmp_path / "ckpt")


# ---------------------------------------------------------------------------------------------
# Damaged checkpoints


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A sharded tiny Kimi-Linear checkpoint, copied per test by `fresh`."""
    root = tmp_path_factory.mktemp("hf") / "ckpt"
    save_hf_checkpoint(random_model(kimi_variant(load_model_config("tiny"))), root, max_shard_bytes=60_000)
    return root


@pytest.fixture
def fresh(saved, tmp_path):
    import shutil

    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    return root


def _index(root):
    return json.loads((root / "model.safetensors.index.json").read_text())


def _write_index(root, index):
    (root / "model.safetensors.index.json").write_text(json.dumps(index))


def _rewrite_shard(root, file, edit):
    with safe_open(root / file, "pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    edit(tensors)
    save_file(tensors, str(root / file), metadata={"format": "pt"})


Q_PROJ = "model.layers.1.self_attn.q_proj.weight"


def _drop_tensor(root):
    index = _index(root)
    file = index["weight_map"].pop(Q_PROJ)
    _rewrite_shard(root, file, lambda t: t.pop(Q_PROJ))
    _write_index(root, index)
    return "model.safetensors.index.json", f"missing tensor '{Q_PROJ}'"


def _extra_tensor(root):
    index = _index(root)
    file = index["weight_map"][Q_PROJ]
    _rewrite_shard(root, file, lambda t: t.update({"model.layers.1.self_attn.bogus": torch.zeros(2)}))
    index["weight_map"]["model.layers.1.self_attn.bogus"] = file
    _write_index(root, index)
    return file, "unexpected tensor 'model.layers.1.self_attn.bogus'"


def _mis_shaped(root):
    file = _index(root)["weight_map"][Q_PROJ]
    _rewrite_shard(root, file, lambda t: t.update({Q_PROJ: t[Q_PROJ][:, :-1].contiguous()}))
    return file, f"tensor '{Q_PROJ}' has shape [32, 63], expected [32, 64]"


def _integer_tensor(root):
    file = _index(root)["weight_map"][Q_PROJ]
    _rewrite_shard(root, file, lambda t: t.update({Q_PROJ: t[Q_PROJ].long()}))
    return file, f"tensor '{Q_PROJ}' has dtype I64"


def _index_names_missing_file(root):
    index = _index(root)
    index["weight_map"][Q_PROJ] = "model-00099-of-00099.safetensors"
    _write_index(root, index)
    return "model.safetensors.index.json", f"'{Q_PROJ}' maps to model-00099-of-00099.safetensors, which does not"


def _index_omits_tensor(root):
    index = _index(root)
    file = index["weight_map"].pop(Q_PROJ)
    _write_index(root, index)
    return file, f"holds tensor '{Q_PROJ}', which model.safetensors.index.json does not assign to it"


def _index_wrong_file(root):
    index = _index(root)
    files = sorted(set(index["weight_map"].values()))
    file = index["weight_map"][Q_PROJ]
    index["weight_map"][Q_PROJ] = next(f for f in files if f != file)
    _write_index(root, index)
    return file, f"holds tensor '{Q_PROJ}', which model.safetensors.index.json does not assign to it"


def _index_not_json(root):
    (root / "model.safetensors.index.json").write_text("{not json")
    return "model.safetensors.index.json", "invalid JSON"


def _index_without_map(root):
    _write_index(root, {"metadata": {}})
    return "model.safetensors.index.json", "no 'weight_map'"


def _no_weights(root):
    for path in root.glob("model*"):
        path.unlink()
    return "ckpt", "neither model.safetensors.index.json nor model.safetensors found"


def _damaged_shard(root):
    file = _index(root)["weight_map"][Q_PROJ]
    (root / file).write_bytes(b"\x00" * 16)
    return file, "not a readable safetensors file"


DAMAGE = {
    "missing-tensor": _drop_tensor,
    "extra-tensor": _extra_tensor,
    "mis-shaped-tensor": _mis_shaped,
    "integer-tensor": _integer_tensor,
    "index-names-missing-file": _index_names_missing_file,
    "index-omits-tensor": _index_omits_tensor,
    "index-names-wrong-file": _index_wrong_file,
    "index-not-json": _index_not_json,
    "index-without-weight-map": _index_without_map,
    "no-weight-files": _no_weights,
    "damaged-shard": _damaged_shard,
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_load_rejects_a_damaged_checkpoint(fresh, damage):
    file, message = DAMAGE[damage](fresh)
    with pytest.raises(ValueError) as error:
        load_hf_checkpoint(fresh)
    text = str(error.value)
    assert "\n" not in text and file in text and message in text, text


CONFIG_ERRORS = {
    "model-type": ({"model_type": "deepseek_v3"}, "field 'model_type' = \"deepseek_v3\" is not supported"),
    "grouped-routing": ({"num_expert_group": 2}, "field 'num_expert_group' = 2"),
    "no-renormalise": ({"moe_renormalize": False}, "field 'moe_renormalize' = false"),
    "rope-mla": ({"mla_use_nope": False}, "field 'mla_use_nope' = false"),
    "nope-absent": ({"mla_use_nope": None}, "missing field 'mla_use_nope'"),
    "gelu": ({"hidden_act": "gelu"}, "field 'hidden_act' = \"gelu\""),
    "softmax-router": ({"moe_router_activation_func": "softmax"}, "field 'moe_router_activation_func'"),
    "moe-every-other-layer": ({"moe_layer_freq": 2}, "field 'moe_layer_freq' = 2"),
    "mtp": ({"num_nextn_predict_layers": 1}, "field 'num_nextn_predict_layers' = 1"),
    "quantised": ({"quantization_config": {"quant_method": "fp8"}}, "field 'quantization_config' is set"),
    "dense-model": ({"num_experts": None}, "field 'num_experts' is missing or null"),
    "kv-heads": ({"num_key_value_heads": 1}, "field 'num_key_value_heads' = 1"),
    "missing-hidden-size": ({"hidden_size": None}, "missing field 'hidden_size'"),
    "string-size": ({"hidden_size": "64"}, "field 'hidden_size' must be an integer, got '64'"),
    "bool-size": ({"hidden_size": True}, "field 'hidden_size' must be an integer, got True"),
    "layers-uncovered": ({"linear_attn_config": {"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4,
                                                 "kda_layers": [1, 2], "full_attn_layers": [4]}},
                         "field 'linear_attn_config' kda_layers and full_attn_layers must list each"),
    "unknown-harts-field": ({"harts": {"moe.num_experts": 8}}, "field 'harts.moe.num_experts' is not a HARTS"),
}


@pytest.mark.parametrize("case", CONFIG_ERRORS)
def test_load_rejects_an_unsupported_config(fresh, case):
    changes, message = CONFIG_ERRORS[case]
    config_path = fresh / "config.json"
    data = json.loads(config_path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key)
        else:
            data[key] = value
    config_path.write_text(json.dumps(data))
    with pytest.raises(ValueError) as error:
        load_hf_checkpoint(fresh)
    text = str(error.value)
    assert "\n" not in text and text.startswith(f"{config_path}: ") and message in text, text
