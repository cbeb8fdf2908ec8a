"""Pieces every module layout of harts.model.hf_modules is written with: `Source` (how one `HybridModel` tensor is
made from a live transformers model's tensors, looked up by name), and the parts the architectures share in
transformers' in-memory module trees (5.25): the embedding, norms and head around the decoder layers
(`model_sources`), the KDA + MLA families' layers (`kda_mla_layer_sources`: `kda_sources` with Kimi-Linear's
low-rank or BailingHybrid's full-rank gates, DeepSeek's MLA names `mla_sources`), the dense SwiGLU MLP, the
stacked experts of transformers' `*Experts` modules and a shared expert (`moe_sources`).

Every source is a view of one tensor or a concatenation of several (a differentiable copy): each element of a
transformers tensor lands in exactly one element of one HybridModel tensor, so gradients flow back unchanged.
Tested through every architecture in tests/model/test_hf_modules.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from harts.model.config import ModelConfig

Lookup = Callable[[str], torch.Tensor]
"""A transformers tensor by its name in the module tree (`named_parameters`, persistent buffers)."""
Source = Callable[[Lookup], torch.Tensor]
"""How one HybridModel tensor is made from the transformers model's tensors."""
LayerSources = Callable[[ModelConfig, int, str, str], dict[str, Source]]
"""An architecture's sources of decoder layer i: (config, i, transformers prefix, HARTS prefix) -> sources of
its mixer and MLP (the norms around them are `model_sources`')."""


def named(name: str) -> Source:
    return lambda get: get(name)


def transposed(name: str) -> Source:
    return lambda get: get(name).T


def model_sources(config: ModelConfig, layer: LayerSources) -> dict[str, Source]:
    """Every HybridModel tensor of `config`'s decoder: the embedding, each layer's two norms and `layer`'s sources,
    the final norm and the head, under the names all four architectures share (model.embed_tokens,
    model.layers.{i}.input_layernorm / post_attention_layernorm, model.norm, lm_head)."""
    sources: dict[str, Source] = {"embed.weight": named("model.embed_tokens.weight")}
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        sources[ours + "mixer_norm.weight"] = named(hf + "input_layernorm.weight")
        sources[ours + "mlp_norm.weight"] = named(hf + "post_attention_layernorm.weight")
        sources.update(layer(config, i, hf, ours))
    sources["final_norm.weight"] = named("model.norm.weight")
    sources["lm_head.weight"] = named("lm_head.weight")
    return sources


def conv_part(name: str, part: int, channels: int) -> Source:
    """Rows [part·C, (part + 1)·C) of a stacked depthwise conv [3C, 1, W] as HARTS's [C, W] (the same column
    order: the last tap multiplies the row itself in both)."""
    return lambda get: get(name)[part * channels:(part + 1) * channels, 0]


def kda_sources(config: ModelConfig, attn: str, mixer: str) -> dict[str, Source]:
    """A KDA layer under `attn` (Kimi-Linear's and BailingHybrid's names): {q,k,v}_proj and their convs stacked in
    conv1d, forget_gate.{A_log (flattened: Kimi-Linear's is [1, 1, H, 1]), dt_bias}, b_proj, o_norm, o_proj, and the
    decay and output gates low-rank (Kimi-Linear: forget_gate.f_a_proj / f_b_proj, g_a_proj / g_b_proj) or full-rank
    (BailingHybrid: forget_gate.f_proj, g_proj) as `config.kda.full_rank_gates` says."""
    channels = config.kda.num_heads * config.kda.head_dim
    sources = {}
    for part, name in enumerate(("q", "k", "v")):
        sources[mixer + f"{name}_proj.weight"] = named(attn + f"{name}_proj.weight")
        sources[mixer + f"{name}_conv"] = conv_part(attn + "conv1d.weight", part, channels)
    sources[mixer + "A_log"] = lambda get: get(attn + "forget_gate.A_log").view(-1)
    sources[mixer + "dt_bias"] = named(attn + "forget_gate.dt_bias")
    if config.kda.full_rank_gates:
        gates = (("f_proj", "forget_gate.f_proj"), ("g_proj", "g_proj"))
    else:
        gates = (("f_proj.0", "forget_gate.f_a_proj"), ("f_proj.1", "forget_gate.f_b_proj"), ("g_proj.0", "g_a_proj"),
                 ("g_proj.1", "g_b_proj"))
    for ours, theirs in (*gates, ("b_proj", "b_proj"), ("o_norm", "o_norm"), ("o_proj", "o_proj")):
        sources[mixer + ours + ".weight"] = named(attn + theirs + ".weight")
    return sources


