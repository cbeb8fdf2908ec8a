"""Kimi-Linear's Hugging Face layout (`model_type` "kimi_linear", `KimiLinearForCausalLM`).

Kimi-Linear (Moonshot AI, e.g. moonshotai/Kimi-Linear-48B-A3B-Instruct) is the public KDA + MLA + MoE
architecture HARTS's `HybridModel` belongs to. An architecture module of harts.model.hf: `layout(config)` (every
checkpoint tensor and its `Slot` in the model), `layout_name(stored, config)` (a stored alias -> its layout name),
`model_config_from_hf(hf, where)` / `hf_config_from_model(config, dtype)` (config.json <-> `ModelConfig`),
`check_exportable(config)` and `FP32_SUFFIXES`.

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
other than 1e-6, softmax routing, no expert bias, a shared expert that is not a whole number of experts,
and BailingHybrid's options (full-rank KDA gates, the bounded decay gate, a gated or biased MLA, group-limited
routing, SwiGLU limits: harts.model.hf.bailing's layout holds them).
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

import json
import re
from pathlib import Path

import torch

from harts.config import from_dict
from harts.model.config import ModelConfig
from harts.model.hf.files import DTYPE_NAMES
from harts.model.hf.schema import Fields, Slot, agree, columns_t, expert_columns_t, expert_t, rows, type_list, whole

MODEL_TYPE = "kimi_linear"
KIMI_TINY = "kimi-tiny"
"""The shipped model config (configs/models) of Kimi-Linear's convention that error messages point to."""
EMBEDDING = "model.embed_tokens.weight"
LATENT_NORM_EPS = 1e-6
"""Kimi-Linear's kv_a_layernorm (and q_a_layernorm) keep KimiRMSNorm's default eps."""
FP32_SUFFIXES = (".A_log", ".dt_bias", ".gate.weight", ".gate.e_score_correction_bias")
"""Tensors that `save_hf_checkpoint(dtype=...)` and `hf_tensors(dtype=...)` keep in their own dtype (fp32 in
fp32 models and exports), as Kimi-Linear keeps its decay parameters and router in fp32."""

# HARTS fields that config.json's Kimi-Linear keys do not carry, by ModelConfig section.
_HARTS_FIELDS = {"": ("name",), "kda": ("chunk_size",),
                 "moe": ("aux_loss_coeff", "z_loss_coeff", "bias_update_rate", "experts_backend", "init_std")}


def layout(config: ModelConfig) -> dict[str, Slot]:
    """Every tensor of the Kimi-Linear layout for `config`, in file order."""
    slots: dict[str, Slot] = {}

    def add(name: str, target: str, shape: tuple[int, ...], view=whole) -> None:
        slots[name] = Slot(target, shape, view)

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
            add(hf + "mlp.gate_proj.weight", ours + "mlp.gate_up.weight", (size, hidden), rows(0, size))
            add(hf + "mlp.up_proj.weight", ours + "mlp.gate_up.weight", (size, hidden), rows(size, 2 * size))
            add(hf + "mlp.down_proj.weight", ours + "mlp.down.weight", (hidden, size))
            continue
        block, mlp = hf + "block_sparse_moe.", ours + "mlp."
        size = moe.expert_hidden_size
        add(block + "gate.weight", mlp + "router_weight", (moe.num_experts, hidden))
        add(block + "gate.e_score_correction_bias", mlp + "expert_bias", (moe.num_experts,))
        for e in range(moe.num_experts):
            expert = block + f"experts.{e}."
            add(expert + "w1.weight", mlp + "gate_up_proj", (size, hidden), expert_columns_t(e, 0, size))
            add(expert + "w2.weight", mlp + "down_proj", (hidden, size), expert_t(e))
            add(expert + "w3.weight", mlp + "gate_up_proj", (size, hidden), expert_columns_t(e, size, 2 * size))
        shared = moe.shared_expert_hidden_size
        if shared:
            add(block + "shared_experts.gate_proj.weight", mlp + "shared_gate_up_proj", (shared, hidden),
                columns_t(0, shared))
            add(block + "shared_experts.up_proj.weight", mlp + "shared_gate_up_proj", (shared, hidden),
                columns_t(shared, 2 * shared))
            add(block + "shared_experts.down_proj.weight", mlp + "shared_down_proj", (hidden, shared),
                lambda t: t.T)
    add("model.norm.weight", "final_norm.weight", (hidden,))
    # Written for tied embeddings too: transformers' KimiLinearForCausalLM never ties them and reads lm_head.weight.
    add("lm_head.weight", "lm_head.weight", (config.vocab_size, hidden))
    return slots


def _layer_list(fields: Fields, linear: dict, key: str, num_layers: int) -> list[int]:
    values = linear.get(key)
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise fields.fail(f"linear_attn_config.{key}", f"must be a list of 1-based layer numbers, got {values!r}")
    if any(not 1 <= v <= num_layers for v in values):
        raise fields.fail(f"linear_attn_config.{key}", f"has a layer outside 1..{num_layers}: {values}")
    return values


