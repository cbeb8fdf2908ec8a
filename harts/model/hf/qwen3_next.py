"""Qwen3-Next's Hugging Face layout (`model_type` "qwen3_next", `Qwen3NextForCausalLM`), and the pieces it shares
with Qwen3.5-MoE's text layout (harts.model.hf.qwen3_5_moe).

An architecture module of harts.model.hf (as kimi.py): `layout(config)`, `layout_name(stored, config)`,
`model_config_from_hf(hf, where)` / `hf_config_from_model(config, dtype)`, `check_exportable(config)` and
`FP32_SUFFIXES`. `architecture_for` picks it for a Gated DeltaNet model (`ModelConfig.gdn`) unless the model's
`hf_layout` names Qwen3.5's.

Read: transformers 5.25's `Qwen3NextConfig` (its keys and defaults) and modeling_qwen3_next.py (the tensors),
and what its `save_pretrained` writes: the Hub's per-expert names (mlp.experts.{e}.{gate,up,down}_proj; its
conversion fuses them on loading and splits them on saving). How the tensors become `HybridModel` parameters:
- GDN (linear_attn.): in_proj_qkvz [H·(2K + 2rV), D] holds, per query/key head g, q_g (K rows), k_g (K), v_g and
  z_g (r·V each, r = HV / H value heads per key head), and in_proj_ba [2·HV, D] per key head b_g then a_g (r rows
  each): row blocks of `in_proj` (its rows [q | k | v | z | b | a], heads in order; value head j = g·r + i in
  both); conv1d [C, 1, W] -> conv [C, W] (C = 2·H·K + HV·V over [q | k | v], the last column multiplying the row
  itself in both); A_log, dt_bias [HV]; norm (the gated RMSNorm's weight) -> o_norm; out_proj -> o_proj.
- Attention (self_attn.): q_proj [heads·2·head_dim, D] (per head the query, then the output gate), k_proj,
  v_proj, o_proj, q_norm and k_norm as they are.
- MoE (mlp.): gate -> router_weight; experts.{e}.gate_proj and up_proj [F, D] -> gate_up_proj[e] [D, 2F] (gate
  first), down_proj [D, F] -> down_proj[e] [F, D]; shared_expert.{gate,up,down}_proj -> shared_gate_up_proj /
  shared_down_proj; shared_expert_gate [1, D] -> shared_gate_weight. Dense layers (mlp_only_layers):
  mlp.{gate,up}_proj -> mlp.gate_up (gate rows first), mlp.down_proj -> mlp.down.
- input_layernorm / post_attention_layernorm -> mixer_norm / mlp_norm, embed_tokens, norm, lm_head: the (1 + w)
  RMSNorms stored as w (`ModelConfig.norm_zero_centered`).

The math that must agree, and does (tests/model/test_hf_qwen3_next.py): pre-norm blocks with (1 + w) RMSNorms;
GDN with the SiLU conv over [q | k | v], g = −exp(A_log)·softplus(a + dt_bias) per value head, β = sigmoid(b),
L2-normalised q/k (eps 1e-6), scale K^-1/2, RMSNorm(o)·w·silu(z); attention with q/k RMSNorm, RoPE (half-split)
on the first head_dim · partial_rotary_factor dimensions at the path positions, scale head_dim^-1/2, output ×
sigmoid(gate); softmax routing over all experts, top-k, renormalised when norm_topk_prob (HARTS: softmax over the
top-k logits, the same weights) or not (`softmax_before_topk`); the gated shared expert.
Refused with a ValueError naming the field: other model types, activations other than SiLU, attention biases or
dropout, rope types other than "default" (or rope_scaling), MoE layers other than every layer after a prefix
of dense ones (decoder_sparse_step != 1, mlp_only_layers not 0..n−1), dense models (num_experts 0), no shared
expert, top-1 routing with norm_topk_prob, MTP layers (mtp_num_hidden_layers > 0: transformers drops them),
quantised checkpoints. On saving, every feature at once with the setting to train with (`check_exportable`).
config.json's token ids are not model parameters; saving writes them null. HARTS's training-only fields travel
under the "harts" key. Invariant (as every layout): each tensor fills its regions of one model tensor, so loading
then saving reproduces every parameter bitwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from harts.config import from_dict
from harts.model.config import ModelConfig
from harts.model.hf.files import DTYPE_NAMES
from harts.model.hf.schema import (
    Fields, Slot, columns_t, expert_columns_t, expert_t, row_blocks, rows, type_list, whole,
)

MODEL_TYPE = "qwen3_next"
EMBEDDING = "model.embed_tokens.weight"
GDN_TINY = "gdn-tiny"
"""The shipped model config (configs/models) of this family that error messages point to."""
FP32_SUFFIXES = (".A_log", ".dt_bias")
"""Tensors that `save_hf_checkpoint(dtype=...)` keeps in their own dtype: the decay parameters."""
ROPE_THETA = 10000.0
"""transformers' default rope_theta (`RopeParameters`), when config.json gives none."""
HEAD_DIM = 256
"""`Qwen3NextConfig.head_dim`'s default, when config.json gives none."""

