"""Hugging Face checkpoints in Kimi-Linear's layout: `config.json` + safetensors, sharded or not.

Kimi-Linear (Moonshot AI, e.g. moonshotai/Kimi-Linear-48B-A3B-Instruct; `model_type`
"kimi_linear", `KimiLinearForCausalLM`) is the public KDA + MLA + MoE architecture HARTS's
`HybridModel` belongs to. This module provides:
- `load_hf_checkpoint(path, dtype=None, device=None) -> (HybridModel, ModelConfig)`: a checkpoint
  directory (config.json and model.safetensors, or model-XXXXX-of-YYYYY.safetensors shards listed
  by model.safetensors.index.json) into a model built on the meta device, allocated once in `dtype`
  (default fp32) on `device` (default the CPU) and filled one stored tensor at a time;
  `load_hf_config(path)`: its `ModelConfig` alone;
- `save_hf_checkpoint(model, path, max_shard_bytes=..., dtype=None)`: the inverse, into a new
  directory (one file, or shards + index when the tensors exceed `max_shard_bytes`);
  `save_hf_state(config, state, dtypes, path, ...)` the same from model tensors read on demand;
- `hf_tensors(model, dtype=None)`: (name, tensor) in this layout one at a time, a rollout engine's
  weight-sync stream, and `hf_state_dict(model, dtype=None)` as a dict: what the saver writes;
- `model_config_from_hf(hf_config, where)` and `hf_config_from_model(config)`: config.json <->
  `ModelConfig`; `check_exportable(config)`; `hf_tensor_shapes(config)`: every tensor of the layout.

Read: the Hub's schema, Moonshot's config.json (linear_attn_config, first_k_dense_replace,
mla_use_nope) with modeling_kimi.py's tensor names, and what transformers' own `save_pretrained`
writes for `KimiLinearForCausalLM` (5.25): its config keys (layer_types, mlp_layer_types,
linear_num_heads, linear_head_dim, linear_conv_kernel_dim; no mla_use_nope, its MLA never rotates)
instead of or beside Moonshot's (they must then agree), and Moonshot's tensor names except the dense
layers' MLP, which its reversed conversion writes under block_sparse_moe.{gate,up,down}_proj.
Written: the Hub schema (Moonshot's keys and names, the dense MLP under mlp.), which transformers'
`from_pretrained` (its conversion mapping), Moonshot's modeling_kimi.py, vLLM and SGLang all read;
lm_head.weight even for tied embeddings, since transformers' KimiLinearForCausalLM never ties them
(loading refuses a tied head that differs from the embedding, and accepts a tied checkpoint without one).

Tensor names and shapes are those of Moonshot's modeling_kimi.py (model.layers.{i}.self_attn.q_conv1d.weight,
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
with top-k > 1, MoE layers not every layer (moe_layer_freq), dense layers after MoE ones, a dense
model (num_experts null), mla_use_nope false (or absent beside Moonshot's keys, whose readers
default it to false), MTP layers, quantised checkpoints, activations other than SiLU, KV heads !=
heads, Moonshot's and transformers' keys that disagree; on saving, every feature at once with the
setting to train with instead (`check_exportable`): a KDA gate rank other than head_dim, an
output-gate bias (HARTS's default and the shipped configs' but kimi-tiny), rotated MLA, latent eps
other than 1e-6, softmax routing, no expert bias, a shared expert that is not a whole number of experts.
config.json's token ids and tokenizer data are not model parameters and are not read; saving
writes them null. The training-only fields of `ModelConfig` (name, KDA chunk size, MoE loss
coefficients, bias update rate, expert backend, MoE init std) travel under config.json's "harts"
key; without it they take their defaults (name: the directory's name).

Invariant: every tensor of the layout fills exactly one region of one model tensor, so loading
then saving (or the reverse) reproduces every parameter bitwise. Tested against transformers'
`KimiLinearForCausalLM` (tests/model/test_hf_reference.py): checkpoints it writes itself with
`save_pretrained` load with its logits (fp32, 1e-5 of the largest, alone and left- or right-padded)
and save back to the same weights; HARTS models of kimi-tiny load in it; checkpoints written in
Moonshot's layout by hand. tests/model/test_hf.py: round trips, loading in bf16 without an fp32
copy, the weight-sync stream against the files, and one check per refused or malformed input.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from harts.config import from_dict
from harts.files import atomic_path, write_text
from harts.model.config import ModelConfig
from harts.model.model import HybridModel, unwrap_model

MODEL_TYPE = "kimi_linear"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000
KIMI_TINY = "kimi-tiny"
"""The shipped model config (configs/models) of Kimi-Linear's convention that error messages point to."""
LATENT_NORM_EPS = 1e-6
"""Kimi-Linear's kv_a_layernorm (and q_a_layernorm) keep KimiRMSNorm's default eps."""
FP32_SUFFIXES = (".A_log", ".dt_bias", ".gate.weight", ".gate.e_score_correction_bias")
"""Tensors that `save_hf_checkpoint(dtype=...)` and `hf_tensors(dtype=...)` keep in their own dtype (fp32 in
fp32 models and exports), as Kimi-Linear keeps its decay parameters and router in fp32."""

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
    # Written for tied embeddings too: transformers' KimiLinearForCausalLM never ties them and reads lm_head.weight.
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


