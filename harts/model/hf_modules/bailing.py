"""BailingHybrid's in-memory module tree (transformers 5.25's `BailingHybridForCausalLM`, model_type
"bailing_hybrid": Ling-3) as `HybridModel` tensors.

transformers converts the Hub's checkpoint layout (harts.model.hf.bailing) on loading: in memory, the embedding is
model.embed_tokens; each layer's mixer is self_attn (the Hub's attention.). KDA: {q,k,v}_proj; conv1d stacks the
Hub's q/k/v_conv1d [3C, 1, W]; the decay gate is forget_gate.{A_log [H], dt_bias [C], f_proj} (full rank); b_proj,
g_proj (the full-rank output gate), o_norm, o_proj. MLA: DeepSeek's names (harts.model.hf_modules.sources) with the
Hub's dense as o_proj, the head-wise output gate g_proj [H, D] and, with attention_bias, the q_a, kv_a and o biases.
MoE: the router mlp.gate.weight with its e_score_correction_bias buffer (the Hub's expert_bias; group-limited
routing has no tensors of its own), the stacked experts, mlp.shared_experts.* (num_shared_experts experts wide);
the dense first layers mlp.{gate,up,down}_proj.

MTP layers: transformers' BailingHybridForCausalLM holds none. Its `from_pretrained` skips the checkpoint's MTP
tensors (model.layers.{num_hidden_layers + j}.*, `_keys_to_ignore_on_load_unexpected`), its forward never runs them
and its `save_pretrained` writes none, although its config keeps num_mtp_layers. So the view binds the decoder: its
HybridModel is read without MTP layers (`model_config`), which is also what a trainer on this model trains — TRL's
GRPO loss has no MTP term, and the model it generates with and saves has no MTP weights to update. A HARTS config
with MTP layers is refused by name, and a module tree that does hold them (another implementation's) is refused for
its first tensor that has no place in the decoder.
"""

from __future__ import annotations

import dataclasses

from harts.model.config import ModelConfig
from harts.model.hf import bailing
from harts.model.hf_modules.sources import Source, kda_mla_layer_sources, model_sources

MODEL_TYPE = bailing.MODEL_TYPE
CLASS = "BailingHybridForCausalLM"


def model_config(hf: dict, where: str) -> ModelConfig:
    """The `ModelConfig` of the module tree of a transformers config (its `to_dict()`): the decoder, without the MTP
    layers that the config declares and the module tree lacks (module docstring)."""
    return dataclasses.replace(bailing.model_config_from_hf(hf, where), mtp=None)


def sources(config: ModelConfig) -> dict[str, Source]:
    """Every HybridModel tensor of `config` (without MTP layers) made from a `BailingHybridForCausalLM`'s tensors."""
    assert config.mtp is None, "refused by HFParameterView: transformers' model holds no MTP layers"
    return model_sources(config, kda_mla_layer_sources)
