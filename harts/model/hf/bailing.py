"""BailingHybrid's Hugging Face layout (`model_type` "bailing_hybrid": Ling-3, transformers'
`BailingHybridForCausalLM`).

BailingHybrid (inclusionAI's Ling-3.0 family, e.g. inclusionAI/Ling-3.0-tiny and Ling-3.0-flash) is a KDA + gated
MLA + MoE architecture; transformers (5.25) carries it as `BailingHybridForCausalLM` / `BailingHybridConfig`. An
architecture module of harts.model.hf (see kimi.py): `layout`, `layout_name`, `model_config_from_hf`,
`hf_config_from_model`, `check_exportable`, `FP32_SUFFIXES`, plus `MODEL_TYPE` and `EMBEDDING` (the embedding's
stored name, which a tied head must equal).

Read: the Hub's config.json (inclusionAI's keys: head_dim is the KDA head dim, num_experts,
num_experts_per_tok, n_group, num_shared_experts, moe_shared_expert_intermediate_size, num_nextn_predict_layers,
expert_swiglu_limit_list, ..., with Ling-3's fixed choices spelled out: no_kda_lora, rope_interleave,
gated_attention_proj_granularity_type, moe_router_enable_expert_bias, score_function, topk_method, router_dtype)
and what transformers' `save_pretrained` writes (its attribute names beside or instead of those: linear_num_heads,
linear_head_dim (its head_dim is then the rope dim), linear_conv_kernel_dim, num_local_experts,
num_experts_per_token, num_expert_group, n_shared_experts, num_mtp_layers, swiglu_limits, moe_renormalize,
layer_types, mlp_layer_types, rope_parameters). Two keys for one value must agree. A key absent takes
transformers' default (kda_safe_gate true, kda_lower_bound -5, layer_group_size 6, first_k_dense_replace 2,
rope_theta 6e6, routed_scaling_factor 2.5, num_shared_experts 1, num_mtp_layers 1, rms_norm_eps 1e-6), so both
readers build one model. Tensor names: the Hub's, which transformers' `save_pretrained` also writes (its conversion
mapping reversed): model.word_embeddings, model.layers.{i}.attention.* (KDA: {q,k,v}_proj, {q,k,v}_conv1d [C, 1, W],
f_proj, b_proj, g_proj, A_log [H], dt_bias, o_norm, o_proj; MLA: q_proj or q_a_proj / q_a_layernorm / q_b_proj,
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, g_proj [H, D], dense), mlp.{gate,up,down}_proj (dense layers),
mlp.gate.weight, mlp.gate.expert_bias, mlp.experts.{e}.{gate,up,down}_proj, mlp.shared_experts.{gate,up,down}_proj,
model.norm, lm_head. The Hub's checkpoints name the KDA output projection o_proj and the MLA one dense,
transformers' save writes dense for both: either loads (`layout_name`), as do transformers' in-memory names
embed_tokens and e_score_correction_bias. Written: the Hub's names (KDA o_proj, MLA dense) and a config.json
with the Hub's keys plus the ones transformers needs (layer_types, rope_parameters), which transformers'
`from_pretrained` reads strictly.

How the tensors become `HybridModel` parameters (ModelConfig with hf_layout "bailing_hybrid"): KDA as Kimi-Linear's
but for f_proj and g_proj, one full-rank linear each (`kda.full_rank_gates`), A_log 1-D; MLA as Kimi-Linear's plus
g_proj (`mla.output_gate`) and dense -> o_proj; the experts as Kimi-Linear's (gate_proj/up_proj [F, D] ->
gate_up_proj[e] [D, 2F], down_proj [D, F] -> down_proj[e] [F, D]); expert_bias -> the MoE's expert_bias. Where
BailingHybrid's math differs from HARTS's defaults, loading sets the ModelConfig option that reproduces it: the bounded decay gate
(`kda.gate_lower_bound` = kda_lower_bound when kda_safe_gate), no output-gate bias, interleaved RoPE
(`mla.rope_interleave`), the MLA output gate, `mla.attention_bias`, latent RMSNorm eps 1e-6 (q_a_layernorm and
kv_a_layernorm keep the RMSNorm default), group-limited routing (`moe.num_groups` = n_group, `moe.topk_groups`),
`moe.topk_scaling_factor` = routed_scaling_factor, the shared expert (moe_intermediate_size × num_shared_experts),
the dense first layers, the per-layer SwiGLU limits (`expert_swiglu_limits`, `shared_expert_swiglu_limits`), any
MLA layer list (`mla_layers`, from layer_types). Already equal: pre-norm blocks, SiLU short convs, sigmoid β,
L2-normalised q/k with scale K^-1/2, sigmoid-gated RMSNorm of the KDA output, MLA scale (nope + rope)^-1/2 (default
RoPE: no mscale), sigmoid routing with the bias used for selection only, top-k weights renormalised.
Refused with a ValueError naming the file and field (loading) or the feature (saving): other model types and
architectures (Ling-2.5's lightning attention, BailingMoeV2_5ForCausalLM), RoPE types other than "default",
KV heads != heads, KDA heads != MLA heads (BailingHybrid has one num_attention_heads), attention dropout, the Ling-2
keys use_bias / use_qkv_bias, low-rank KDA gates, non-interleaved RoPE, NoPE MLA, element-wise MLA gates, routing other
than sigmoid with an expert bias (noaux_tc, fp32 router), moe_renormalize off, top-1 routing (transformers renormalises
one weight to 1), no shared expert, a shared-expert size other than moe_intermediate_size × num_shared_experts, dense
layers after MoE ones, quantised checkpoints and activations other than SiLU. Ignored: token ids,
max_position_embeddings,
use_qk_norm (a Ling-2 key: Ling-3's MLA normalises its latents, and transformers reads no such key),
partial_rotary_factor (transformers' default RoPE rotates qk_rope_head_dim dims whatever it says; rotary_dim, when
given, must equal qk_rope_head_dim) and the other training-only keys. The embedding's padding_idx (pad_token_id,
whose row transformers never updates in training) is not a parameter.

MTP layers (`ModelConfig.mtp`, harts.model.mtp): the Hub stores num_nextn_predict_layers (transformers:
num_mtp_layers) layers after the decoder, as model.layers.{num_hidden_layers + j}.*; per inclusionAI's and SGLang's
BailingMoe NextN code (sglang bailing_moe_nextn.py), layer j holds enorm.weight and hnorm.weight [D] (RMSNorms of
the next token's embedding and of the hidden state; -> mtp.layers.{j}.enorm / hnorm), eh_proj.weight [D, 2D]
(applied to [enorm(embedding) ‖ hnorm(hidden)], HARTS's order too), a decoder layer with full (MLA) attention
(attention.*, as an MLA layer above; KDA with mtp_use_kda) and an MoE MLP (mlp.*, as above), input_layernorm /
post_attention_layernorm (-> mtp.layers.{j}.block.*), and final_layernorm.weight; its head and embedding are the
main model's lm_head and word_embeddings (per-layer copies, embed_tokens or shared_head.head as DeepSeek-V3 stores
them, are refused as unexpected tensors). mtp_loss_scaling_factor is the MTP loss's factor (absent: transformers'
0.0, no MTP loss: set `StepConfig.mtp_loss_scaling_factor` to train them). transformers ignores the MTP tensors on
loading (`_keys_to_ignore_on_load_unexpected`), and its save_pretrained writes none: a checkpoint whose config
declares MTP layers but stores none is refused for the missing tensors (its config.json says num_mtp_layers 0 if
written without them).

Invariant: every tensor of the layout fills exactly one region of one model tensor, so loading then saving (or the
reverse) reproduces every parameter bitwise. Tested against transformers' `BailingHybridForCausalLM`
(tests/model/test_hf_bailing_reference.py): checkpoints it writes with `save_pretrained` load with its logits (fp32,
1e-5 of the largest, alone and left- or right-padded) and save back to its logits bitwise; HARTS models of
bailing-tiny load in it with HARTS's logits; every refusal by name.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from harts.config import from_dict
from harts.model.config import ModelConfig
from harts.model.hf.files import DTYPE_NAMES
from harts.model.hf.schema import Fields, Slot, agree, columns_t, expert_columns_t, expert_t, rows, type_list, whole

MODEL_TYPE = "bailing_hybrid"
BAILING_TINY = "bailing-tiny"
"""The shipped model config (configs/models) of BailingHybrid's convention that error messages point to."""
ARCHITECTURES = ("BailingHybridForCausalLM", "BailingMoeV3ForCausalLM")
"""config.json's architectures this layout reads: transformers' class and the Hub's remote-code class of Ling-3."""
EMBEDDING = "model.word_embeddings.weight"
LATENT_NORM_EPS = 1e-6
"""q_a_layernorm and kv_a_layernorm keep BailingHybridRMSNorm's default eps, whatever rms_norm_eps."""
FP32_SUFFIXES = (".A_log", ".dt_bias", "_conv1d.weight", ".gate.weight", ".gate.expert_bias")
"""Tensors that `save_hf_checkpoint(dtype=...)` and `hf_tensors(dtype=...)` keep in their own dtype: those
transformers keeps in fp32 (`_keep_in_fp32_modules_strict`: the decay parameters, the convs, the router and its
bias)."""
DEFAULTS = {"kda_safe_gate": True, "kda_lower_bound": -5.0, "layer_group_size": 6, "first_k_dense_replace": 2,
            "rope_theta": 6_000_000.0, "routed_scaling_factor": 2.5, "num_shared_experts": 1, "num_mtp_layers": 1,
            "rms_norm_eps": 1e-6, "norm_topk_prob": True}
