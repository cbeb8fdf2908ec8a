"""Qwen3.5-MoE's text model in memory (transformers 5.25's `Qwen3_5MoeForCausalLM`, model_type "qwen3_5_moe_text")
as `HybridModel` tensors: Qwen3-Next's module tree (harts.model.hf_modules.qwen3_next) but for the GDN input
projections, separate and in plain head order (linear_attn.in_proj_qkv, in_proj_z, in_proj_b, in_proj_a: HARTS's
in_proj is their concatenation, a copy), and MoE in every layer. Its MTP layers are not in memory either. The
vision-language model (`Qwen3_5MoeForConditionalGeneration`, model_type "qwen3_5_moe") is not read.
"""

from __future__ import annotations

from harts.model.config import ModelConfig
from harts.model.hf import qwen3_5_moe
from harts.model.hf_modules import qwen3_next
from harts.model.hf_modules.sources import Source, model_sources

MODEL_TYPE = qwen3_5_moe.MODEL_TYPE
CLASS = "Qwen3_5MoeForCausalLM"


def model_config(hf: dict, where: str) -> ModelConfig:
    return qwen3_next.decoder_config(hf, where, MODEL_TYPE)


def sources(config: ModelConfig) -> dict[str, Source]:
    """Every HybridModel tensor of `config` made from a `Qwen3_5MoeForCausalLM`'s tensors."""
    return model_sources(config, qwen3_next.layer_sources("separate"))