def kda_mla_layer_sources(config: ModelConfig, index: int, hf: str, ours: str) -> dict[str, Source]:
    """A `LayerSources` of the KDA + MLA families (Kimi-Linear, BailingHybrid): the mixer under self_attn., a
    dense MLP in the first `num_dense_layers` layers, else the MoE with its shared experts."""
    attn, mixer = hf + "self_attn.", ours + "mixer."
    sources = (kda_sources(config, attn, mixer) if config.layer_kind(index) == "kda"
               else mla_sources(config, attn, mixer))
    if index < config.num_dense_layers:
        return sources | dense_mlp_sources(hf + "mlp.", ours + "mlp.")
    return sources | moe_sources(config, hf + "mlp.", ours + "mlp.", shared="shared_experts.")


def mla_sources(config: ModelConfig, attn: str, mixer: str) -> dict[str, Source]:
    """An MLA layer under `attn` (DeepSeek's names, Kimi-Linear's and BailingHybrid's: q_proj or q_a_proj /
    q_a_layernorm / q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj), with the biases of
    `mla.attention_bias` and the head-wise output gate g_proj of `mla.output_gate`."""
    mla = config.mla
    pairs = [("kv_a_proj", "kv_a_proj_with_mqa"), ("kv_norm", "kv_a_layernorm"), ("kv_b_proj", "kv_b_proj"),
             ("o_proj", "o_proj")]
    if mla.q_lora_rank:
        pairs += [("q_proj.0", "q_a_proj"), ("q_proj.1", "q_a_layernorm"), ("q_proj.2", "q_b_proj")]
    else:
        pairs.append(("q_proj", "q_proj"))
    if mla.output_gate:
        pairs.append(("g_proj", "g_proj"))
    sources = {mixer + ours + ".weight": named(attn + theirs + ".weight") for ours, theirs in pairs}
    if mla.attention_bias:
        biased = [("kv_a_proj", "kv_a_proj_with_mqa"), ("o_proj", "o_proj")]
        if mla.q_lora_rank:
            biased.append(("q_proj.0", "q_a_proj"))
        sources.update({mixer + ours + ".bias": named(attn + theirs + ".bias") for ours, theirs in biased})
    return sources


def dense_mlp_sources(mlp: str, ours: str) -> dict[str, Source]:
    """A dense SwiGLU MLP (gate_proj, up_proj, down_proj): HARTS fuses gate and up, gate rows first (a copy)."""
    return {
        ours + "gate_up.weight": lambda get: torch.cat([get(mlp + "gate_proj.weight"), get(mlp + "up_proj.weight")]),
        ours + "down.weight": named(mlp + "down_proj.weight"),
    }


def moe_sources(config: ModelConfig, mlp: str, ours: str, *, shared: str,
                shared_gate: str | None = None) -> dict[str, Source]:
    """An MoE MLP under `mlp`: the router gate.weight (and its gate.e_score_correction_bias with
    `moe.expert_bias`), transformers' stacked experts (experts.gate_up_proj [E, 2F, D], gate rows first, and
    experts.down_proj [E, D, F]: HARTS's [E, D, 2F] and [E, F, D] transposed, views), the shared expert under
    `shared` (gate and up fused as HARTS's [D, 2F_s], a copy) and its sigmoid gate `shared_gate` [1, D]."""
    sources = {
        ours + "router_weight": named(mlp + "gate.weight"),
        ours + "gate_up_proj": lambda get: get(mlp + "experts.gate_up_proj").transpose(1, 2),
        ours + "down_proj": lambda get: get(mlp + "experts.down_proj").transpose(1, 2),
    }
    if config.moe.expert_bias:
        sources[ours + "expert_bias"] = named(mlp + "gate.e_score_correction_bias")
    if config.moe.shared_expert_hidden_size:
        prefix = mlp + shared
        sources[ours + "shared_gate_up_proj"] = lambda get: torch.cat(
            [get(prefix + "gate_proj.weight").T, get(prefix + "up_proj.weight").T], dim=1)
        sources[ours + "shared_down_proj"] = transposed(prefix + "down_proj.weight")
    if config.moe.shared_expert_gate:
        assert shared_gate is not None, "an architecture with a gated shared expert names its gate"
        sources[ours + "shared_gate_weight"] = named(mlp + shared_gate + ".weight")
    return sources