"""transformers' `BailingHybridConfig` defaults of the keys whose absence this reader fills in likewise."""

# HARTS fields that config.json's BailingHybrid keys do not carry, by ModelConfig section.
_HARTS_FIELDS = {"": ("name",), "kda": ("chunk_size",),
                 "moe": ("aux_loss_coeff", "z_loss_coeff", "bias_update_rate", "experts_backend", "init_std")}


def layout(config: ModelConfig) -> dict[str, Slot]:
    """Every tensor of the BailingHybrid layout for `config`, in file order."""
    slots: dict[str, Slot] = {}

    def add(name: str, target: str, shape: tuple[int, ...], view=whole) -> None:
        slots[name] = Slot(target, shape, view)

    hidden = config.hidden_size
    add(EMBEDDING, "embed.weight", (config.vocab_size, hidden))
    for i, kind in enumerate(config.layer_kinds()):
        _add_layer(add, config, f"model.layers.{i}.", f"blocks.{i}.", kind, dense=i < config.num_dense_layers)
    if config.mtp is not None:
        # The MTP layers after the decoder: a decoder layer (the configured mixer, the MoE MLP) and their own norms
        # and projection, under the next layer indices (harts.model.mtp).
        for j in range(config.mtp.num_layers):
            hf, ours = f"model.layers.{config.num_layers + j}.", f"mtp.layers.{j}."
            add(hf + "enorm.weight", ours + "enorm.weight", (hidden,))
            add(hf + "hnorm.weight", ours + "hnorm.weight", (hidden,))
            add(hf + "eh_proj.weight", ours + "eh_proj.weight", (hidden, 2 * hidden))
            _add_layer(add, config, hf, ours + "block.", config.mtp.layer_kind, dense=False)
            add(hf + "final_layernorm.weight", ours + "final_layernorm.weight", (hidden,))
    add("model.norm.weight", "final_norm.weight", (hidden,))
    # Written for tied embeddings too: transformers' BailingHybridForCausalLM never ties them (no tied weights keys).
    add("lm_head.weight", "lm_head.weight", (config.vocab_size, hidden))
    return slots