def _type_list(fields: _Fields, key: str, kinds: tuple[str, str], num_layers: int) -> list[str] | None:
    """transformers' per-layer list `key` (each entry one of `kinds`), or None when absent."""
    values = fields.get(key, list)
    if values is not None and (len(values) != num_layers or any(v not in kinds for v in values)):
        raise fields.fail(key, f"must list {num_layers} entries, each {kinds[0]!r} or {kinds[1]!r}, got {values!r}")
    return values


def _agree(fields: _Fields, field: str, value, other_field: str, other) -> None:
    """Refuse a config.json whose Moonshot and transformers keys describe different models: each reader
    would build another one."""
    if value != other:
        raise fields.fail(field, f"= {json.dumps(value)} disagrees with '{other_field}' = {json.dumps(other)}")


def _mla_layers(fields: _Fields, linear: dict | None, num_layers: int) -> list[int]:
    """0-based MLA layers from Moonshot's linear_attn_config and/or transformers' layer_types."""
    mla = None
    if linear is not None:
        full = _layer_list(fields, linear, "full_attn_layers", num_layers)
        kda = _layer_list(fields, linear, "kda_layers", num_layers)
        if sorted(full + kda) != list(range(1, num_layers + 1)):
            raise fields.fail("linear_attn_config", f"kda_layers and full_attn_layers must list each of the "
                              f"{num_layers} layers exactly once, got {kda} and {full}")
        mla = sorted(v - 1 for v in full)
    types = _type_list(fields, "layer_types", ("linear_attention", "full_attention"), num_layers)
    if types is not None:
        typed = [i for i, kind in enumerate(types) if kind == "full_attention"]
        if mla is not None and typed != mla:
            raise fields.fail("layer_types", f"has full attention at layers {[i + 1 for i in typed]}, "
                              f"'linear_attn_config' at {[i + 1 for i in mla]}")
        mla = typed
    if mla is None:
        raise ValueError(f"{fields.where}: missing field 'linear_attn_config' (Moonshot's config) or 'layer_types' "
                         "(transformers')")
    return mla


def _layer_kinds(mla: list[int], num_layers: int) -> dict:
    """ModelConfig's layer-kind fields: `layers_per_group` when the MLA layers follow that
    pattern, else the explicit `mla_layers`."""
    if mla and mla == [i for i in range(num_layers) if (i + 1) % (mla[0] + 1) == 0]:
        return {"layers_per_group": mla[0] + 1}
    return {"mla_layers": mla}


def _num_dense_layers(fields: _Fields, num_layers: int) -> int:
    """Moonshot's first_k_dense_replace and/or transformers' mlp_layer_types (dense layers first)."""
    first = fields.get("first_k_dense_replace", int)
    types = _type_list(fields, "mlp_layer_types", ("dense", "sparse"), num_layers)
    if types is None:
        if first is None:
            raise ValueError(f"{fields.where}: missing field 'first_k_dense_replace' (Moonshot's config) or "
                             "'mlp_layer_types' (transformers')")
        return first
    dense = types.index("sparse") if "sparse" in types else num_layers
    if "dense" in types[dense:]:
        raise fields.fail("mlp_layer_types", f"= {json.dumps(types)} is not supported (the dense layers must "
                          "come first)")
    if first is not None:
        _agree(fields, "first_k_dense_replace", first, "mlp_layer_types", dense)
    return dense