HARTS_FIELDS = {"": ("name",), "gdn": ("chunk_size",),
                "moe": ("aux_loss_coeff", "z_loss_coeff", "bias_update_rate", "experts_backend", "init_std")}
"""HARTS fields that config.json's keys do not carry, by ModelConfig section (under its "harts" key)."""


def build_layout(config: ModelConfig, *, fused_projections: bool) -> dict[str, Slot]:
    """Every tensor of the layout for `config`, in file order: Qwen3-Next's fused GDN projections
    (in_proj_qkvz, in_proj_ba) or Qwen3.5's separate ones (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)."""
    slots: dict[str, Slot] = {}

    def add(name: str, target: str, shape: tuple[int, ...], view=whole) -> None:
        slots[name] = Slot(target, shape, view)

    hidden, gdn, attention, moe = config.hidden_size, config.gdn, config.gated_attention, config.moe
    add("model.embed_tokens.weight", "embed.weight", (config.vocab_size, hidden))
    for i, kind in enumerate(config.layer_kinds()):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        mixer = ours + "mixer."
        add(hf + "input_layernorm.weight", ours + "mixer_norm.weight", (hidden,))
        if kind == "gdn":
            _gdn_slots(add, gdn, hidden, hf + "linear_attn.", mixer, fused_projections)
        else:
            attn, heads, dim = hf + "self_attn.", attention.num_heads, attention.head_dim
            add(attn + "q_proj.weight", mixer + "q_proj.weight", (heads * 2 * dim, hidden))
            add(attn + "k_proj.weight", mixer + "k_proj.weight", (attention.num_kv_heads * dim, hidden))
            add(attn + "v_proj.weight", mixer + "v_proj.weight", (attention.num_kv_heads * dim, hidden))
            add(attn + "o_proj.weight", mixer + "o_proj.weight", (hidden, heads * dim))
            add(attn + "q_norm.weight", mixer + "q_norm.weight", (dim,))
            add(attn + "k_norm.weight", mixer + "k_norm.weight", (dim,))
        add(hf + "post_attention_layernorm.weight", ours + "mlp_norm.weight", (hidden,))
        block, mlp = hf + "mlp.", ours + "mlp."
        if i < config.num_dense_layers:
            size = config.dense_hidden_size
            add(block + "gate_proj.weight", mlp + "gate_up.weight", (size, hidden), rows(0, size))
            add(block + "up_proj.weight", mlp + "gate_up.weight", (size, hidden), rows(size, 2 * size))
            add(block + "down_proj.weight", mlp + "down.weight", (hidden, size))
            continue
        size = moe.expert_hidden_size
        add(block + "gate.weight", mlp + "router_weight", (moe.num_experts, hidden))
        for e in range(moe.num_experts):
            expert = block + f"experts.{e}."
            add(expert + "gate_proj.weight", mlp + "gate_up_proj", (size, hidden), expert_columns_t(e, 0, size))
            add(expert + "up_proj.weight", mlp + "gate_up_proj", (size, hidden), expert_columns_t(e, size, 2 * size))
            add(expert + "down_proj.weight", mlp + "down_proj", (hidden, size), expert_t(e))
        shared = moe.shared_expert_hidden_size
        add(block + "shared_expert.gate_proj.weight", mlp + "shared_gate_up_proj", (shared, hidden),
            columns_t(0, shared))
        add(block + "shared_expert.up_proj.weight", mlp + "shared_gate_up_proj", (shared, hidden),
            columns_t(shared, 2 * shared))
        add(block + "shared_expert.down_proj.weight", mlp + "shared_down_proj", (hidden, shared), lambda t: t.T)
        add(block + "shared_expert_gate.weight", mlp + "shared_gate_weight", (1, hidden))
    add("model.norm.weight", "final_norm.weight", (hidden,))
    add("lm_head.weight", "lm_head.weight", (config.vocab_size, hidden))
    return slots