def _add_layer(add, config: ModelConfig, hf: str, ours: str, kind: str, *, dense: bool) -> None:
    """The tensors of one decoder layer stored under `hf` (its `Block` under `ours`): the `kind` mixer ("kda" or
    "mla"), then the dense MLP or the MoE."""
    hidden, kda, mla, moe = config.hidden_size, config.kda, config.mla, config.moe
    add(hf + "input_layernorm.weight", ours + "mixer_norm.weight", (hidden,))
    attn, mixer = hf + "attention.", ours + "mixer."
    if kind == "kda":
        heads, dim = kda.num_heads, kda.head_dim
        channels = heads * dim
        for name in ("q", "k", "v"):
            add(attn + f"{name}_proj.weight", mixer + f"{name}_proj.weight", (channels, hidden))
            add(attn + f"{name}_conv1d.weight", mixer + f"{name}_conv", (channels, 1, kda.conv_size),
                lambda t: t.unsqueeze(1))
        add(attn + "A_log", mixer + "A_log", (heads,))
        add(attn + "dt_bias", mixer + "dt_bias", (channels,))
        add(attn + "f_proj.weight", mixer + "f_proj.weight", (channels, hidden))
        add(attn + "b_proj.weight", mixer + "b_proj.weight", (heads, hidden))
        add(attn + "g_proj.weight", mixer + "g_proj.weight", (channels, hidden))
        add(attn + "o_norm.weight", mixer + "o_norm.weight", (dim,))
        add(attn + "o_proj.weight", mixer + "o_proj.weight", (hidden, channels))
    else:
        heads, qk = mla.num_heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim
        if mla.q_lora_rank:
            add(attn + "q_a_proj.weight", mixer + "q_proj.0.weight", (mla.q_lora_rank, hidden))
            if mla.attention_bias:
                add(attn + "q_a_proj.bias", mixer + "q_proj.0.bias", (mla.q_lora_rank,))
            add(attn + "q_a_layernorm.weight", mixer + "q_proj.1.weight", (mla.q_lora_rank,))
            add(attn + "q_b_proj.weight", mixer + "q_proj.2.weight", (heads * qk, mla.q_lora_rank))
        else:
            add(attn + "q_proj.weight", mixer + "q_proj.weight", (heads * qk, hidden))
        latent = mla.kv_lora_rank + mla.qk_rope_head_dim
        add(attn + "kv_a_proj_with_mqa.weight", mixer + "kv_a_proj.weight", (latent, hidden))
        if mla.attention_bias:
            add(attn + "kv_a_proj_with_mqa.bias", mixer + "kv_a_proj.bias", (latent,))
        add(attn + "kv_a_layernorm.weight", mixer + "kv_norm.weight", (mla.kv_lora_rank,))
        add(attn + "kv_b_proj.weight", mixer + "kv_b_proj.weight",
            (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank))
        add(attn + "g_proj.weight", mixer + "g_proj.weight", (heads, hidden))
        add(attn + "dense.weight", mixer + "o_proj.weight", (hidden, heads * mla.v_head_dim))
        if mla.attention_bias:
            add(attn + "dense.bias", mixer + "o_proj.bias", (hidden,))
    add(hf + "post_attention_layernorm.weight", ours + "mlp_norm.weight", (hidden,))
    mlp = hf + "mlp."
    if dense:
        size = config.dense_hidden_size
        add(mlp + "gate_proj.weight", ours + "mlp.gate_up.weight", (size, hidden), rows(0, size))
        add(mlp + "up_proj.weight", ours + "mlp.gate_up.weight", (size, hidden), rows(size, 2 * size))
        add(mlp + "down_proj.weight", ours + "mlp.down.weight", (hidden, size))
        return
    target, size = ours + "mlp.", moe.expert_hidden_size
    add(mlp + "gate.weight", target + "router_weight", (moe.num_experts, hidden))
    add(mlp + "gate.expert_bias", target + "expert_bias", (moe.num_experts,))
    for e in range(moe.num_experts):
        expert = mlp + f"experts.{e}."
        add(expert + "gate_proj.weight", target + "gate_up_proj", (size, hidden), expert_columns_t(e, 0, size))
        add(expert + "up_proj.weight", target + "gate_up_proj", (size, hidden), expert_columns_t(e, size, 2 * size))
        add(expert + "down_proj.weight", target + "down_proj", (hidden, size), expert_t(e))
    shared = moe.shared_expert_hidden_size
    add(mlp + "shared_experts.gate_proj.weight", target + "shared_gate_up_proj", (shared, hidden),
        columns_t(0, shared))
    add(mlp + "shared_experts.up_proj.weight", target + "shared_gate_up_proj", (shared, hidden),
        columns_t(shared, 2 * shared))
    add(mlp + "shared_experts.down_proj.weight", target + "shared_down_proj", (hidden, shared), lambda t: t.T)