def _kda_sizes(fields: _Fields, linear: dict | None) -> dict:
    """KDA heads, head dim and conv width from Moonshot's linear_attn_config and/or transformers' linear_* keys."""
    keys = {"num_heads": ("num_heads", "linear_num_heads"), "head_dim": ("head_dim", "linear_head_dim"),
            "conv_size": ("short_conv_kernel_size", "linear_conv_kernel_dim")}
    inner = _Fields(linear, f"{fields.where}: linear_attn_config") if linear is not None else None
    sizes = {}
    for ours, (moonshot, transformers) in keys.items():
        theirs = fields.get(transformers, int)
        if inner is None:
            sizes[ours] = fields.require(transformers, int)
            continue
        sizes[ours] = inner.require(moonshot, int)
        if theirs is not None:
            _agree(fields, transformers, theirs, f"linear_attn_config.{moonshot}", sizes[ours])
    return sizes


def model_config_from_hf(hf: dict, where: str) -> ModelConfig:
    """The `ModelConfig` of a Kimi-Linear config.json, Moonshot's or transformers' (`where` names it in errors)."""
    if not isinstance(hf, dict):
        raise ValueError(f"{where}: expected a JSON object")
    f = _Fields(hf, where)
    f.expect("model_type", MODEL_TYPE, None, "only Kimi-Linear checkpoints are read")
    if hf.get("quantization_config") is not None:
        raise f.fail("quantization_config", "is set: quantised checkpoints are not supported")
    linear = f.get("linear_attn_config", dict)
    f.expect("hidden_act", "silu", "silu", "the MLPs are SwiGLU and the KDA convs use SiLU")
    # Moonshot's config (and vLLM's copy of it) defaults mla_use_nope to false, which their code rotates or
    # refuses; transformers' KimiLinear has no rotation at all and does not write the key.
    f.expect("mla_use_nope", True, None if linear is not None else True,
             "Kimi-Linear's MLA is NoPE; Moonshot's code asserts it")
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
    kinds = _layer_kinds(_mla_layers(f, linear, num_layers), num_layers)
    kda = _kda_sizes(f, linear)
    heads = f.require("num_attention_heads", int)
    f.expect("num_key_value_heads", heads, heads, "MLA has as many KV heads as heads")
    top_k = f.require("num_experts_per_token", int)
    if not f.get("moe_renormalize", bool, True) and top_k > 1:
        raise f.fail("moe_renormalize", "= false is not supported with top-k > 1 (the weights are renormalised)")
    expert_size = f.require("moe_intermediate_size", int)
    num_dense = _num_dense_layers(f, num_layers)
    scaling = float(f.require("routed_scaling_factor", (int, float)))
    data = {
        "name": Path(where).parent.name or "kimi-linear",
        "vocab_size": f.require("vocab_size", int),
        "hidden_size": hidden,
        "num_layers": num_layers,
        **kinds,
        "num_dense_layers": num_dense,
        "dense_hidden_size": f.require("intermediate_size", int) if num_dense else 0,
        "norm_eps": float(f.require("rms_norm_eps", (int, float))),
        "init_std": float(f.get("initializer_range", (int, float), 0.02)),
        "tie_embeddings": f.get("tie_word_embeddings", bool, False),
        "kda": {**kda, "gate_rank": kda["head_dim"], "output_gate_bias": False},
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


def load_hf_config(path: str | Path) -> ModelConfig:
    """The `ModelConfig` of the Kimi-Linear checkpoint directory `path` (its config.json alone)."""
    root = Path(path)
    config_path = root / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{root}: no config.json (not a Hugging Face checkpoint directory)")
    return model_config_from_hf(_read_json(config_path), str(config_path))


def _export_problems(config: ModelConfig) -> list[tuple[str, str]]:
    """(what the Kimi-Linear layout cannot express, the model-config setting that avoids it) for `config`."""
    kda, mla, moe = config.kda, config.mla, config.moe
    problems = []
    if kda.gate_rank not in (None, kda.head_dim):
        problems.append((f"kda.gate_rank {kda.gate_rank} != head_dim {kda.head_dim} (f_a_proj/g_a_proj have rank "
                         "head_dim)", f"kda.gate_rank: {kda.head_dim}"))
    if kda.output_gate_bias:
        problems.append(("kda.output_gate_bias: true (g_b_proj has no bias)", "kda.output_gate_bias: false"))
    if mla.use_rope and mla.qk_rope_head_dim:
        problems.append(("mla.use_rope: true with qk_rope_head_dim > 0 (Kimi-Linear's MLA is NoPE)",
                         "mla.use_rope: false"))
    latent_eps = config.norm_eps if mla.latent_norm_eps is None else mla.latent_norm_eps
    if latent_eps != LATENT_NORM_EPS:
        problems.append((f"MLA latent norm eps {latent_eps} (kv_a_layernorm uses {LATENT_NORM_EPS})",
                         f"mla.latent_norm_eps: {LATENT_NORM_EPS}"))
    if moe.score_function != "sigmoid" or not moe.expert_bias:
        problems.append(("MoE routing other than sigmoid with an expert bias",
                         "moe.score_function: sigmoid, moe.expert_bias: true"))
    if moe.shared_expert_hidden_size % moe.expert_hidden_size:
        problems.append((f"moe.shared_expert_hidden_size {moe.shared_expert_hidden_size} (not a multiple of "
                         f"expert_hidden_size {moe.expert_hidden_size})",
                         "a multiple of moe.expert_hidden_size for moe.shared_expert_hidden_size"))
    return problems


def check_exportable(config: ModelConfig) -> None:
    """ValueError naming every field of `config` the Kimi-Linear layout cannot express, and the settings to train
    with instead (they change the model's function, so weights trained without them cannot be converted)."""
    problems = _export_problems(config)
    if problems:
        what = "; ".join(problem for problem, _ in problems)
        settings = ", ".join(setting for _, setting in problems)
        raise ValueError(f"model config {config.name!r}: {what} {'has' if len(problems) == 1 else 'have'} no "
                         f"Kimi-Linear equivalent; train from a model config with {settings} (as "
                         f"configs/models/{KIMI_TINY}.yaml), since weights trained without them cannot be converted")


def hf_config_from_model(config: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """config.json for `config` (tensors stored in `dtype`), in Moonshot's schema; a ValueError names any feature
    the Kimi-Linear layout cannot express (`check_exportable`)."""
    check_exportable(config)
    kda, mla, moe = config.kda, config.mla, config.moe
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


_DENSE_MLP_ALIAS = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.((?:gate|up|down)_proj\.weight)")


def _layout_name(name: str, config: ModelConfig) -> str:
    """The layout's name of the stored tensor `name`. transformers' `save_pretrained` writes a dense layer's MLP
    under block_sparse_moe. (its conversion renames .block_sparse_moe. to .mlp. in every layer, and back)."""
    match = _DENSE_MLP_ALIAS.fullmatch(name)
    if match and int(match.group(1)) < config.num_dense_layers:
        return f"model.layers.{match.group(1)}.mlp.{match.group(2)}"
    return name


def _check_dtype(dtype: torch.dtype | None, where: str) -> None:
    if dtype is not None and dtype not in _DTYPE_NAMES:
        raise ValueError(f"{where}: dtype must be one of {list(_DTYPE_NAMES.values())}, got {dtype}")


def empty_model(config: ModelConfig, *, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> HybridModel:
    """A `HybridModel` of `config` with uninitialised tensors of `dtype` on `device`, built on the meta device:
    no other copy of the model is ever allocated (a CPU fp32 build then a cast would hold both)."""
    with torch.device("meta"):
        model = HybridModel(config)
    model.to(dtype=dtype)
    model.to_empty(device=device)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed.weight  # to_empty gives the two names their own tensors
    return model


def load_hf_checkpoint(
    path: str | Path, *, dtype: torch.dtype | None = None, device: str | torch.device | None = None,
) -> tuple[HybridModel, ModelConfig]:
    """The `HybridModel` (on `device`, default the CPU, in `dtype`, default float32, as `HybridModel.to(dtype)`
    leaves it: the MoE expert biases stay fp32) and its `ModelConfig` of a Kimi-Linear checkpoint directory,
    Moonshot's layout or transformers' own.

    The model is built on the meta device and then allocated once in `dtype` on `device`; the tensors are read
    one at a time and copied (cast) into their place, so the only other memory is one stored tensor. Every tensor
    name, shape and dtype is checked before any data is read; a missing, extra or mis-shaped tensor, a bad index or
    an unsupported config value is a one-line ValueError naming the file and the tensor or field.

    >>> model, config = load_hf_checkpoint("Kimi-Linear-48B-A3B-Instruct", dtype=torch.bfloat16,
    ...                                    device="cuda")  # doctest: +SKIP
    """
    from safetensors import safe_open

    _check_dtype(dtype, "load_hf_checkpoint")
    device = torch.device("cpu" if device is None else device)
    if device.type == "meta":
        raise ValueError("load_hf_checkpoint: device 'meta' cannot hold the weights")
    root = Path(path)
    config = load_hf_config(root)
    config_path = root / "config.json"
    slots = _layout(config)
    source, stored = _headers(root)
    names: dict[str, str] = {}  # layout name -> stored name
    for name, (file, shape, stored_dtype) in stored.items():
        layout_name = _layout_name(name, config)
        slot = slots.get(layout_name)
        if slot is None:
            raise ValueError(f"{file}: unexpected tensor '{name}' (not in the Kimi-Linear layout of {config_path})")
        if layout_name in names:
            raise ValueError(f"{file}: holds tensor '{name}' and '{names[layout_name]}', two names of one tensor")
        if shape != slot.shape:
            raise ValueError(f"{file}: tensor '{name}' has shape {list(shape)}, expected {list(slot.shape)} "
                             f"from {config_path}")
        if stored_dtype not in _SAFETENSORS_FLOATS:
            raise ValueError(f"{file}: tensor '{name}' has dtype {stored_dtype}, expected a floating type "
                             f"({', '.join(_SAFETENSORS_FLOATS)})")
        names[layout_name] = name
    # Tied embeddings may omit the head (Moonshot's and vLLM's readers tie it; transformers' needs it).
    missing = [name for name in slots if name not in names
               and not (config.tie_embeddings and name == "lm_head.weight")]
    if missing:
        raise ValueError(f"{source}: missing tensor '{missing[0]}' ({len(missing)} missing in all)")
    if config.tie_embeddings and "lm_head.weight" in names:
        _check_tied_head(stored, names, config_path)

    model = empty_model(config, dtype=dtype or torch.float32, device=device)
    _check_coverage(model, slots)
    targets = model.state_dict(keep_vars=True)
    by_file: dict[Path, list[str]] = {}
    for layout_name, name in names.items():
        if not (config.tie_embeddings and layout_name == "lm_head.weight"):
            by_file.setdefault(stored[name][0], []).append(layout_name)
    with torch.no_grad():
        for file, layout_names in by_file.items():
            with safe_open(file, "pt") as handle:
                for layout_name in layout_names:
                    slot = slots[layout_name]
                    slot.view(targets[slot.target]).copy_(handle.get_tensor(names[layout_name]))
    return model, config


def _check_tied_head(stored: dict, names: dict[str, str], config_path: Path) -> None:
    """ValueError unless the stored lm_head.weight equals the embedding that tie_word_embeddings says it is:
    transformers would compute with the one, tying readers with the other."""
    from safetensors import safe_open

    def read(layout_name: str) -> torch.Tensor:
        with safe_open(stored[names[layout_name]][0], "pt") as handle:
            return handle.get_tensor(names[layout_name])

    if not torch.equal(read("lm_head.weight"), read("model.embed_tokens.weight")):
        file = stored[names["lm_head.weight"]][0]
        raise ValueError(f"{file}: tensor 'lm_head.weight' differs from 'model.embed_tokens.weight', but "
                         f"{config_path} sets tie_word_embeddings (set it false if lm_head.weight is the head)")


# ---------------------------------------------------------------------------------------------
# Saving


def _check_coverage(model: HybridModel, slots: dict[str, _Slot]) -> None:
    """Internal invariant: the layout's regions tile every model tensor exactly."""
    covered: dict[str, int] = {}
    for slot in slots.values():
        covered[slot.target] = covered.get(slot.target, 0) + int(torch.Size(slot.shape).numel())
    expected = {name: t.numel() for name, t in model.state_dict().items()}
    assert covered == expected, sorted(set(covered.items()) ^ set(expected.items()))[:4]


def _stored_dtype(name: str, own: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    return own if dtype is None or name.endswith(FP32_SUFFIXES) else dtype


def _hf_items(config: ModelConfig, state: Mapping[str, torch.Tensor], dtype: torch.dtype | None,
              names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, a new tensor) of every layout tensor (or of `names`), each taken from the model tensors `state`
    (HARTS names; read once per name) and stored in `dtype` (None: its own; FP32_SUFFIXES keep their own)."""
    slots = _layout(config)
    for name in slots if names is None else names:
        slot = slots[name]
        source = state[slot.target].detach()
        region = slot.view(source)
        assert tuple(region.shape) == slot.shape, (name, tuple(region.shape), slot.shape)
        stored = _stored_dtype(name, source.dtype, dtype)
        yield name, torch.empty(slot.shape, dtype=stored, device=source.device).copy_(region)


def hf_tensors(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of `model` in the Kimi-Linear layout, one new tensor at a time on the model's device: the
    weight-sync stream of a rollout engine (vLLM's and SGLang's `load_weights` take these names), equal to what
    `save_hf_checkpoint(model, dtype=dtype)` writes. Refuses a model the layout cannot express (ValueError)."""
    model = unwrap_model(model)
    _check_dtype(dtype, "hf_tensors")
    check_exportable(model.config)
    _check_coverage(model, _layout(model.config))
    return _hf_items(model.config, model.state_dict(), dtype)


def hf_state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """`hf_tensors` as a dict (every tensor held at once)."""
    return dict(hf_tensors(model, dtype))


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
    model: nn.Module,
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
    the layout cannot express (ValueError naming the fields).
    """
    model = unwrap_model(model)
    state = model.state_dict()
    return save_hf_state(model.config, state, {name: t.dtype for name, t in state.items()}, path,
                         max_shard_bytes=max_shard_bytes, dtype=dtype)


def save_hf_state(
    config: ModelConfig,
    state: Mapping[str, torch.Tensor],
    dtypes: Mapping[str, torch.dtype],
    path: str | Path,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: torch.dtype | None = None,
) -> list[Path]:
    """`save_hf_checkpoint` of the model tensors `state` (HARTS's state-dict names and shapes, of `dtypes`; each
    read when its shard is written, so `state` may read them from files on demand) of a model of `config`.

    Each file is written atomically (harts.files) and config.json last, so a directory an interrupted save left
    behind is not a checkpoint; a failed save removes what it wrote.
    """
    from safetensors.torch import save_file

    if max_shard_bytes < 1:
        raise ValueError(f"save_hf_checkpoint: max_shard_bytes must be >= 1, got {max_shard_bytes}")
    _check_dtype(dtype, "save_hf_checkpoint")
    root = Path(path)
    if root.exists() and not root.is_dir():
        raise ValueError(f"{root}: exists and is not a directory")
    existing = [p.name for p in (root.glob("*.safetensors") if root.is_dir() else [])]
    existing += [name for name in ("config.json", INDEX_FILE) if (root / name).exists()]
    if existing:
        raise ValueError(f"{root}: already holds a checkpoint ({sorted(existing)[0]}); save into a new directory")
    hf_config = hf_config_from_model(config, dtype or dtypes["embed.weight"])
    slots = _layout(config)
    stored = {name: _stored_dtype(name, dtypes[slot.target], dtype) for name, slot in slots.items()}
    sizes = {name: torch.Size(slot.shape).numel() * stored[name].itemsize for name, slot in slots.items()}
    shards = _shards(sizes, max_shard_bytes)
    files = ([root / SINGLE_FILE] if len(shards) == 1 else
             [root / f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    created = [p for p in (root, *root.parents) if not p.exists()]
    written: list[Path] = []
    try:
        root.mkdir(parents=True, exist_ok=True)
        with torch.no_grad():
            for file, names in zip(files, shards):
                tensors = {name: tensor.cpu() for name, tensor in _hf_items(config, state, dtype, names)}
                with atomic_path(file) as temporary:
                    save_file(tensors, str(temporary), metadata={"format": "pt"})
                written.append(file)
                del tensors
        if len(files) > 1:
            index = {"metadata": {"total_size": sum(sizes.values())},
                     "weight_map": {name: file.name for file, names in zip(files, shards) for name in names}}
            write_text(root / INDEX_FILE, json.dumps(index, indent=2) + "\n")
            written.append(root / INDEX_FILE)
        write_text(root / "config.json", json.dumps(hf_config, indent=2) + "\n")
    except BaseException:
        for file in written:
            file.unlink(missing_ok=True)
        for folder in created:
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    return [root / "config.json", *written]