def _gdn_slots(add, gdn, hidden: int, hf: str, mixer: str, fused_projections: bool) -> None:
    heads, value_heads, key_dim, value_dim = (gdn.num_key_heads, gdn.num_value_heads, gdn.key_head_dim,
                                              gdn.value_head_dim)
    group = value_heads // heads
    key_width, value_width = heads * key_dim, value_heads * value_dim
    conv_width = 2 * key_width + value_width
    # in_proj's row offsets of q, k, v, z, b and a.
    q0, k0, v0, z0 = 0, key_width, 2 * key_width, conv_width
    b0 = z0 + value_width
    a0 = b0 + value_heads
    target = mixer + "in_proj.weight"
    if fused_projections:
        qkvz = []
        for g in range(heads):
            span = group * value_dim
            qkvz += [(q0 + g * key_dim, q0 + (g + 1) * key_dim), (k0 + g * key_dim, k0 + (g + 1) * key_dim),
                     (v0 + g * span, v0 + (g + 1) * span), (z0 + g * span, z0 + (g + 1) * span)]
        ba = []
        for g in range(heads):
            ba += [(b0 + g * group, b0 + (g + 1) * group), (a0 + g * group, a0 + (g + 1) * group)]
        add(hf + "in_proj_qkvz.weight", target, (2 * key_width + 2 * value_width, hidden), row_blocks(qkvz))
        add(hf + "in_proj_ba.weight", target, (2 * value_heads, hidden), row_blocks(ba))
    else:
        add(hf + "in_proj_qkv.weight", target, (conv_width, hidden), rows(0, conv_width))
        add(hf + "in_proj_z.weight", target, (value_width, hidden), rows(z0, b0))
        add(hf + "in_proj_b.weight", target, (value_heads, hidden), rows(b0, a0))
        add(hf + "in_proj_a.weight", target, (value_heads, hidden), rows(a0, a0 + value_heads))
    add(hf + "conv1d.weight", mixer + "conv", (conv_width, 1, gdn.conv_size), lambda t: t.unsqueeze(1))
    add(hf + "dt_bias", mixer + "dt_bias", (value_heads,))
    add(hf + "A_log", mixer + "A_log", (value_heads,))
    add(hf + "norm.weight", mixer + "o_norm.weight", (value_dim,))
    add(hf + "out_proj.weight", mixer + "o_proj.weight", (hidden, value_width))


def layout(config: ModelConfig) -> dict[str, Slot]:
    """Every tensor of the Qwen3-Next layout for `config`, in file order."""
    return build_layout(config, fused_projections=True)


def layout_name(name: str, config: ModelConfig) -> str:
    """Stored names are the layout's."""
    return name


def _layer_kinds(fields: Fields, num_layers: int) -> dict:
    """ModelConfig's layer-kind fields from layer_types (or full_attention_interval, default 4, as transformers)."""
    types = type_list(fields, "layer_types", ("linear_attention", "full_attention"), num_layers)
    if types is None:
        interval = fields.get("full_attention_interval", int, 4)
        return {"layers_per_group": interval}
    full = [i for i, kind in enumerate(types) if kind == "full_attention"]
    if full and full == [i for i in range(num_layers) if (i + 1) % (full[0] + 1) == 0]:
        return {"layers_per_group": full[0] + 1}
    return {"mla_layers": full}


def _rope(fields: Fields, head_dim: int) -> dict:
    """gated_attention's rotary_dim and rope_theta from rope_parameters (transformers 5) or the older top-level
    rope_theta / partial_rotary_factor."""
    if fields.data.get("rope_scaling") is not None:
        raise fields.fail("rope_scaling", "is set: only the default rope is supported")
    rope = fields.get("rope_parameters", dict, {})
    inner = Fields(rope, f"{fields.where}: rope_parameters")
    rope_type = inner.get("rope_type", str, "default")
    if rope_type != "default":
        raise inner.fail("rope_type", f"= {json.dumps(rope_type)} is not supported (only the default rope)")
    theta = inner.get("rope_theta", (int, float), fields.get("rope_theta", (int, float), ROPE_THETA))
    factor = inner.get("partial_rotary_factor", (int, float), fields.get("partial_rotary_factor", (int, float), 1.0))
    return {"rotary_dim": int(head_dim * factor), "rope_theta": float(theta)}