def _mla_layers(fields: Fields, linear: dict | None, num_layers: int) -> list[int]:
    """0-based MLA layers from Moonshot's linear_attn_config and/or transformers' layer_types."""
    mla = None
    if linear is not None:
        full = _layer_list(fields, linear, "full_attn_layers", num_layers)
        kda = _layer_list(fields, linear, "kda_layers", num_layers)
        if sorted(full + kda) != list(range(1, num_layers + 1)):
            raise fields.fail("linear_attn_config", f"kda_layers and full_attn_layers must list each of the "
                              f"{num_layers} layers exactly once, got {kda} and {full}")
        mla = sorted(v - 1 for v in full)
    types = type_list(fields, "layer_types", ("linear_attention", "full_attention"), num_layers)
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


def _num_dense_layers(fields: Fields, num_layers: int) -> int:
    """Moonshot's first_k_dense_replace and/or transformers' mlp_layer_types (dense layers first)."""
    first = fields.get("first_k_dense_replace", int)
    types = type_list(fields, "mlp_layer_types", ("dense", "sparse"), num_layers)
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
        agree(fields, "first_k_dense_replace", first, "mlp_layer_types", dense)
    return dense


def _kda_sizes(fields: Fields, linear: dict | None) -> dict:
    """KDA heads, head dim and conv width from Moonshot's linear_attn_config and/or transformers' linear_* keys."""
    keys = {"num_heads": ("num_heads", "linear_num_heads"), "head_dim": ("head_dim", "linear_head_dim"),
            "conv_size": ("short_conv_kernel_size", "linear_conv_kernel_dim")}
    inner = Fields(linear, f"{fields.where}: linear_attn_config") if linear is not None else None
    sizes = {}
    for ours, (moonshot, transformers) in keys.items():
        theirs = fields.get(transformers, int)
        if inner is None:
            sizes[ours] = fields.require(transformers, int)
            continue
        sizes[ours] = inner.require(moonshot, int)
        if theirs is not None:
            agree(fields, transformers, theirs, f"linear_attn_config.{moonshot}", sizes[ours])
    return sizes


def model_config_from_hf(hf: dict, where: str) -> ModelConfig:
    """The `ModelConfig` of a Kimi-Linear config.json, Moonshot's or transformers' (`where` names it in errors)."""
    if not isinstance(hf, dict):
        raise ValueError(f"{where}: expected a JSON object")
    f = Fields(hf, where)
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
    f.read_harts_fields(data, _HARTS_FIELDS)
    return from_dict(ModelConfig, data, where)


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
    if kda.full_rank_gates:
        problems.append(("kda.full_rank_gates: true (f_a/f_b_proj and g_a/g_b_proj are low-rank)",
                         "kda.full_rank_gates: false"))
    if kda.gate_lower_bound is not None:
        problems.append((f"kda.gate_lower_bound: {kda.gate_lower_bound} (Kimi-Linear's decay gate is the softplus "
                         "one)", "kda.gate_lower_bound: null"))
    if mla.output_gate or mla.attention_bias:
        problems.append(("mla.output_gate or mla.attention_bias: true (Kimi-Linear's MLA has neither)",
                         "mla.output_gate: false, mla.attention_bias: false"))
    if moe.num_groups > 1:
        problems.append((f"moe.num_groups: {moe.num_groups} (group-limited routing)", "moe.num_groups: 1"))
    if config.expert_swiglu_limits is not None or config.shared_expert_swiglu_limits is not None:
        problems.append(("SwiGLU limits (Kimi-Linear's experts are not clipped)",
                         "expert_swiglu_limits: null, shared_expert_swiglu_limits: null"))
    if moe.shared_expert_hidden_size % moe.expert_hidden_size:
        problems.append((f"moe.shared_expert_hidden_size {moe.shared_expert_hidden_size} (not a multiple of "
                         f"expert_hidden_size {moe.expert_hidden_size})",
                         "a multiple of moe.expert_hidden_size for moe.shared_expert_hidden_size"))
    if config.mtp is not None:
        problems.append(("mtp (Kimi-Linear checkpoints hold no MTP layers)", "no mtp section"))
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
        "dtype": DTYPE_NAMES[dtype],
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


_DENSE_MLP_ALIAS = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.((?:gate|up|down)_proj\.weight)")


def layout_name(name: str, config: ModelConfig) -> str:
    """The layout's name of the stored tensor `name`. transformers' `save_pretrained` writes a dense layer's MLP
    under block_sparse_moe. (its conversion renames .block_sparse_moe. to .mlp. in every layer, and back)."""
    match = _DENSE_MLP_ALIAS.fullmatch(name)
    if match and int(match.group(1)) < config.num_dense_layers:
        return f"model.layers.{match.group(1)}.mlp.{match.group(2)}"
    return name
