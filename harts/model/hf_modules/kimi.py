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
from harts.model.hf_modules.sources import Source, kda_mla_layer_sources, model_sources

MODEL_TYPE = kimi.MODEL_TYPE
CLASS = "KimiLinearForCausalLM"


def model_config(hf: dict, where: str) -> ModelConfig:
    """The `ModelConfig` of the module tree of a transformers config (its `to_dict()`)."""
    return kimi.model_config_from_hf(hf, where)


def sources(config: ModelConfig) -> dict[str, Source]:
    """Every HybridModel tensor of `config` made from a `KimiLinearForCausalLM`'s tensors."""
    assert config.mtp is None, "Kimi-Linear has no MTP layers"
    return model_sources(config, kda_mla_layer_sources)