def read_config(hf: dict, where: str, *, model_type: str) -> ModelConfig:
    """The `ModelConfig` of a Qwen3-Next (`model_type` "qwen3_next") or Qwen3.5-MoE text ("qwen3_5_moe_text")
    config.json."""
    if not isinstance(hf, dict):
        raise ValueError(f"{where}: expected a JSON object")
    f = Fields(hf, where)
    next_layout = model_type == MODEL_TYPE
    f.expect("model_type", model_type, None, f"only {model_type} checkpoints are read here")
    if hf.get("quantization_config") is not None:
        raise f.fail("quantization_config", "is set: quantised checkpoints are not supported")
    f.expect("hidden_act", "silu", "silu", "the MLPs are SwiGLU and the GDN conv uses SiLU")
    f.expect("attention_bias", False, False, "the projections have no biases")
    if f.get("attention_dropout", (int, float), 0):
        raise f.fail("attention_dropout", "is not 0: HARTS trains without dropout")
    if f.get("mtp_num_hidden_layers", int, 0):
        raise f.fail("mtp_num_hidden_layers", "is not 0: multi-token-prediction layers are not supported "
                     "(transformers drops them too)")
    num_experts = f.require("num_experts", int)
    if num_experts < 1:
        raise f.fail("num_experts", "is 0: dense models are not supported")
    num_layers = f.require("num_hidden_layers", int)
    hidden = f.require("hidden_size", int)
    num_dense = 0
    softmax_before_topk = False
    top_k = f.require("num_experts_per_tok", int)
    if next_layout:
        f.expect("decoder_sparse_step", 1, 1, "every layer but the dense first ones is an MoE layer")
        dense = f.get("mlp_only_layers", list, [])
        num_dense = len(dense)
        if dense != list(range(num_dense)):
            raise f.fail("mlp_only_layers", f"= {json.dumps(dense)} is not supported (the dense layers must come "
                         "first)")
        softmax_before_topk = not f.get("norm_topk_prob", bool, True)
    if top_k == 1 and not softmax_before_topk:
        raise f.fail("num_experts_per_tok", "= 1 with renormalised top-k weights (each weight is 1: the router "
                     "gets no gradient) is not supported")
    shared = f.require("shared_expert_intermediate_size", int)
    if shared < 1:
        raise f.fail("shared_expert_intermediate_size", "is 0: the family's MoE has a gated shared expert")
    head_dim = f.get("head_dim", int, HEAD_DIM)
    data = {
        "name": Path(where).parent.name or model_type.replace("_", "-"),
        "vocab_size": f.require("vocab_size", int),
        "hidden_size": hidden,
        "num_layers": num_layers,
        **_layer_kinds(f, num_layers),
        "num_dense_layers": num_dense,
        "dense_hidden_size": f.require("intermediate_size", int) if num_dense else 0,
        "norm_eps": float(f.require("rms_norm_eps", (int, float))),
        "init_std": float(f.get("initializer_range", (int, float), 0.02)),
        "tie_embeddings": f.get("tie_word_embeddings", bool, False),
        "norm_zero_centered": True,
        "hf_layout": model_type,
        "gdn": {
            "num_key_heads": f.require("linear_num_key_heads", int),
            "num_value_heads": f.require("linear_num_value_heads", int),
            "key_head_dim": f.require("linear_key_head_dim", int),
            "value_head_dim": f.require("linear_value_head_dim", int),
            "conv_size": f.require("linear_conv_kernel_dim", int),
        },
        "gated_attention": {
            "num_heads": f.require("num_attention_heads", int),
            "num_kv_heads": f.require("num_key_value_heads", int),
            "head_dim": head_dim,
            **_rope(f, head_dim),
        },
        "moe": {
            "hidden_size": hidden,
            "num_experts": num_experts,
            "top_k": top_k,
            "expert_hidden_size": f.require("moe_intermediate_size", int),
            "score_function": "softmax",
            "softmax_before_topk": softmax_before_topk,
            "shared_expert_hidden_size": shared,
            "shared_expert_gate": True,
        },
    }
    f.read_harts_fields(data, HARTS_FIELDS)
    return from_dict(ModelConfig, data, where)


def model_config_from_hf(hf: dict, where: str) -> ModelConfig:
    """The `ModelConfig` of a Qwen3-Next config.json (`where` names it in errors)."""
    return read_config(hf, where, model_type=MODEL_TYPE)


