"""harts.model.hf's BailingHybrid layout against transformers' own `BailingHybridForCausalLM` (Ling-3's architecture).

Checkpoints transformers writes itself: tiny `BailingHybridConfig`s built by transformers (no MTP layers), models built
from them with random weights (`random_weights` of tests/model/test_hf_reference.py: unit-variance outputs, decays
exp(A_log) in [0.5, 4], expert biases spread), saved with `save_pretrained` (one file or shards: its config keys and
its tensor names, the Hub's). HARTS loads them to transformers' logits within 1e-5 of the largest
(`TRANSFORMERS_TOLERANCE`), for each sequence alone and for batches padded on the left and on the right
(transformers' KDA zeroes the padded rows, its MLA masks them; RoPE is relative, so left padding's shifted positions
change nothing); HARTS saves them back (the Hub's names and config keys) and transformers reads them strictly to its
own logits bitwise. The cases cover every BailingHybrid feature: the bounded and the softplus decay gate, full and
low-rank queries, MLA biases, group-limited routing, per-layer SwiGLU limits (small enough to clip at these
weights: the case checks that they change the logits), an irregular layer list with two dense layers, tied
embeddings (a head equal to the embedding). The Hub's own schema (head_dim as the KDA head dim, num_experts_per_tok,
n_group, moe_shared_expert_intermediate_size, the fixed-choice keys, the KDA output projection named o_proj) loads to
the same model. The other way, a HARTS model of the shipped bailing-tiny config saved by HARTS gives transformers
HARTS's logits within the same tolerance.
"""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from harts.model.config import MTPConfig, load_model_config
from harts.model.hf import load_hf_checkpoint, save_hf_checkpoint
from tests.model.test_hf_reference import (  # noqa: F401 (offline is a fixture)
    LENGTHS, PADDINGS, harts_logits, harts_model, max_error, offline, padded_logits, random_weights,
)

TRANSFORMERS_TOLERANCE = 1e-5
"""max |Δlogit| / max |logit| between HARTS and transformers' BailingHybridForCausalLM, both fp32 (measured up to
~3e-6 on these checkpoints: fp32 rounding of two chunked KDAs and two attention implementations)."""


def transformers_config(**changes) -> transformers.BailingHybridConfig:
    """A tiny config built by transformers' own `BailingHybridConfig`: 5 layers (KDA, MLA, KDA, MLA, KDA: layer group
    size 2), the first dense, 8 experts top-2 from 2 of 4 groups, low-rank queries, the bounded gate, no MTP."""
    settings = dict(
        vocab_size=97, hidden_size=48, intermediate_size=80, moe_intermediate_size=20, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=16, qk_nope_head_dim=12,
        qk_rope_head_dim=8, v_head_dim=10, head_dim=16, num_local_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, n_shared_experts=1, routed_scaling_factor=2.446, layer_group_size=2, first_k_dense_replace=1,
        rms_norm_eps=1e-5, rope_theta=10000.0, num_mtp_layers=0, pad_token_id=None, bos_token_id=None,
        eos_token_id=None,
    )
    settings.update(changes)
    return transformers.BailingHybridConfig(**settings)


def transformers_model(config: transformers.BailingHybridConfig, seed: int) -> transformers.BailingHybridForCausalLM:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    random_weights(model.state_dict(), seed, lambda name, tensor: tensor.shape[-1])
    return model.eval()


def load_strict(root) -> transformers.BailingHybridForCausalLM:
    """`from_pretrained`, refusing any missing, unexpected or mis-shaped key."""
    model, info = transformers.BailingHybridForCausalLM.from_pretrained(
        root, dtype=torch.float32, attn_implementation="eager", output_loading_info=True,
    )
    problems = {key: value for key, value in info.items() if value}
    assert not problems, problems
    return model.eval()


def _sequences(vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(42)
    return [rng.integers(0, vocab_size, n).tolist() for n in (*LENGTHS, 5)]


CASES = {
    "one-file": {},
    "sharded-full-query": {"config": {"q_lora_rank": None}, "shard": "40KB"},
    "softplus-gate-attention-bias": {"config": {"kda_safe_gate": False, "attention_bias": True}},
    "clipped-swiglu": {"config": {"swiglu_limits": [0, 0, 0.5, 0, 0.8], "swiglu_limits_shared": [0, 0.3, 0, 0, 0.6]},
                       "clips": True},
    "sharded-irregular-layers-two-dense": {
        "config": {"layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention",
                                   "full_attention"], "first_k_dense_replace": 2, "layer_group_size": 3},
        "shard": "40KB"},
    "tied-one-file": {"config": {"tie_word_embeddings": True}},
}


@pytest.mark.parametrize("case", CASES)
def test_transformers_save_pretrained_both_ways(tmp_path, offline, case):
    """A checkpoint written by transformers' own `save_pretrained` loads into HARTS with transformers' logits, alone
    and padded on either side; HARTS saves it back (sharded or not) and transformers reads it strictly to the same
    weights: logits bitwise."""
    settings = CASES[case]
    config = transformers_config(**settings.get("config", {}))
    model = transformers_model(config, seed=42)
    if config.tie_word_embeddings:
        # transformers' BailingHybrid never ties the head: a tied checkpoint is one whose head is the embedding.
        with torch.no_grad():
            model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    root = tmp_path / "transformers"
    model.save_pretrained(root, max_shard_size=settings.get("shard", "1GB"))
    assert (root / "model.safetensors.index.json").is_file() == ("shard" in settings)
    sequences = _sequences(config.vocab_size)
    expected = {side: padded_logits(model, sequences, side) for side in PADDINGS}
    assert min(float(e.std()) for e in expected[None]) > 0.5, "logits too flat to compare"
    if settings.get("clips"):  # the limits change the function at these weights
        unclipped = transformers_model(transformers_config(), seed=42)
        unclipped.load_state_dict(model.state_dict())
        assert max_error(padded_logits(unclipped, sequences, None), expected[None]) > 1e-3

    loaded, loaded_config = load_hf_checkpoint(root)
    assert loaded_config.hf_layout == "bailing_hybrid"
    assert loaded_config.tie_embeddings == config.tie_word_embeddings
    actual = harts_logits(loaded, sequences)
    for side in PADDINGS:
        assert max_error(actual, expected[side]) <= TRANSFORMERS_TOLERANCE, side

    saved = tmp_path / "harts"
    files = save_hf_checkpoint(loaded, saved, max_shard_bytes=40_000 if "shard" in settings else 10**9)
    assert (len([f for f in files if f.suffix == ".safetensors"]) > 1) == ("shard" in settings)
    reloaded = load_strict(saved)
    for side in PADDINGS:
        assert all(torch.equal(a, e) for a, e in zip(padded_logits(reloaded, sequences, side), expected[side])), side


