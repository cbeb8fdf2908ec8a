"""Kimi-Linear's in-memory module tree (transformers 5.25's `KimiLinearForCausalLM`, model_type "kimi_linear") as
`HybridModel` tensors.

transformers converts Moonshot's checkpoint layout (harts.model.hf.kimi) on loading: in memory, self_attn.conv1d
stacks q, k and v's depthwise convs [3C, 1, W]; the decay gate is forget_gate.{A_log [1, 1, H, 1], dt_bias,
f_a_proj, f_b_proj}; the output gate g_a_proj / g_b_proj (rank head_dim); the experts are stacked
(mlp.experts.gate_up_proj [E, 2F, D] gate rows first, down_proj [E, D, F]); the router is mlp.gate with its
e_score_correction_bias buffer; the shared expert mlp.shared_experts.*; the dense first layers mlp.{gate,up,down}_proj.
The MLA (NoPE) uses DeepSeek's names (harts.model.hf_modules.sources). Kimi-Linear has no MTP layers.
"""

from __future__ import annotations

from harts.model.config import ModelConfig
from harts.model.hf import kimi
from harts.model.hf_modules.sources import (
    Source, conv_part, dense_mlp_sources, mla_sources, model_sources, moe_sources, named,
)

MODEL_TYPE = kimi.MODEL_TYPE
CLASS = "KimiLinearForCausalLM"


def model_config(hf: dict, where: str) -> ModelConfig:
    """The `ModelConfig` of the module tree of a transformers config (its `to_dict()`)."""
    return kimi.model_config_from_hf(hf, where)


def _kda_sources(config: ModelConfig, attn: str, mixer: str) -> dict[str, Source]:
    channels = config.kda.num_heads * config.kda.head_dim
    sources = {}
    for part, name in enumerate(("q", "k", "v")):
        sources[mixer + f"{name}_proj.weight"] = named(attn + f"{name}_proj.weight")
        sources[mixer + f"{name}_conv"] = conv_part(attn + "conv1d.weight", part, channels)
    sources[mixer + "A_log"] = lambda get: get(attn + "forget_gate.A_log").view(-1)
    sources[mixer + "dt_bias"] = named(attn + "forget_gate.dt_bias")
    sources[mixer + "f_proj.0.weight"] = named(attn + "forget_gate.f_a_proj.weight")
    sources[mixer + "f_proj.1.weight"] = named(attn + "forget_gate.f_b_proj.weight")
    for ours, theirs in (("b_proj", "b_proj"), ("g_proj.0", "g_a_proj"), ("g_proj.1", "g_b_proj"),
                         ("o_norm", "o_norm"), ("o_proj", "o_proj")):
        sources[mixer + ours + ".weight"] = named(attn + theirs + ".weight")
    return sources


def _layer_sources(config: ModelConfig, index: int, hf: str, ours: str) -> dict[str, Source]:
    attn, mixer = hf + "self_attn.", ours + "mixer."
    sources = (_kda_sources(config, attn, mixer) if config.layer_kind(index) == "kda"
               else mla_sources(config, attn, mixer))
    if index < config.num_dense_layers:
        return sources | dense_mlp_sources(hf + "mlp.", ours + "mlp.")
    return sources | moe_sources(config, hf + "mlp.", ours + "mlp.", shared="shared_experts.")


def sources(config: ModelConfig) -> dict[str, Source]:
    """Every HybridModel tensor of `config` made from a `KimiLinearForCausalLM`'s tensors."""
    assert config.mtp is None, "Kimi-Linear has no MTP layers"
    return model_sources(config, _layer_sources)