def _stored_kind(config: ModelConfig, index: int) -> str | None:
    """The mixer of the stored layer `index`: a decoder layer's, an MTP layer's after them, else None."""
    if index < config.num_layers:
        return config.layer_kind(index)
    if config.mtp is not None and index < config.num_layers + config.mtp.num_layers:
        return config.mtp.layer_kind
    return None


_ALIASES = (
    (re.compile(r"model\.embed_tokens\.weight"), lambda m, config: EMBEDDING),
    (re.compile(r"(model\.layers\.\d+\.mlp\.gate)\.e_score_correction_bias"), lambda m, config: f"{m[1]}.expert_bias"),
    # The output projection: the Hub names KDA's o_proj and MLA's dense; transformers writes dense for both.
    (re.compile(r"model\.layers\.(\d+)\.attention\.(dense|o_proj)\.(weight|bias)"),
     lambda m, config: f"model.layers.{m[1]}.attention."
                       f"{'o_proj' if _stored_kind(config, int(m[1])) == 'kda' else 'dense'}.{m[3]}"
     if _stored_kind(config, int(m[1])) is not None else m[0]),
)


def layout_name(name: str, config: ModelConfig) -> str:
    """The layout's name of the stored tensor `name` (the Hub's name for its aliases: the output projection's
    dense/o_proj, transformers' in-memory embed_tokens and e_score_correction_bias)."""
    for pattern, rename in _ALIASES:
        match = pattern.fullmatch(name)
        if match:
            return rename(match, config)
    return name