def export_problems(config: ModelConfig, model_type: str) -> list[tuple[str, str]]:
    """(what the layout of `model_type` cannot express, the model-config setting that avoids it) for `config`."""
    moe, attention = config.moe, config.gated_attention
    problems = []
    if config.gdn is None:
        problems.append(("KDA linear attention (the family's is Gated DeltaNet)", "a gdn section"))
    if attention is None:
        problems.append(("MLA attention (the family's is gated GQA)", "a gated_attention section"))
    elif attention.rotary_dim and int(attention.head_dim * (attention.rotary_dim / attention.head_dim)) != (
            attention.rotary_dim):
        problems.append((f"gated_attention.rotary_dim {attention.rotary_dim} (not head_dim · a float factor)",
                         "a rotary_dim that head_dim · (rotary_dim / head_dim) gives back"))
    if not config.norm_zero_centered:
        problems.append(("RMSNorms scaling by w (the family's scale by 1 + w)", "norm_zero_centered: true"))
    if moe.score_function != "softmax" or moe.expert_bias or moe.topk_scaling_factor:
        problems.append(("MoE routing other than softmax without expert bias or scaling",
                         "moe.score_function: softmax, moe.expert_bias: false, moe.topk_scaling_factor: null"))
    if not moe.shared_expert_hidden_size or not moe.shared_expert_gate:
        problems.append(("no gated shared expert", "moe.shared_expert_hidden_size > 0, moe.shared_expert_gate: true"))
    if model_type != MODEL_TYPE:
        if config.num_dense_layers:
            problems.append((f"{config.num_dense_layers} dense layers ({model_type} has MoE in every layer)",
                             "num_dense_layers: 0"))
        if moe.softmax_before_topk:
            problems.append((f"unnormalised top-k weights ({model_type} renormalises them)",
                             "moe.softmax_before_topk: false"))
    return problems


def check_problems(config: ModelConfig, model_type: str) -> None:
    problems = export_problems(config, model_type)
    if problems:
        what = "; ".join(problem for problem, _ in problems)
        settings = ", ".join(setting for _, setting in problems)
        raise ValueError(f"model config {config.name!r}: {what} {'has' if len(problems) == 1 else 'have'} no "
                         f"{model_type} equivalent; train from a model config with {settings} (as "
                         f"configs/models/{GDN_TINY}.yaml), since weights trained without them cannot be converted")


def check_exportable(config: ModelConfig) -> None:
    """ValueError naming every field of `config` the Qwen3-Next layout cannot express, and the settings to train
    with instead."""
    check_problems(config, MODEL_TYPE)


def write_config(config: ModelConfig, dtype: torch.dtype, model_type: str, architecture: str) -> dict:
    """config.json of `config` in the schema of `model_type` (its `architecture` class)."""
    check_problems(config, model_type)
    gdn, attention, moe = config.gdn, config.gated_attention, config.moe
    harts = {"name": config.name, "gdn.chunk_size": gdn.chunk_size}
    harts.update({f"moe.{field}": getattr(moe, field) for field in HARTS_FIELDS["moe"]})
    hf = {
        "architectures": [architecture],
        "model_type": model_type,
        "dtype": DTYPE_NAMES[dtype],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "rms_norm_eps": config.norm_eps,
        "hidden_act": "silu",
        "initializer_range": config.init_std,
        "tie_word_embeddings": config.tie_embeddings,
        "layer_types": ["full_attention" if kind == "gqa" else "linear_attention" for kind in config.layer_kinds()],
        "num_attention_heads": attention.num_heads,
        "num_key_value_heads": attention.num_kv_heads,
        "head_dim": attention.head_dim,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": attention.rope_theta,
                            "partial_rotary_factor": attention.rotary_dim / attention.head_dim},
        "linear_conv_kernel_dim": gdn.conv_size,
        "linear_key_head_dim": gdn.key_head_dim,
        "linear_value_head_dim": gdn.value_head_dim,
        "linear_num_key_heads": gdn.num_key_heads,
        "linear_num_value_heads": gdn.num_value_heads,
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.expert_hidden_size,
        "shared_expert_intermediate_size": moe.shared_expert_hidden_size,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "harts": harts,
    }
    if model_type == MODEL_TYPE:
        hf.update({"intermediate_size": config.dense_hidden_size,
                   "mlp_only_layers": list(range(config.num_dense_layers)), "decoder_sparse_step": 1,
                   "norm_topk_prob": not moe.softmax_before_topk})
    return hf


def hf_config_from_model(config: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """config.json for `config` in Qwen3-Next's schema; a ValueError names any feature the layout cannot express."""
    return write_config(config, dtype, MODEL_TYPE, "Qwen3NextForCausalLM")
