"""Qwen3-Next's in-memory module tree (transformers 5.25's `Qwen3NextForCausalLM`, model_type "qwen3_next") as
`HybridModel` tensors, and the pieces Qwen3.5-MoE's (harts.model.hf_modules.qwen3_5_moe) shares with it.

transformers keeps the checkpoint's GDN and attention tensors as they are (harts.model.hf.qwen3_next) and stacks
the experts on loading. GDN (linear_attn.): in_proj_qkvz [H·(2K + 2rV), D] holds per key head g its q_g (K rows),
k_g (K), v_g and z_g (r·V each, r = HV / H), in_proj_ba [2·HV, D] per key head b_g then a_g (r rows each): HARTS's
in_proj [q | k | v | z | b | a] is their rows regrouped (a copy; value head g·r + i in both); conv1d [C, 1, W]
-> conv [C, W] (a view); A_log, dt_bias [HV]; norm -> o_norm; out_proj -> o_proj. Gated attention (self_attn.):
q_proj [heads·2·head_dim, D] (per head the query, then its output gate), k_proj, v_proj, o_proj, q_norm, k_norm
as they are. MoE (mlp.): the router gate.weight, the stacked experts, shared_expert.* and its sigmoid gate
shared_expert_gate [1, D]; dense first layers (mlp_only_layers) mlp.{gate,up,down}_proj. The (1 + w) RMSNorms hold
w in both.

MTP layers: transformers' Qwen3-Next and Qwen3.5 models hold none (their `from_pretrained` skips the checkpoint's
mtp.* tensors, `_keys_to_ignore_on_load_unexpected`), although the Hub's configs declare mtp_num_hidden_layers 1:
the view reads the config without that key and binds the decoder, what TRL's loss (no MTP term) trains.
"""

from __future__ import annotations

import torch

from harts.model.config import ModelConfig
from harts.model.hf import qwen3_next
from harts.model.hf_modules.sources import (
    LayerSources, Lookup, Source, dense_mlp_sources, model_sources, moe_sources, named,
)

MODEL_TYPE = qwen3_next.MODEL_TYPE
CLASS = "Qwen3NextForCausalLM"
MTP_KEY = "mtp_num_hidden_layers"
"""config.json's count of MTP layers, which the in-memory model lacks (module docstring)."""


def decoder_config(hf: dict, where: str, model_type: str) -> ModelConfig:
    """The `ModelConfig` of the module tree of a transformers config (its `to_dict()`) of `model_type`: the
    decoder (the MTP layers the config declares are not in the module tree)."""
    return qwen3_next.read_config({key: value for key, value in hf.items() if key != MTP_KEY}, where,
                                  model_type=model_type)


def model_config(hf: dict, where: str) -> ModelConfig:
    return decoder_config(hf, where, MODEL_TYPE)


def fused_in_proj(config: ModelConfig, attn: str) -> Source:
    """HARTS's in_proj [q | k | v | z | b | a] from in_proj_qkvz and in_proj_ba, grouped per key head."""
    gdn = config.gdn
    heads, key_dim = gdn.num_key_heads, gdn.key_head_dim
    group = gdn.num_value_heads // heads
    span = group * gdn.value_head_dim

    def make(get: Lookup) -> torch.Tensor:
        qkvz, ba = get(attn + "in_proj_qkvz.weight"), get(attn + "in_proj_ba.weight")
        hidden = qkvz.shape[-1]
        parts = qkvz.view(heads, -1, hidden).split([key_dim, key_dim, span, span], dim=1)
        parts += ba.view(heads, -1, hidden).split([group, group], dim=1)
        return torch.cat([part.reshape(-1, hidden) for part in parts])

    return make


def separate_in_proj(attn: str) -> Source:
    """HARTS's in_proj from Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b and in_proj_a (plain head order)."""
    names = [attn + f"in_proj_{part}.weight" for part in ("qkv", "z", "b", "a")]
    return lambda get: torch.cat([get(name) for name in names])


def layer_sources(in_proj: str) -> LayerSources:
    """The sources of a decoder layer whose GDN input projection is `in_proj` ("fused": Qwen3-Next's, "separate":
    Qwen3.5's)."""

    def make(config: ModelConfig, index: int, hf: str, ours: str) -> dict[str, Source]:
        mixer = ours + "mixer."
        if config.layer_kind(index) == "gdn":
            attn = hf + "linear_attn."
            sources = {
                mixer + "in_proj.weight": fused_in_proj(config, attn) if in_proj == "fused" else separate_in_proj(attn),
                mixer + "conv": lambda get: get(attn + "conv1d.weight")[:, 0],
                mixer + "A_log": named(attn + "A_log"),
                mixer + "dt_bias": named(attn + "dt_bias"),
                mixer + "o_norm.weight": named(attn + "norm.weight"),
                mixer + "o_proj.weight": named(attn + "out_proj.weight"),
            }
        else:
            attn = hf + "self_attn."
            sources = {mixer + f"{name}.weight": named(attn + f"{name}.weight")
                       for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
        if index < config.num_dense_layers:
            return sources | dense_mlp_sources(hf + "mlp.", ours + "mlp.")
        return sources | moe_sources(config, hf + "mlp.", ours + "mlp.", shared="shared_expert.",
                                     shared_gate="shared_expert_gate")

    return make


def sources(config: ModelConfig) -> dict[str, Source]:
    """Every HybridModel tensor of `config` made from a `Qwen3NextForCausalLM`'s tensors."""
    return model_sources(config, layer_sources("fused"))