def _either(f: Fields, keys: tuple[str, ...], kind, default=None, *, required: bool = False):
    """The value of the first of `keys` (one value's spellings) present; every other one present must agree."""
    present = [(key, f.get(key, kind)) for key in keys if f.data.get(key) is not None]
    if not present:
        if required:
            raise ValueError(f"{f.where}: missing field '{keys[0]}'" +
                             (f" (or '{keys[1]}')" if len(keys) > 1 else ""))
        return default
    (key, value), others = present[0], present[1:]
    for other, other_value in others:
        agree(f, key, value, other, other_value)
    return value


def _refuse_unless(f: Fields, key: str, allowed, reason: str) -> None:
    """Refuse `key` when present (not null) with a value outside `allowed` (a tuple of accepted values)."""
    value = f.data.get(key)
    if value is not None and value not in allowed:
        raise f.fail(key, f"= {json.dumps(value)} is not supported ({reason})")


def _limits(f: Fields, keys: tuple[str, str], num_layers: int) -> list[float] | None:
    values = _either(f, keys, list)
    if values is None:
        return None
    if len(values) != num_layers or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
                                            for v in values):
        raise f.fail(keys[0], f"must list {num_layers} numbers >= 0 (0: no clipping), got {values!r}")
    return None if not any(values) else [float(v) for v in values]


def _mla_layers(f: Fields, num_layers: int) -> dict:
    """ModelConfig's layer-kind fields from layer_types (transformers') or the layer_group_size pattern."""
    types = type_list(f, "layer_types", ("linear_attention", "full_attention"), num_layers)
    group = f.get("layer_group_size", int, DEFAULTS["layer_group_size"])
    pattern = [i for i in range(num_layers) if (i + 1) % group == 0] if group >= 1 else None
    if pattern is None:
        raise f.fail("layer_group_size", f"must be >= 1, got {group}")
    if types is None:
        return {"layers_per_group": group}
    mla = [i for i, kind in enumerate(types) if kind == "full_attention"]
    return {"layers_per_group": group} if mla == pattern else {"mla_layers": mla}


def _num_dense_layers(f: Fields, num_layers: int) -> int:
    types = type_list(f, "mlp_layer_types", ("dense", "sparse"), num_layers)
    first = f.get("first_k_dense_replace", int)
    if types is None:
        return DEFAULTS["first_k_dense_replace"] if first is None else first
    dense = types.index("sparse") if "sparse" in types else num_layers
    if "dense" in types[dense:]:
        raise f.fail("mlp_layer_types", f"= {json.dumps(types)} is not supported (the dense layers must come first)")
    if first is not None:
        agree(f, "first_k_dense_replace", first, "mlp_layer_types", dense)
    return dense


def _mtp(f: Fields) -> dict | None:
    """ModelConfig's mtp section: num_nextn_predict_layers (transformers: num_mtp_layers) MTP layers whose block is
    MLA, or KDA with mtp_use_kda; the MTP loss's factor mtp_loss_scaling_factor (absent: transformers' 0.0, no MTP
    loss). None without MTP layers."""
    num = _either(f, ("num_nextn_predict_layers", "num_mtp_layers"), int, DEFAULTS["num_mtp_layers"])
    if num < 0:
        raise f.fail("num_nextn_predict_layers", f"must be >= 0, got {num}")
    factor = f.get("mtp_loss_scaling_factor", (int, float), 0.0)
    if not (math.isfinite(factor) and factor >= 0):
        raise f.fail("mtp_loss_scaling_factor", f"must be a finite number >= 0, got {factor}")
    if not num:
        return None
    return {"num_layers": num, "loss_scaling_factor": float(factor),
            "layer_kind": "kda" if f.get("mtp_use_kda", bool, False) else "mla"}


def _rope_theta(f: Fields) -> float:
    parameters = f.get("rope_parameters", dict)
    if f.data.get("rope_scaling") is not None:
        raise f.fail("rope_scaling", f"= {json.dumps(f.data['rope_scaling'])} is not supported (default RoPE only)")
    theta = f.get("rope_theta", (int, float))
    if parameters is not None:
        inner = Fields(parameters, f"{f.where}: rope_parameters")
        kind = parameters.get("rope_type", parameters.get("type", "default"))
        if kind != "default":
            raise f.fail("rope_parameters.rope_type", f"= {json.dumps(kind)} is not supported (default RoPE only)")
        inner_theta = inner.get("rope_theta", (int, float))
        if theta is not None and inner_theta is not None:
            agree(f, "rope_theta", float(theta), "rope_parameters.rope_theta", float(inner_theta))
        theta = theta if theta is not None else inner_theta
    return float(DEFAULTS["rope_theta"] if theta is None else theta)


