"""Hugging Face checkpoints in Kimi-Linear's layout: `config.json` + safetensors, sharded or not.

Kimi-Linear (Moonshot AI, e.g. moonshotai/Kimi-Linear-48B-A3B-Instruct; `model_type`
"kimi_linear", `KimiLinearForCausalLM`) is the public KDA + MLA + MoE architecture HARTS's
`HybridModel` belongs to. This module provides:
- `load_hf_checkpoint(path) -> (HybridModel, ModelConfig)`: a checkpoint directory (config.json
  and model.safetensors, or model-XXXXX-of-YYYYY.safetensors shards listed by
  model.safetensors.index.json) into an fp32 model on the CPU;
- `save_hf_checkpoint(model, path, max_shard_bytes=..., dtype=None)`: the inverse, into a new
  directory (one file, or shards + index when the tensors exceed `max_shard_bytes`);
- `model_config_from_hf(hf_config, where)` and `hf_config_from_model(config)`: config.json <->
  `ModelConfig`; `hf_tensor_shapes(config)`: every tensor of the layout with its shape.

Tensor names and shapes are those of Moonshot's modeling_kimi.py, which transformers (>= 5.24,
`kimi_linear`) reads through its conversion mapping (model.layers.{i}.self_attn.q_conv1d.weight,
.block_sparse_moe.experts.{e}.w1.weight, ...). How they become `HybridModel` parameters:
- KDA: q/k/v/b/o projections as they are; {q,k,v}_conv1d [C, 1, W] -> {q,k,v}_conv [C, W] (the
  last column multiplies the row itself in both); A_log [1, 1, H, 1] -> [H]; f_a/f_b_proj ->
  f_proj[0]/[1], g_a/g_b_proj -> g_proj[0]/[1] (rank = head_dim); o_norm is the gated RMSNorm's weight.
- MLA: q_proj (or, with q_lora_rank, which transformers reads but Moonshot's code refuses:
  q_a_proj, q_a_layernorm, q_b_proj -> q_proj[0], [1], [2]), kv_a_proj_with_mqa -> kv_a_proj,
  kv_a_layernorm -> kv_norm, kv_b_proj, o_proj.
- MoE: gate.weight -> router_weight, gate.e_score_correction_bias -> expert_bias; experts.{e}.w1
  (gate) and w3 (up) [F, D] -> gate_up_proj[e] [D, 2F] (gate first), w2 [D, F] -> down_proj[e]
  [F, D]; shared_experts.{gate,up,down}_proj likewise -> shared_gate_up_proj / shared_down_proj.
  The dense first layers: mlp.{gate,up}_proj -> gate_up (gate rows first), mlp.down_proj -> down.
- input_layernorm / post_attention_layernorm -> mixer_norm / mlp_norm; embed_tokens, norm, lm_head.

Where Kimi-Linear's math differs from HARTS's defaults, a ModelConfig option reproduces it and
loading sets it: no output-gate bias (`kda.output_gate_bias`), MLA without rotation of the
decoupled key part (`mla.use_rope`; Moonshot's code asserts `mla_use_nope`), latent RMSNorms with
eps 1e-6 (`mla.latent_norm_eps`), any MLA layer list (`mla_layers`: the 48B model's 27th layer is
MLA). Everything else already agrees: pre-norm blocks, SiLU short convs, gate
-exp(A_log)·softplus(f + dt_bias), sigmoid β, L2-normalised q/k with scale K^-1/2, sigmoid-gated
RMSNorm output, MLA scale (nope + rope)^-1/2, sigmoid routing with the bias used for selection
only, top-k weights renormalised when k > 1 (as Moonshot's code; transformers also divides a
single weight by itself) × routed_scaling_factor, an ungated shared expert.
Refused with a ValueError naming the field (config.json) or the feature (saving a model): other
model types, group-limited routing (num_expert_group > 1), softmax routing, moe_renormalize off
with top-k > 1, MoE layers not every layer (moe_layer_freq), a dense model (num_experts null),
mla_use_nope false (Moonshot's code refuses it, transformers ignores it), MTP layers,
quantised checkpoints, activations other than SiLU, KV heads != heads; on saving: a KDA gate rank
other than head_dim, an output-gate bias, rotated MLA, latent eps other than 1e-6, softmax
routing, no expert bias, a shared expert that is not a whole number of experts.
config.json's token ids and tokenizer data are not model parameters and are not read; saving
writes them null. The training-only fields of `ModelConfig` (name, KDA chunk size, MoE loss
coefficients, bias update rate, expert backend, MoE init std) travel under config.json's "harts"
key; without it they take their defaults (name: the directory's name).

Invariant: every tensor of the layout fills exactly one region of one model tensor, so loading
then saving (or the reverse) reproduces every parameter bitwise. Tested against transformers'
`KimiLinearForCausalLM` (its own conversion mapping and its pure-PyTorch KDA) on tiny random
checkpoints written in this layout (tests/model/test_hf_reference.py), by round trips, and by one
check per refused or malformed input (tests/model/test_hf.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from harts.config import from_dict
from harts.files import atomic_path, write_text
from harts.model.config import ModelConfig
from harts.model.model import HybridModel

MODEL_TYPE = "kimi_linear"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000
LATENT_NORM_EPS = 1e-6
"""Kimi-Linear's kv_a_layernorm (and q_a_layernorm) keep KimiRMSNorm's default eps."""
FP32_SUFFIXES = (".A_log", ".dt_bias", ".gate.weight", ".gate.e_score_correction_bias")
"""Tensors that `save_hf_checkpoint(dtype=...)` keeps in fp32, as Kimi-Linear keeps its decay
parameters and router in fp32."""

_SAFETENSORS_FLOATS = ("F64", "F32", "F16", "BF16")
_DTYPE_NAMES = {torch.float64: "float64", torch.float32: "float32", torch.float16: "float16",
                torch.bfloat16: "bfloat16"}
# HARTS fields that config.json's Kimi-Linear keys do not carry, by ModelConfig section.
_HARTS_FIELDS = {"": ("name",), "kda": ("chunk_size",),
                 "moe": ("aux_loss_coeff", "z_loss_coeff", "bias_update_rate", "experts_backend", "init_std")}


@dataclass(frozen=True)
class _Slot:
    """Where one checkpoint tensor lives in the model: `view(model tensor target)` is the region,
    in the checkpoint's shape and orientation."""

    target: str
    shape: tuple[int, ...]
    view: Callable[[torch.Tensor], torch.Tensor]


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t


