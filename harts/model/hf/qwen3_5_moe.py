"""Qwen3.5-MoE's text layout (`model_type` "qwen3_5_moe_text", `Qwen3_5MoeForCausalLM`, e.g. the language model
of Qwen3.5-35B-A3B): Qwen3-Next's (harts.model.hf.qwen3_next) but for the GDN input projections and the config.

An architecture module of harts.model.hf, chosen for a GDN model whose `hf_layout` is "qwen3_5_moe_text"
(loading such a checkpoint sets it, so that it saves back in its own layout). Differences from Qwen3-Next, read
from transformers 5.25's `Qwen3_5MoeTextConfig` / modeling_qwen3_5_moe.py and its `save_pretrained`:
- the GDN projections are separate, with plain head order: linear_attn.in_proj_qkv [2·H·K + HV·V, D] (q, k, v:
  `in_proj`'s first rows), in_proj_z [HV·V, D], in_proj_b and in_proj_a [HV, D] (its next rows);
- every layer is an MoE layer and the top-k weights are always renormalised (no intermediate_size,
  mlp_only_layers, decoder_sparse_step or norm_topk_prob: saving refuses dense layers and unnormalised routing);
- transformers reads the vision-language checkpoint's text weights under model.language_model. (its
  `PrefixChange`): loading takes that prefix as an alias of model.; saving writes model. as its
  `save_pretrained` does. The vision-language config (model_type "qwen3_5_moe") itself is not read.
The rotary embedding is multimodal (mrope) in transformers, but a text sequence's three position ids are equal,
so its rotation is the plain one at the path position (its mrope keys are ignored).
Tested with qwen3_next's layout against transformers' `Qwen3_5MoeForCausalLM` (tests/model/test_hf_qwen3_next.py).
"""

from __future__ import annotations

import torch

from harts.model.config import ModelConfig
from harts.model.hf import qwen3_next
from harts.model.hf.schema import Slot

MODEL_TYPE = "qwen3_5_moe_text"
FP32_SUFFIXES = qwen3_next.FP32_SUFFIXES
EMBEDDING = qwen3_next.EMBEDDING
_TEXT_PREFIX = "model.language_model."


def layout(config: ModelConfig) -> dict[str, Slot]:
    """Every tensor of the Qwen3.5-MoE text layout for `config`, in file order."""
    return qwen3_next.build_layout(config, fused_projections=False)


def layout_name(name: str, config: ModelConfig) -> str:
    """model.language_model.X (the vision-language checkpoint's text model) is model.X."""
    return "model." + name.removeprefix(_TEXT_PREFIX) if name.startswith(_TEXT_PREFIX) else name


def model_config_from_hf(hf: dict, where: str) -> ModelConfig:
    """The `ModelConfig` of a Qwen3.5-MoE text config.json (`where` names it in errors)."""
    return qwen3_next.read_config(hf, where, model_type=MODEL_TYPE)


def check_exportable(config: ModelConfig) -> None:
    """ValueError naming every field of `config` the Qwen3.5-MoE text layout cannot express."""
    qwen3_next.check_problems(config, MODEL_TYPE)


def hf_config_from_model(config: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """config.json for `config` in Qwen3.5-MoE's text schema."""
    return qwen3_next.write_config(config, dtype, MODEL_TYPE, "Qwen3_5MoeForCausalLM")