def _check_fixed_choices(f: Fields) -> None:
    """Refuse the Hub keys that name a variant transformers' BailingHybrid does not implement."""
    f.expect("model_type", MODEL_TYPE, None, "only BailingHybrid checkpoints are read here")
    architectures = f.get("architectures", list, [])
    if architectures and not set(architectures) & set(ARCHITECTURES):
        raise f.fail("architectures", f"= {json.dumps(architectures)} is not supported (BailingHybrid: "
                                       f"{', '.join(ARCHITECTURES)}; Ling-2.5's lightning attention is not KDA)")
    if f.data.get("quantization_config") is not None:
        raise f.fail("quantization_config", "is set: quantised checkpoints are not supported")
    f.expect("hidden_act", "silu", "silu", "the MLPs are SwiGLU and the KDA convs use SiLU")
    for key, allowed, reason in (
        ("no_kda_lora", (True,), "BailingHybrid's KDA gates are full-rank"),
        ("use_kda_lora", (False,), "BailingHybrid's KDA gates are full-rank"),
        ("linear_silu", (True,), "the KDA convs use SiLU"),
        ("group_norm_size", (1,), "the KDA output norm is per head"),
        ("num_kv_heads_for_linear_attn", (0,), "KDA has as many key heads as heads"),
        ("rope_interleave", (True,), "transformers' BailingHybrid rotates interleaved pairs"),
        ("use_mla_nope", (False,), "BailingHybrid's MLA is rotated"),
        ("mla_use_nope", (False,), "BailingHybrid's MLA is rotated"),
        ("gated_attention_proj_granularity_type", ("head_wise",), "the MLA output gate is one sigmoid a head"),
        ("use_bias", (False,), "transformers' BailingHybrid reads attention_bias"),
        ("use_qkv_bias", (False,), "transformers' BailingHybrid reads attention_bias"),
        ("attention_dropout", (0, 0.0), "HARTS has no attention dropout"),
        ("moe_router_enable_expert_bias", (True,), "BailingHybrid's router has an expert bias"),
        ("score_function", ("sigmoid",), "BailingHybrid routes by sigmoid scores"),
        ("scoring_func", ("sigmoid",), "BailingHybrid routes by sigmoid scores"),
        ("topk_method", ("noaux_tc",), "BailingHybrid's routing is noaux_tc: group-limited with an expert bias"),
        ("router_dtype", ("fp32",), "the router runs in fp32"),
        ("pregate_enabled", (False,), "no pre-gate routing"),
    ):
        _refuse_unless(f, key, allowed, reason)