def _rows(lo: int, hi: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t[lo:hi]


def _columns_t(lo: int, hi: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t[:, lo:hi].T


def _expert_columns_t(expert: int, lo: int, hi: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t[expert, :, lo:hi].T


def _expert_t(expert: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t[expert].T


def _layout(config: ModelConfig) -> dict[str, _Slot]:
    """Every tensor of the Kimi-Linear layout for `config`, in file order."""
    slots: dict[str, _Slot] = {}

    def add(name: str, target: str, shape: tuple[int, ...], view=_whole) -> None:
        slots[name] = _Slot(target, shape, view)

    hidden, kda, mla, moe = config.hidden_size, config.kda, config.mla, config.moe
    add("model.embed_tokens.weight", "embed.weight", (config.vocab_size, hidden))
    for i, kind in enumerate(config.layer_kinds()):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        add(hf + "input_layernorm.weight", ours + "mixer_norm.weight", (hidden,))
        attn, mixer = hf + "self_attn.", ours + "mixer."
        if kind == "kda":
            heads, dim = kda.num_heads, kda.head_dim
            channels = heads * dim
            for name in ("q", "k", "v"):
                add(attn + f"{name}_proj.weight", mixer + f"{name}_proj.weight", (channels, hidden))
                add(attn + f"{name}_conv1d.weight", mixer + f"{name}_conv", (channels, 1, kda.conv_size),
                    lambda t: t.unsqueeze(1))
            add(attn + "A_log", mixer + "A_log", (1, 1, heads, 1), lambda t: t.view(1, 1, -1, 1))
            add(attn + "dt_bias", mixer + "dt_bias", (channels,))
            add(attn + "f_a_proj.weight", mixer + "f_proj.0.weight", (dim, hidden))
            add(attn + "f_b_proj.weight", mixer + "f_proj.1.weight", (channels, dim))
            add(attn + "b_proj.weight", mixer + "b_proj.weight", (heads, hidden))
            add(attn + "g_a_proj.weight", mixer + "g_proj.0.weight", (dim, hidden))
            add(attn + "g_b_proj.weight", mixer + "g_proj.1.weight", (channels, dim))
            add(attn + "o_norm.weight", mixer + "o_norm.weight", (dim,))
            add(attn + "o_proj.weight", mixer + "o_proj.weight", (hidden, channels))
        else:
            heads, qk = mla.num_heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim
            if mla.q_lora_rank:
                add(attn + "q_a_proj.weight", mixer + "q_proj.0.weight", (mla.q_lora_rank, hidden))
                add(attn + "q_a_layernorm.weight", mixer + "q_proj.1.weight", (mla.q_lora_rank,))
                add(attn + "q_b_proj.weight", mixer + "q_proj.2.weight", (heads * qk, mla.q_lora_rank))
            else:
                add(attn + "q_proj.weight", mixer + "q_proj.weight", (heads * qk, hidden))
            add(attn + "kv_a_proj_with_mqa.weight", mixer + "kv_a_proj.weight",
                (mla.kv_lora_rank + mla.qk_rope_head_dim, hidden))
            add(attn + "kv_a_layernorm.weight", mixer + "kv_norm.weight", (mla.kv_lora_rank,))
            add(attn + "kv_b_proj.weight", mixer + "kv_b_proj.weight",
                (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank))
            add(attn + "o_proj.weight", mixer + "o_proj.weight", (hidden, heads * mla.v_head_dim))
        add(hf + "post_attention_layernorm.weight", ours + "mlp_norm.weight", (hidden,))
        if i < config.num_dense_layers:
            size = config.dense_hidden_size
            add(hf + "mlp.gate_proj.weight", ours + "mlp.gate_up.weight", (size, hidden), _rows(0, size))
            add(hf + "mlp.up_proj.weight", ours + "mlp.gate_up.weight", (size, hidden), _rows(size, 2 * size))
            add(hf + "mlp.down_proj.weight", ours + "mlp.down.weight", (hidden, size))
            continue
        block, mlp = hf + "block_sparse_moe.", ours + "mlp."
        size = moe.expert_hidden_size
        add(block + "gate.weight", mlp + "router_weight", (moe.num_experts, hidden))
        add(block + "gate.e_score_correction_bias", mlp + "expert_bias", (moe.num_experts,))
        for e in range(moe.num_experts):
            expert = block + f"experts.{e}."
            add(expert + "w1.weight", mlp + "gate_up_proj", (size, hidden), _expert_columns_t(e, 0, size))
            add(expert + "w2.weight", mlp + "down_proj", (hidden, size), _expert_t(e))
            add(expert + "w3.weight", mlp + "gate_up_proj", (size, hidden), _expert_columns_t(e, size, 2 * size))
        shared = moe.shared_expert_hidden_size
        if shared:
            add(block + "shared_experts.gate_proj.weight", mlp + "shared_gate_up_proj", (shared, hidden),
                _columns_t(0, shared))
            add(block + "shared_experts.up_proj.weight", mlp + "shared_gate_up_proj", (shared, hidden),
                _columns_t(shared, 2 * shared))
            add(block + "shared_experts.down_proj.weight", mlp + "shared_down_proj", (hidden, shared),
                lambda t: t.T)
    add("model.norm.weight", "final_norm.weight", (hidden,))
    if not config.tie_embeddings:
        add("lm_head.weight", "lm_head.weight", (config.vocab_size, hidden))
    return slots


def hf_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the Kimi-Linear checkpoint of `config`, in file order."""
    return {name: slot.shape for name, slot in _layout(config).items()}


# ---------------------------------------------------------------------------------------------
# config.json <-> ModelConfig


class _Fields:
    """Typed reads of config.json's fields, each error naming the file and the field."""

    def __init__(self, data: dict, where: str) -> None:
        self.data, self.where = data, where

    def fail(self, field: str, message: str) -> ValueError:
        return ValueError(f"{self.where}: field '{field}' {message}")

    def get(self, field: str, kind: type | tuple[type, ...], default=None, *, required: bool = False):
        """The field's value (`default` when absent or null, unless `required`), type-checked."""
        value = self.data.get(field)
        if value is None:
            if required:
                raise ValueError(f"{self.where}: missing field '{field}'")
            return default
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise self.fail(field, f"must be {_kind_name(kinds)}, got {value!r}")
        return value

    def require(self, field: str, kind: type | tuple[type, ...]):
        return self.get(field, kind, required=True)

    def expect(self, field: str, value, default, reason: str) -> None:
        """Refuse any value of `field` other than `value` (absent means `default`; a field without
        a default must be present)."""
        if field not in self.data and default is None:
            raise ValueError(f"{self.where}: missing field '{field}'")
        actual = self.data.get(field, default)
        if actual != value:
            raise self.fail(field, f"= {json.dumps(actual)} is not supported ({reason})")


def _kind_name(kinds: tuple[type, ...]) -> str:
    return " or ".join({int: "an integer", float: "a number", bool: "true or false", str: "a string",
                        dict: "a mapping", list: "a list"}[k] for k in kinds)


def _layer_list(fields: _Fields, linear: dict, key: str, num_layers: int) -> list[int]:
    values = linear.get(key)
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise fields.fail(f"linear_attn_config.{key}", f"must be a list of 1-based layer numbers, got {values!r}")
    if any(not 1 <= v <= num_layers for v in values):
        raise fields.fail(f"linear_attn_config.{key}", f"has a layer outside 1..{num_layers}: {values}")
    return values


def _layer_kinds(fields: _Fields, linear: dict, num_layers: int) -> dict:
    """ModelConfig's layer-kind fields: `layers_per_group` when the MLA layers follow that
    pattern, else the explicit `mla_layers`."""
    full = _layer_list(fields, linear, "full_attn_layers", num_layers)
    kda = _layer_list(fields, linear, "kda_layers", num_layers)
    if sorted(full + kda) != list(range(1, num_layers + 1)):
        raise fields.fail("linear_attn_config", f"kda_layers and full_attn_layers must list each of the "
                          f"{num_layers} layers exactly once, got {kda} and {full}")
    mla = sorted(v - 1 for v in full)
    if mla and mla == [i for i in range(num_layers) if (i + 1) % (mla[0] + 1) == 0]:
        return {"layers_per_group": mla[0] + 1}
    return {"mla_layers": mla}


def model_config_from_hf(hf: dict, where: str) -> ModelConfig:
    """The `ModelConfig` of a Kimi-Linear config.json (`where` names it in errors)."""
    if not isinstance(hf, dict):
        raise ValueError(f"{where}: expected a JSON object")
    f = _Fields(hf, where)
    f.expect("model_type", MODEL_TYPE, None, "only Kimi-Linear checkpoints are read")
    if hf.get("quantization_config") is not None:
        raise f.fail("quantization_config", "is set: quantised checkpoints are not supported")
    f.expect("hidden_act", "silu", "silu", "the MLPs are SwiGLU and the KDA convs use SiLU")
    f.expect("mla_use_nope", True, None, "Kimi-Linear's MLA is NoPE; Moonshot's code asserts it")
    f.expect("attention_bias", False, False, "the projections have no biases")
    f.expect("num_expert_group", 1, 1, "group-limited top-k routing is not implemented")
    f.expect("topk_group", 1, 1, "group-limited top-k routing is not implemented")
    f.expect("moe_layer_freq", 1, 1, "every layer after the dense ones is an MoE layer")
    f.expect("moe_router_activation_func", "sigmoid", "sigmoid", "only sigmoid routing with an expert bias")
    f.expect("num_nextn_predict_layers", 0, 0, "multi-token-prediction layers are not supported")
    if hf.get("num_experts") is None:
        raise f.fail("num_experts", "is missing or null: dense Kimi-Linear models are not supported")

    num_layers = f.require("num_hidden_layers", int)
    hidden = f.require("hidden_size", int)
    linear = f.require("linear_attn_config", dict)
    lf = _Fields(linear, f"{where}: linear_attn_config")
    heads = f.require("num_attention_heads", int)
    f.expect("num_key_value_heads", heads, heads, "MLA has as many KV heads as heads")
    top_k = f.require("num_experts_per_token", int)
    if not f.get("moe_renormalize", bool, True) and top_k > 1:
        raise f.fail("moe_renormalize", "= false is not supported with top-k > 1 (the weights are renormalised)")
    expert_size = f.require("moe_intermediate_size", int)
    num_dense = f.require("first_k_dense_replace", int)
    scaling = float(f.require("routed_scaling_factor", (int, float)))
    data = {
        "name": Path(where).parent.name or "kimi-linear",
        "vocab_size": f.require("vocab_size", int),
        "hidden_size": hidden,
        "num_layers": num_layers,
        **_layer_kinds(f, linear, num_layers),
        "num_dense_layers": num_dense,
        "dense_hidden_size": f.require("intermediate_size", int) if num_dense else 0,
        "norm_eps": float(f.require("rms_norm_eps", (int, float))),
        "init_std": float(f.get("initializer_range", (int, float), 0.02)),
        "tie_embeddings": f.get("tie_word_embeddings", bool, False),
        "kda": {
            "num_heads": lf.require("num_heads", int),
            "head_dim": lf.require("head_dim", int),
            "conv_size": lf.require("short_conv_kernel_size", int),
            "gate_rank": lf.require("head_dim", int),
            "output_gate_bias": False,
        },
        "mla": {
            "num_heads": heads,
            "kv_lora_rank": f.require("kv_lora_rank", int),
            "qk_nope_head_dim": f.require("qk_nope_head_dim", int),
            "qk_rope_head_dim": f.require("qk_rope_head_dim", int),
            "v_head_dim": f.require("v_head_dim", int),
            "q_lora_rank": f.get("q_lora_rank", int),
            "use_rope": False,
            "latent_norm_eps": LATENT_NORM_EPS,
        },
        "moe": {
            "hidden_size": hidden,
            "num_experts": f.require("num_experts", int),
            "top_k": top_k,
            "expert_hidden_size": expert_size,
            "score_function": "sigmoid",
            "expert_bias": True,
            "topk_scaling_factor": None if scaling == 1.0 else scaling,
            "shared_expert_hidden_size": expert_size * (f.get("num_shared_experts", int) or 0),
        },
    }
    extras = f.get("harts", dict, {})
    for key, value in extras.items():
        section, _, field = key.rpartition(".") if "." in key else ("", "", key)
        if field not in _HARTS_FIELDS.get(section, ()):
            raise f.fail(f"harts.{key}", "is not a HARTS training field")
        (data[section] if section else data)[field] = value
    return from_dict(ModelConfig, data, where)


def hf_config_from_model(config: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """config.json for `config` (tensors stored in `dtype`); a ValueError names any feature the
    Kimi-Linear layout cannot express."""
    kda, mla, moe = config.kda, config.mla, config.moe

    def refuse(feature: str) -> ValueError:
        return ValueError(f"model config {config.name!r}: {feature} has no Kimi-Linear equivalent")

    if kda.gate_rank not in (None, kda.head_dim):
        raise refuse(f"kda.gate_rank {kda.gate_rank} != head_dim {kda.head_dim} (f_a_proj/g_a_proj have rank head_dim)")
    if kda.output_gate_bias:
        raise refuse("kda.output_gate_bias: true (g_b_proj has no bias)")
    if mla.use_rope and mla.qk_rope_head_dim:
        raise refuse("mla.use_rope: true with qk_rope_head_dim > 0 (Kimi-Linear's MLA is NoPE)")
    latent_eps = config.norm_eps if mla.latent_norm_eps is None else mla.latent_norm_eps
    if latent_eps != LATENT_NORM_EPS:
        raise refuse(f"MLA latent norm eps {latent_eps} (kv_a_layernorm uses {LATENT_NORM_EPS})")
    if moe.score_function != "sigmoid" or not moe.expert_bias:
        raise refuse("MoE routing other than sigmoid with an expert bias")
    if moe.shared_expert_hidden_size % moe.expert_hidden_size:
        raise refuse(f"moe.shared_expert_hidden_size {moe.shared_expert_hidden_size} (not a multiple of "
                     f"expert_hidden_size {moe.expert_hidden_size})")
    kinds = config.layer_kinds()
    harts = {"name": config.name, "kda.chunk_size": kda.chunk_size}
    harts.update({f"moe.{field}": getattr(moe, field) for field in _HARTS_FIELDS["moe"]})
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": MODEL_TYPE,
        "dtype": _DTYPE_NAMES[dtype],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "rms_norm_eps": config.norm_eps,
        "hidden_act": "silu",
        "initializer_range": config.init_std,
        "tie_word_embeddings": config.tie_embeddings,
        "first_k_dense_replace": config.num_dense_layers,
        "intermediate_size": config.dense_hidden_size,
        "linear_attn_config": {
            "num_heads": kda.num_heads,
            "head_dim": kda.head_dim,
            "short_conv_kernel_size": kda.conv_size,
            "kda_layers": [i + 1 for i, kind in enumerate(kinds) if kind == "kda"],
            "full_attn_layers": [i + 1 for i, kind in enumerate(kinds) if kind == "mla"],
        },
        "num_attention_heads": mla.num_heads,
        "num_key_value_heads": mla.num_heads,
        "q_lora_rank": mla.q_lora_rank or None,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "mla_use_nope": True,
        "num_experts": moe.num_experts,
        "num_experts_per_token": moe.top_k,
        "moe_intermediate_size": moe.expert_hidden_size,
        "num_shared_experts": moe.shared_expert_hidden_size // moe.expert_hidden_size,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": moe.topk_scaling_factor or 1.0,
        "num_expert_group": 1,
        "topk_group": 1,
        "moe_layer_freq": 1,
        "num_nextn_predict_layers": 0,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "harts": harts,
    }


# ---------------------------------------------------------------------------------------------
# Loading


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: cannot read ({error})") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: invalid JSON ({error})") from None


def _weight_files(root: Path) -> tuple[Path, dict[Path, set[str]] | None]:
    """(what names the tensors' files, {file: names the index assigns to it} or None for one file)."""
    index_path = root / INDEX_FILE
    if not index_path.is_file():
        single = root / SINGLE_FILE
        if not single.is_file():
            raise ValueError(f"{root}: neither {INDEX_FILE} nor {SINGLE_FILE} found")
        return single, None
    index = _read_json(index_path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index_path}: no 'weight_map' object of tensor names to file names")
    files: dict[Path, set[str]] = {}
    for name, file in weight_map.items():
        if not isinstance(file, str) or Path(file).name != file or not file.endswith(".safetensors"):
            raise ValueError(f"{index_path}: tensor '{name}' maps to {file!r}, not a .safetensors file of the directory")
        path = root / file
        if not path.is_file():
            raise ValueError(f"{index_path}: tensor '{name}' maps to {file}, which does not exist")
        files.setdefault(path, set()).add(name)
    return index_path, files


def _headers(root: Path) -> tuple[Path, dict[str, tuple[Path, tuple[int, ...], str]]]:
    """Every stored tensor: name -> (file, shape, safetensors dtype), checked against the index."""
    from safetensors import safe_open

    source, files = _weight_files(root)
    found: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    for path in files or [source]:
        try:
            with safe_open(path, "pt") as handle:
                header = [(name, handle.get_slice(name)) for name in handle.keys()]
                header = [(name, tuple(piece.get_shape()), piece.get_dtype()) for name, piece in header]
        except Exception as error:  # safetensors raises its own error types for damaged files
            raise ValueError(f"{path}: not a readable safetensors file ({error})") from None
        for name, shape, dtype in header:
            if name in found:
                raise ValueError(f"{path}: holds tensor '{name}', which {found[name][0].name} holds too")
            found[name] = (path, shape, dtype)
    if files is not None:
        # Where a tensor really is first, then what the index claims in vain.
        for name, (path, _, _) in found.items():
            if name not in files[path]:
                raise ValueError(f"{path}: holds tensor '{name}', which {INDEX_FILE} does not assign to it")
        for path, names in files.items():
            absent = sorted(name for name in names if name not in found)
            if absent:
                raise ValueError(f"{source}: lists tensor '{absent[0]}' in {path.name}, which does not hold it")
    return source, found


def load_hf_checkpoint(path: str | Path) -> tuple[HybridModel, ModelConfig]:
    """The fp32 CPU `HybridModel` and its `ModelConfig` of a Kimi-Linear checkpoint directory.

    Every tensor name, shape and dtype is checked before any data is read; a missing, extra or
    mis-shaped tensor, a bad index or an unsupported config value is a one-line ValueError naming
    the file and the tensor or field.

    >>> model, config = load_hf_checkpoint("checkpoints/kimi-linear-tiny")  # doctest: +SKIP
    """
    root = Path(path)
    config_path = root / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{root}: no config.json (not a Hugging Face checkpoint directory)")
    config = model_config_from_hf(_read_json(config_path), str(config_path))
    slots = _layout(config)
    source, stored = _headers(root)
    for name, (file, shape, dtype) in stored.items():
        slot = slots.get(name)
        if slot is None:
            raise ValueError(f"{file}: unexpected tensor '{name}' (not in the Kimi-Linear layout of {config_path})")
        if shape != slot.shape:
            raise ValueError(f"{file}: tensor '{name}' has shape {list(shape)}, expected {list(slot.shape)} "
                             f"from {config_path}")
        if dtype not in _SAFETENSORS_FLOATS:
            raise ValueError(f"{file}: tensor '{name}' has dtype {dtype}, expected a floating type "
                             f"({', '.join(_SAFETENSORS_FLOATS)})")
    missing = [name for name in slots if name not in stored]
    if missing:
        raise ValueError(f"{source}: missing tensor '{missing[0]}' ({len(missing)} missing in all)")

    from safetensors import safe_open

    with torch.device("meta"):
        model = HybridModel(config)
    model.to_empty(device="cpu")
    if config.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    _check_coverage(model, slots)
    targets = model.state_dict(keep_vars=True)
    by_file: dict[Path, list[str]] = {}
    for name, (file, _, _) in stored.items():
        by_file.setdefault(file, []).append(name)
    with torch.no_grad():
        for file, names in by_file.items():
            with safe_open(file, "pt") as handle:
                for name in names:
                    slot = slots[name]
                    slot.view(targets[slot.target]).copy_(handle.get_tensor(name))
    return model, config


# ---------------------------------------------------------------------------------------------
# Saving


def _check_coverage(model: HybridModel, slots: dict[str, _Slot]) -> None:
    """Internal invariant: the layout's regions tile every model tensor exactly."""
    covered: dict[str, int] = {}
    for slot in slots.values():
        covered[slot.target] = covered.get(slot.target, 0) + int(torch.Size(slot.shape).numel())
    tensors = model.state_dict()
    expected = {name: t.numel() for name, t in tensors.items()
                if not (model.config.tie_embeddings and name == "lm_head.weight")}
    assert covered == expected, sorted(set(covered.items()) ^ set(expected.items()))[:4]


def _shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names in order, cut greedily into shards of at most `max_shard_bytes` (a larger
    tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def save_hf_checkpoint(
    model: HybridModel,
    path: str | Path,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: torch.dtype | None = None,
) -> list[Path]:
    """Write `model` as a Kimi-Linear checkpoint into the new directory `path`; return the files.

    The tensors keep the model's dtype (bitwise round trip), or are cast to `dtype` (e.g.
    torch.bfloat16) except the fp32 ones of `FP32_SUFFIXES`. One model.safetensors when everything
    fits in `max_shard_bytes`, else model-XXXXX-of-YYYYY.safetensors shards and
    model.safetensors.index.json. Refuses a directory that already holds a checkpoint, and a model
    the layout cannot express (ValueError naming the feature).
    """
    from safetensors.torch import save_file

    if max_shard_bytes < 1:
        raise ValueError(f"save_hf_checkpoint: max_shard_bytes must be >= 1, got {max_shard_bytes}")
    if dtype is not None and dtype not in _DTYPE_NAMES:
        raise ValueError(f"save_hf_checkpoint: dtype must be one of {list(_DTYPE_NAMES.values())}, got {dtype}")
    config = model.config
    root = Path(path)
    if root.exists() and not root.is_dir():
        raise ValueError(f"{root}: exists and is not a directory")
    existing = [p.name for p in (root.glob("*.safetensors") if root.is_dir() else [])]
    existing += [name for name in ("config.json", INDEX_FILE) if (root / name).exists()]
    if existing:
        raise ValueError(f"{root}: already holds a checkpoint ({sorted(existing)[0]}); save into a new directory")
    hf_config = hf_config_from_model(config, dtype or model.embed.weight.dtype)
    slots = _layout(config)
    _check_coverage(model, slots)
    targets = model.state_dict()

    def stored_dtype(name: str) -> torch.dtype:
        own = targets[slots[name].target].dtype
        return own if dtype is None or name.endswith(FP32_SUFFIXES) else dtype

    dtypes = {name: stored_dtype(name) for name in slots}
    sizes = {name: torch.Size(slot.shape).numel() * dtypes[name].itemsize for name, slot in slots.items()}
    shards = _shards(sizes, max_shard_bytes)
    files = ([root / SINGLE_FILE] if len(shards) == 1 else
             [root / f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    root.mkdir(parents=True, exist_ok=True)
    write_text(root / "config.json", json.dumps(hf_config, indent=2) + "\n")
    with torch.no_grad():
        for file, names in zip(files, shards):
            tensors = {}
            for name in names:
                slot = slots[name]
                region = slot.view(targets[slot.target])
                tensors[name] = torch.empty(slot.shape, dtype=dtypes[name]).copy_(region)
            with atomic_path(file) as temporary:
                save_file(tensors, str(temporary), metadata={"format": "pt"})
    written = [root / "config.json", *files]
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {name: file.name for file, names in zip(files, shards) for name in names}}
        write_text(root / INDEX_FILE, json.dumps(index, indent=2) + "\n")
        written.append(root / INDEX_FILE)
    return written