def hub_config(config: transformers.BailingHybridConfig) -> dict:
    """The config.json of `config` in the Hub's own schema (Ling-3.0's keys, as inclusionAI ships them)."""
    return {
        "architectures": ["BailingMoeV3ForCausalLM"], "model_type": "bailing_hybrid", "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers, "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_attention_heads, "head_dim": config.linear_head_dim,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "rotary_dim": config.qk_rope_head_dim, "rope_interleave": True, "use_qk_norm": True, "use_bias": False,
        "use_qkv_bias": False, "q_lora_rank": config.q_lora_rank, "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim, "qk_rope_head_dim": config.qk_rope_head_dim,
        "qk_head_dim": config.qk_head_dim, "v_head_dim": config.v_head_dim, "use_mla_nope": False,
        "gated_attention_proj_granularity_type": "head_wise", "layer_group_size": config.layer_group_size,
        "no_kda_lora": True, "use_kda_lora": False, "kda_safe_gate": True, "kda_lower_bound": -5.0,
        "short_conv_kernel_size": 4, "linear_silu": True, "group_norm_size": 1, "num_kv_heads_for_linear_attn": 0,
        "num_experts": config.num_local_experts, "num_experts_per_tok": config.num_experts_per_tok,
        "num_shared_experts": 1, "moe_intermediate_size": config.moe_intermediate_size,
        "moe_shared_expert_intermediate_size": config.moe_intermediate_size, "first_k_dense_replace": 1,
        "moe_router_enable_expert_bias": True, "norm_topk_prob": True, "n_group": config.n_group,
        "topk_group": config.topk_group, "topk_method": "noaux_tc", "score_function": "sigmoid",
        "scoring_func": "sigmoid", "routed_scaling_factor": config.routed_scaling_factor, "router_dtype": "fp32",
        "expert_swiglu_limit_list": None, "share_expert_swiglu_limit_list": None, "num_nextn_predict_layers": 0,
        "mtp_loss_scaling_factor": 0, "mtp_use_kda": False, "hidden_act": "silu", "tie_word_embeddings": False,
        "max_position_embeddings": 131072, "eos_token_id": 95, "pad_token_id": 96,
    }


def test_hub_schema_loads_to_the_same_model(tmp_path, offline):
    """transformers' checkpoint with the Hub's config.json (and the Hub's o_proj name for the KDA layers' output
    projection): transformers and HARTS both read it, to the logits of the original model."""
    config = transformers_config()
    model = transformers_model(config, seed=7)
    root = tmp_path / "hub"
    model.save_pretrained(root)
    (root / "config.json").write_text(json.dumps(hub_config(config)))
    with safe_open(root / "model.safetensors", "pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    kda_layers = [i for i, kind in enumerate(config.layer_types) if kind == "linear_attention"]
    for i in kda_layers:
        tensors[f"model.layers.{i}.attention.o_proj.weight"] = tensors.pop(f"model.layers.{i}.attention.dense.weight")
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    sequences = _sequences(config.vocab_size)
    expected = padded_logits(model, sequences, None)
    assert all(torch.equal(a, e) for a, e in zip(padded_logits(load_strict(root), sequences, None), expected))
    loaded, _ = load_hf_checkpoint(root)
    assert max_error(harts_logits(loaded, sequences), expected) <= TRANSFORMERS_TOLERANCE


@pytest.mark.parametrize("mtp", [False, True], ids=["no-mtp", "mtp"])
@pytest.mark.parametrize("max_shard_bytes", [10**9, 30_000], ids=["one-file", "sharded"])
def test_harts_model_runs_in_transformers(tmp_path, offline, max_shard_bytes, mtp):
    """A model of the shipped bailing-tiny config (HARTS's chunk size, its SwiGLU limits, training fields) saved by
    HARTS loads strictly in transformers, whose logits are HARTS's, alone and in batches padded on either side; with
    an MTP layer too, whose tensors (model.layers.{num_hidden_layers}.*) transformers reads past as Ling-3's."""
    config = load_model_config("bailing-tiny")
    if mtp:
        config = replace(config, mtp=MTPConfig(num_layers=1))
    model = harts_model(config, seed=42)
    root = tmp_path / "harts"
    save_hf_checkpoint(model, root, max_shard_bytes=max_shard_bytes)
    reference = load_strict(root)
    assert reference.config.num_mtp_layers == (1 if mtp else 0)
    sequences = _sequences(model.config.vocab_size)
    actual = harts_logits(model, sequences)
    for side in PADDINGS:
        expected = padded_logits(reference, sequences, side)
        assert min(float(e.std()) for e in expected) > 0.5, "logits too flat to compare"
        assert max_error(actual, expected) <= TRANSFORMERS_TOLERANCE, side