def model_config_from_hf(hf: dict, where: str) -> ModelConfig:
    """The `ModelConfig` of a BailingHybrid config.json, the Hub's or transformers' (`where` names it in errors)."""
    if not isinstance(hf, dict):
        raise ValueError(f"{where}: expected a JSON object")
    f = Fields(hf, where)
    _check_fixed_choices(f)
    num_layers = f.require("num_hidden_layers", int)
    hidden = f.require("hidden_size", int)
    heads = f.require("num_attention_heads", int)
    f.expect("num_key_value_heads", heads, heads, "MLA has as many KV heads as heads")
    kda_heads = _either(f, ("linear_num_heads",), int, heads)
    agree(f, "linear_num_heads", kda_heads, "num_attention_heads", heads)
    # transformers writes the KDA head dim as linear_head_dim and the rope dim as head_dim; the Hub's head_dim is KDA's.
    kda_dim = f.get("linear_head_dim", int) if f.data.get("linear_head_dim") is not None else f.require("head_dim", int)
    conv = _either(f, ("short_conv_kernel_size", "linear_conv_kernel_dim"), int, 4)
    safe = f.get("kda_safe_gate", bool, DEFAULTS["kda_safe_gate"])
    bound = float(f.get("kda_lower_bound", (int, float), DEFAULTS["kda_lower_bound"]))
    rope = f.require("qk_rope_head_dim", int)
    _refuse_unless(f, "rotary_dim", (rope,), f"the rotated dims are qk_rope_head_dim = {rope}")
    top_k = _either(f, ("num_experts_per_tok", "num_experts_per_token"), int, required=True)
    if not _either(f, ("norm_topk_prob", "moe_renormalize"), bool, DEFAULTS["norm_topk_prob"]):
        raise f.fail("norm_topk_prob", "= false is not supported (the top-k weights are renormalised)")
    if top_k == 1:
        raise f.fail("num_experts_per_tok", "= 1 is not supported (transformers renormalises a single weight to 1, "
                                            "HARTS's sigmoid routing keeps it)")
    expert_size = f.require("moe_intermediate_size", int)
    num_shared = _either(f, ("num_shared_experts", "n_shared_experts"), int, DEFAULTS["num_shared_experts"])
    if num_shared < 1:
        raise f.fail("num_shared_experts", f"= {num_shared} is not supported (BailingHybrid has a shared expert)")
    shared_size = f.get("moe_shared_expert_intermediate_size", int)
    if shared_size is not None:
        agree(f, "moe_shared_expert_intermediate_size", shared_size, "moe_intermediate_size", expert_size)
    num_dense = _num_dense_layers(f, num_layers)
    scaling = float(f.get("routed_scaling_factor", (int, float), DEFAULTS["routed_scaling_factor"]))
    groups = _either(f, ("n_group", "num_expert_group"), int, 8)
    data = {
        "name": Path(where).parent.name or "bailing-hybrid",
        "hf_layout": MODEL_TYPE,
        "vocab_size": f.require("vocab_size", int),
        "hidden_size": hidden,
        "num_layers": num_layers,
        **_mla_layers(f, num_layers),
        "num_dense_layers": num_dense,
        "dense_hidden_size": f.require("intermediate_size", int) if num_dense else 0,
        "norm_eps": float(f.get("rms_norm_eps", (int, float), DEFAULTS["rms_norm_eps"])),
        "init_std": float(f.get("initializer_range", (int, float), 0.02)),
        "tie_embeddings": f.get("tie_word_embeddings", bool, False),
        "expert_swiglu_limits": _limits(f, ("expert_swiglu_limit_list", "swiglu_limits"), num_layers),
        "shared_expert_swiglu_limits": _limits(f, ("share_expert_swiglu_limit_list", "swiglu_limits_shared"),
                                               num_layers),
        "mtp": _mtp(f),
        "kda": {"num_heads": kda_heads, "head_dim": kda_dim, "conv_size": conv, "output_gate_bias": False,
                "full_rank_gates": True, "gate_lower_bound": bound if safe else None},
        "mla": {
            "num_heads": heads,
            "kv_lora_rank": f.require("kv_lora_rank", int),
            "qk_nope_head_dim": f.require("qk_nope_head_dim", int),
            "qk_rope_head_dim": rope,
            "v_head_dim": f.require("v_head_dim", int),
            "q_lora_rank": f.get("q_lora_rank", int),
            "rope_theta": _rope_theta(f),
            "latent_norm_eps": LATENT_NORM_EPS,
            "rope_interleave": True,
            "output_gate": True,
            "attention_bias": f.get("attention_bias", bool, False),
        },
        "moe": {
            "hidden_size": hidden,
            "num_experts": _either(f, ("num_experts", "num_local_experts"), int, required=True),
            "top_k": top_k,
            "expert_hidden_size": expert_size,
            "score_function": "sigmoid",
            "expert_bias": True,
            "topk_scaling_factor": None if scaling == 1.0 else scaling,
            "shared_expert_hidden_size": expert_size * num_shared,
            "num_groups": groups,
            "topk_groups": f.get("topk_group", int, 4),
        },
    }
    f.read_harts_fields(data, _HARTS_FIELDS)
    return from_dict(ModelConfig, data, where)


def _export_problems(config: ModelConfig) -> list[tuple[str, str]]:
    """(what the BailingHybrid layout cannot express, the model-config setting that avoids it) for `config`."""
    kda, mla, moe = config.kda, config.mla, config.moe
    problems = []
    if not kda.full_rank_gates:
        problems.append(("low-rank KDA gates (f_proj and g_proj are full-rank)", "kda.full_rank_gates: true"))
    if kda.output_gate_bias:
        problems.append(("kda.output_gate_bias: true (g_proj has no bias)", "kda.output_gate_bias: false"))
    if kda.num_heads != mla.num_heads:
        problems.append((f"kda.num_heads {kda.num_heads} != mla.num_heads {mla.num_heads} (one num_attention_heads)",
                         "kda.num_heads equal to mla.num_heads"))
    if not mla.use_rope or not mla.qk_rope_head_dim or not mla.rope_interleave:
        problems.append(("MLA RoPE other than interleaved pairs of qk_rope_head_dim > 0 dims",
                         "mla.use_rope: true, mla.rope_interleave: true"))
    if not mla.output_gate:
        problems.append(("mla.output_gate: false (the MLA output is gated)", "mla.output_gate: true"))
    latent_eps = config.norm_eps if mla.latent_norm_eps is None else mla.latent_norm_eps
    if latent_eps != LATENT_NORM_EPS:
        problems.append((f"MLA latent norm eps {latent_eps} (kv_a_layernorm uses {LATENT_NORM_EPS})",
                         f"mla.latent_norm_eps: {LATENT_NORM_EPS}"))
    if moe.score_function != "sigmoid" or not moe.expert_bias:
        problems.append(("MoE routing other than sigmoid with an expert bias",
                         "moe.score_function: sigmoid, moe.expert_bias: true"))
    if moe.top_k == 1:
        problems.append(("moe.top_k: 1 (transformers renormalises a single weight to 1)", "moe.top_k >= 2"))
    shared = moe.shared_expert_hidden_size
    if not shared or shared % moe.expert_hidden_size:
        problems.append((f"moe.shared_expert_hidden_size {shared} (a whole number >= 1 of experts of "
                         f"{moe.expert_hidden_size})", "a positive multiple of moe.expert_hidden_size"))
    return problems


