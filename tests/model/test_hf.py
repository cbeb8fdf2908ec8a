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
import shutil
import weakref
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

from harts.config import shipped_configs
from harts.model.config import GDN_HF_LAYOUTS, ModelConfig, load_model_config
from harts.model.hf import (
    FP32_SUFFIXES, hf_config_from_model, hf_state_dict, hf_tensor_shapes, hf_tensors, load_hf_checkpoint,
    model_config_from_hf, save_hf_checkpoint,
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
    linear = model.config.linear_attention
    layout = baseline_layout(step, np.arange(2), conv_size=linear.conv_size, chunk_size=linear.chunk_size)
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


def test_tied_embeddings_are_written_and_checked(tmp_path):
    """transformers' KimiLinearForCausalLM never ties the head: it reads lm_head.weight, so a tied model writes it
    (a copy of the embedding); a head that differs from the embedding it is tied to is refused by name, and a tied
    checkpoint without a head (Moonshot's readers tie it) still loads."""
    model = random_model(kimi_variant(load_model_config("tiny"), tie_embeddings=True))
    save_hf_checkpoint(model, tmp_path / "tied")
    with safe_open(tmp_path / "tied" / "model.safetensors", "pt") as handle:
        assert torch.equal(handle.get_tensor("lm_head.weight"), handle.get_tensor("model.embed_tokens.weight"))
    headless = tmp_path / "headless"
    shutil.copytree(tmp_path / "tied", headless)
    _rewrite_shard(headless, "model.safetensors", lambda t: t.pop("lm_head.weight"))
    loaded, _ = load_hf_checkpoint(headless)
    assert loaded.lm_head.weight is loaded.embed.weight and torch.equal(loaded.embed.weight, model.embed.weight)

    _rewrite_shard(tmp_path / "tied", "model.safetensors", lambda t: t["lm_head.weight"].mul_(1.5))
    with pytest.raises(ValueError) as error:
        load_hf_checkpoint(tmp_path / "tied")
    text = str(error.value)
    assert "model.safetensors: tensor 'lm_head.weight' differs from 'model.embed_tokens.weight'" in text, text
    assert "tie_word_embeddings" in text and "\n" not in text


class LiveFloat32(TorchDispatchMode):
    """The bytes of float32 CPU tensors that torch ops create and that are alive at once, at most (a view counts
    with its storage once): a model materialised in fp32 shows as its whole size."""

    def __init__(self) -> None:
        super().__init__()
        self.holders: dict[int, int] = {}
        self.bytes: dict[int, int] = {}
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32 and tensor.device.type == "cpu":
                key = tensor.untyped_storage().data_ptr()
                if key not in self.holders:
                    self.holders[key], self.bytes[key] = 0, tensor.untyped_storage().nbytes()
                    self.live += self.bytes[key]
                    self.peak = max(self.peak, self.live)
                self.holders[key] += 1
                weakref.finalize(tensor, self._release, key)
        return out

    def _release(self, key: int) -> None:
        self.holders[key] -= 1
        if not self.holders[key]:
            del self.holders[key]
            self.live -= self.bytes.pop(key)


def test_load_in_bf16_never_holds_an_fp32_model(tmp_path):
    """dtype=bf16 from an fp32 checkpoint: the parameters are allocated once, in bf16 on the device asked for,
    and filled tensor by tensor, so float32 memory stays within two stored tensors (a load in fp32 followed by a
    cast would hold the whole fp32 model, nine times one tensor here); the result equals that load and cast, bitwise."""
    config = kimi_variant(load_model_config("cpu-small"))
    save_hf_checkpoint(random_model(config), tmp_path / "ckpt", max_shard_bytes=1_000_000)
    largest = max(int(np.prod(shape)) for shape in hf_tensor_shapes(config).values()) * 4
    total = sum(int(np.prod(shape)) for shape in hf_tensor_shapes(config).values()) * 4
    with LiveFloat32() as tracker:
        model, _ = load_hf_checkpoint(tmp_path / "ckpt", dtype=torch.bfloat16, device="cpu")
    assert tracker.peak <= 2 * largest < total / 4, (tracker.peak, largest, total)
    tensors = model.state_dict()
    # The MoE expert bias stays fp32 under module casts (harts.model.moe), as in megatron's router.
    assert {(t.dtype, t.device.type) for name, t in tensors.items()
            if not name.endswith("expert_bias")} == {(torch.bfloat16, "cpu")}
    reference, _ = load_hf_checkpoint(tmp_path / "ckpt")
    reference.to(torch.bfloat16)
    for name, tensor in reference.state_dict().items():
        assert tensors[name].dtype == tensor.dtype and torch.equal(tensors[name], tensor), name
    assert torch.equal(logits(model).float(), logits(reference).float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_load_onto_cuda_in_bf16(tmp_path):
    config = kimi_variant(load_model_config("tiny"))
    model = random_model(config)
    save_hf_checkpoint(model, tmp_path / "ckpt")
    torch.cuda.reset_peak_memory_stats()
    loaded, _ = load_hf_checkpoint(tmp_path / "ckpt", dtype=torch.bfloat16, device="cuda")
    assert {(t.dtype, t.device.type) for name, t in loaded.state_dict().items()
            if not name.endswith("expert_bias")} == {(torch.bfloat16, "cuda")}
    bf16_bytes = sum(t.numel() * 2 for t in loaded.state_dict().values())
    assert torch.cuda.max_memory_allocated() <= 1.5 * bf16_bytes
    for name, tensor in model.to(torch.bfloat16).state_dict().items():
        assert torch.equal(loaded.state_dict()[name].cpu(), tensor), name


@pytest.mark.parametrize("option, message", [
    ({"dtype": torch.int32}, "load_hf_checkpoint: dtype must be one of"),
    ({"device": "meta"}, "load_hf_checkpoint: device 'meta' cannot hold the weights"),
])
def test_load_refuses_a_bad_dtype_or_device(tmp_path, option, message):
    save_hf_checkpoint(HybridModel(kimi_variant(load_model_config("tiny"))), tmp_path / "ckpt")
    with pytest.raises(ValueError, match=message):
        load_hf_checkpoint(tmp_path / "ckpt", **option)


STATE_DICTS = {
    "own-dtype-sharded": dict(dtype=None, max_shard_bytes=30_000),
    "bf16-one-file": dict(dtype=torch.bfloat16),
    "tied-bf16-sharded": dict(dtype=torch.bfloat16, tie=True, max_shard_bytes=30_000),
}


@pytest.mark.parametrize("case", STATE_DICTS)
def test_hf_state_dict_equals_the_saved_files(tmp_path, case):
    """The weight-sync stream and dict hold what the saver writes: the same names in file order, dtypes and bits."""
    settings = STATE_DICTS[case]
    model = random_model(kimi_variant(load_model_config("tiny"), tie_embeddings=settings.get("tie", False)))
    files = save_hf_checkpoint(model, tmp_path / "ckpt", dtype=settings["dtype"],
                               max_shard_bytes=settings.get("max_shard_bytes", 10**9))
    written = {}
    for file in files:
        if file.suffix == ".safetensors":
            with safe_open(file, "pt") as handle:
                written.update({name: handle.get_tensor(name) for name in handle.keys()})
    streamed = list(hf_tensors(model, settings["dtype"]))
    assert [name for name, _ in streamed] == list(hf_tensor_shapes(model.config))
    state = hf_state_dict(model, settings["dtype"])
    assert list(state) == [name for name, _ in streamed] and set(state) == set(written)
    for name, tensor in state.items():
        assert tensor.dtype == written[name].dtype and torch.equal(tensor, written[name]), name
        assert tensor.untyped_storage().data_ptr() not in {p.untyped_storage().data_ptr() for p in model.parameters()}


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


def transformers_schema(data: dict, *, mixed: bool) -> dict:
    """config.json `data` (Moonshot's keys, as HARTS writes them) with the keys transformers' `save_pretrained`
    writes for KimiLinear (5.25: layer_types, mlp_layer_types, linear_*; no mla_use_nope) beside Moonshot's
    (`mixed`: a Hub checkpoint that transformers loaded and saved again) or instead of them."""
    linear, layers = data["linear_attn_config"], data["num_hidden_layers"]
    written = dict(data)
    written["layer_types"] = ["full_attention" if i + 1 in linear["full_attn_layers"] else "linear_attention"
                              for i in range(layers)]
    written["mlp_layer_types"] = ["dense" if i < data["first_k_dense_replace"] else "sparse" for i in range(layers)]
    written.update(linear_num_heads=linear["num_heads"], linear_head_dim=linear["head_dim"],
                   linear_conv_kernel_dim=linear["short_conv_kernel_size"], head_dim=data["qk_rope_head_dim"],
                   qk_head_dim=data["qk_nope_head_dim"] + data["qk_rope_head_dim"])
    if not mixed:
        for key in ("linear_attn_config", "first_k_dense_replace", "mla_use_nope", "moe_layer_freq",
                    "moe_router_activation_func", "num_nextn_predict_layers"):
            del written[key]
    return written


def rename_dense_mlp(root) -> None:
    """The dense layers' MLP tensors under block_sparse_moe., as transformers' `save_pretrained` writes them."""
    index = _index(root)
    renamed = {name: name.replace(".mlp.", ".block_sparse_moe.") for name in index["weight_map"] if ".mlp." in name}
    assert renamed
    for file in set(index["weight_map"][name] for name in renamed):
        _rewrite_shard(root, file, lambda t: t.update({renamed[n]: t.pop(n) for n in list(t) if n in renamed}))
    index["weight_map"] = {renamed.get(name, name): file for name, file in index["weight_map"].items()}
    _write_index(root, index)


@pytest.mark.parametrize("schema", ["transformers", "mixed"])
def test_transformers_save_pretrained_layout_loads(saved, fresh, schema):
    """What transformers' own `save_pretrained` writes (its config keys, the dense MLP under block_sparse_moe.)
    loads into the model the Hub layout gives (the files transformers writes are read in test_hf_reference)."""
    config_path = fresh / "config.json"
    written = transformers_schema(json.loads(config_path.read_text()), mixed=schema == "mixed")
    config_path.write_text(json.dumps(written))
    rename_dense_mlp(fresh)
    expected, expected_config = load_hf_checkpoint(saved)
    model, config = load_hf_checkpoint(fresh)
    assert config == expected_config
    for name, tensor in expected.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


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


@pytest.mark.parametrize("name", sorted(name for name in shipped_configs("models")
                                        if load_model_config(name).hf_layout in ("kimi_linear", *GDN_HF_LAYOUTS)))
def test_every_shipped_config_exports_or_names_its_fix(tmp_path, name):
    """Each shipped model config of the Kimi-Linear layout or of the Gated DeltaNet family's either exports
    (kimi-tiny and gdn-tiny: round trip bitwise; gdn-h200, 11B parameters, not allocated: its config.json reads back
    to its config and its layout covers every parameter) or is refused in one line naming every field the layout
    cannot express and the settings that would (the weights cannot be converted). (The BailingHybrid layout's
    configs: tests/model/test_hf_bailing.py.)"""
    config = load_model_config(name)
    blockers = {"kda.output_gate_bias: true": "kda.output_gate_bias: false",
                "mla.use_rope: true": "mla.use_rope: false"}
    kda, mla = config.kda, config.mla
    present = {field for field, flag in (("kda.output_gate_bias: true", kda is not None and kda.output_gate_bias),
                                         ("mla.use_rope: true", mla is not None and mla.use_rope
                                          and mla.qk_rope_head_dim))
               if flag}
    if not present:
        with torch.device("meta"):
            size = sum(p.numel() for p in HybridModel(config).parameters())
        if size > 10**8:
            assert model_config_from_hf(hf_config_from_model(config), f"{name}/config.json") == config
            assert sum(int(np.prod(shape)) for shape in hf_tensor_shapes(config).values()) == size
            return
        model = random_model(config)
        save_hf_checkpoint(model, tmp_path / name)
        loaded, loaded_config = load_hf_checkpoint(tmp_path / name)
        assert loaded_config == model.config and torch.equal(logits(loaded), logits(model))
        return
    with torch.device("meta"):
        model = HybridModel(config)
    with pytest.raises(ValueError) as error:
        save_hf_checkpoint(model, tmp_path / name)
    text = str(error.value)
    assert text.startswith(f"model config '{name}': ") and "\n" not in text and "no Kimi-Linear equivalent" in text
    for field in present:
        assert field in text and blockers[field] in text, text
    assert "configs/models/kimi-tiny.yaml" in text and not (tmp_path / name).exists()


def test_a_failed_save_leaves_no_checkpoint(tmp_path, monkeypatch):
    """A write that fails mid-way (a full disk at the second shard) removes the shards already written and the
    directories the save made; a save that is killed leaves no config.json, which every reader needs."""
    import safetensors.torch

    written = []
    real = safetensors.torch.save_file

    def save_file(tensors, filename, metadata=None):
        if written:
            raise OSError(28, "No space left on device")
        written.append(filename)
        real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    root = tmp_path / "new" / "ckpt"
    with pytest.raises(OSError, match=r"model-00002-of-\d{5}.safetensors: could not write \(No space left on device\)"):
        save_hf_checkpoint(random_model(kimi_variant(load_model_config("tiny"))), root, max_shard_bytes=60_000)
    assert written and not (tmp_path / "new").exists()


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


def _dense_mlp_twice(root):
    name = "model.layers.0.mlp.gate_proj.weight"
    index = _index(root)
    file = index["weight_map"][name]
    alias = name.replace(".mlp.", ".block_sparse_moe.")
    _rewrite_shard(root, file, lambda t: t.update({alias: t[name].clone()}))
    index["weight_map"][alias] = file
    _write_index(root, index)
    return file, "two names of one tensor"


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
    "dense-mlp-under-both-names": _dense_mlp_twice,
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
    # Moonshot's keys beside transformers' (a Hub checkpoint re-saved by transformers): they must agree.
    "layer-types-disagree": ({"layer_types": ["linear_attention", "full_attention", "linear_attention",
                                              "full_attention"]},
                             "field 'layer_types' has full attention at layers [2, 4], 'linear_attn_config' at [4]"),
    "layer-types-unknown-kind": ({"layer_types": ["linear_attention"] * 3 + ["sliding_attention"]},
                                 "field 'layer_types' must list 4 entries, each 'linear_attention' or"),
    "layer-types-too-short": ({"layer_types": ["linear_attention"] * 3}, "field 'layer_types' must list 4 entries"),
    "mlp-layer-types-disagree": ({"mlp_layer_types": ["dense", "dense", "sparse", "sparse"]},
                                 "field 'first_k_dense_replace' = 1 disagrees with 'mlp_layer_types' = 2"),
    "dense-after-sparse": ({"mlp_layer_types": ["dense", "sparse", "dense", "sparse"]},
                           "field 'mlp_layer_types' = [\"dense\", \"sparse\", \"dense\", \"sparse\"] is not supported"),
    "linear-heads-disagree": ({"linear_num_heads": 4},
                              "field 'linear_num_heads' = 4 disagrees with 'linear_attn_config.num_heads' = 2"),
    "no-layer-kinds": ({"linear_attn_config": None},
                       "missing field 'linear_attn_config' (Moonshot's config) or 'layer_types' (transformers')"),
    "no-dense-count": ({"first_k_dense_replace": None},
                       "missing field 'first_k_dense_replace' (Moonshot's config) or 'mlp_layer_types'"),
    # transformers' keys alone: its KimiLinear never rotates, so mla_use_nope may be absent but not false.
    "transformers-rope": ({**{key: None for key in ("linear_attn_config", "first_k_dense_replace")},
                           "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                           "mlp_layer_types": ["dense"] + ["sparse"] * 3, "linear_num_heads": 2, "linear_head_dim": 16,
                           "linear_conv_kernel_dim": 4, "mla_use_nope": False}, "field 'mla_use_nope' = false"),
    "transformers-no-kda-heads": ({"linear_attn_config": None,
                                   "layer_types": ["linear_attention"] * 3 + ["full_attention"]},
                                  "missing field 'linear_num_heads'"),
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