def check_exportable(config: ModelConfig) -> None:
    """ValueError naming every field of `config` the BailingHybrid layout cannot express, and the settings to train
    with instead (they change the model's function, so weights trained without them cannot be converted)."""
    problems = _export_problems(config)
    if problems:
        what = "; ".join(problem for problem, _ in problems)
        settings = ", ".join(setting for _, setting in problems)
        raise ValueError(f"model config {config.name!r}: {what} {'has' if len(problems) == 1 else 'have'} no "
                         f"BailingHybrid equivalent; train from a model config with {settings} (as "
                         f"configs/models/{BAILING_TINY}.yaml), since weights trained without them cannot be "
                         "converted")


def _limit_list(limits: list[float] | None, num_layers: int) -> list[float]:
    return [0] * num_layers if limits is None else [float(v) for v in limits]


def hf_config_from_model(config: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """config.json for `config` (tensors stored in `dtype`) in the Hub's schema, with the keys transformers needs
    beside it; a ValueError names any feature the layout cannot express (`check_exportable`)."""
    check_exportable(config)
    kda, mla, moe = config.kda, config.mla, config.moe
    kinds = config.layer_kinds()
    harts = {"name": config.name, "kda.chunk_size": kda.chunk_size}
    harts.update({f"moe.{field}": getattr(moe, field) for field in _HARTS_FIELDS["moe"]})
    regular = config.mla_layers is None
    hf = {
        "architectures": ["BailingHybridForCausalLM"],
        "model_type": MODEL_TYPE,
        "dtype": DTYPE_NAMES[dtype],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "rms_norm_eps": config.norm_eps,
        "hidden_act": "silu",
        "initializer_range": config.init_std,
        "tie_word_embeddings": config.tie_embeddings,
        "num_attention_heads": mla.num_heads,
        "num_key_value_heads": mla.num_heads,
        "head_dim": kda.head_dim,
        "short_conv_kernel_size": kda.conv_size,
        "no_kda_lora": True,
        "kda_safe_gate": kda.gate_lower_bound is not None,
        "kda_lower_bound": kda.gate_lower_bound if kda.gate_lower_bound is not None else DEFAULTS["kda_lower_bound"],
        "layer_group_size": config.layers_per_group,
        "layer_types": ["full_attention" if kind == "mla" else "linear_attention" for kind in kinds],
        "first_k_dense_replace": config.num_dense_layers,
        "intermediate_size": config.dense_hidden_size,
        "q_lora_rank": mla.q_lora_rank or None,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "qk_head_dim": mla.qk_nope_head_dim + mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "rope_theta": mla.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": mla.rope_theta},
        "rope_interleave": True,
        "gated_attention_proj_granularity_type": "head_wise",
        "attention_bias": mla.attention_bias,
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.expert_hidden_size,
        "num_shared_experts": moe.shared_expert_hidden_size // moe.expert_hidden_size,
        "moe_shared_expert_intermediate_size": moe.expert_hidden_size,
        "n_group": moe.num_groups,
        "topk_group": moe.topk_groups,
        "routed_scaling_factor": moe.topk_scaling_factor or 1.0,
        "norm_topk_prob": True,
        "moe_router_enable_expert_bias": True,
        "score_function": "sigmoid",
        "topk_method": "noaux_tc",
        "router_dtype": "fp32",
        "expert_swiglu_limit_list": _limit_list(config.expert_swiglu_limits, config.num_layers),
        "share_expert_swiglu_limit_list": _limit_list(config.shared_expert_swiglu_limits, config.num_layers),
        "num_nextn_predict_layers": 0 if config.mtp is None else config.mtp.num_layers,
        "mtp_loss_scaling_factor": 0.0 if config.mtp is None else config.mtp.loss_scaling_factor,
        "mtp_use_kda": config.mtp is not None and config.mtp.layer_kind == "kda",
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "harts": harts,
    }
    if not regular:  # the Hub's remote code reads layer_group_size only; transformers reads layer_types
        del hf["layer_group_size"]
    return hf
