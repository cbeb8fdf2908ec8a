"""harts.model.hf's Gated DeltaNet layouts against transformers' own `Qwen3NextForCausalLM` and
`Qwen3_5MoeForCausalLM` (5.25), as tests/model/test_hf_reference.py does for Kimi-Linear.

Checkpoints transformers writes itself: tiny configs built by transformers (`Qwen3NextConfig`,
`Qwen3_5MoeTextConfig`: grouped values, grouped KV heads, partial rotary, a dense first layer for Qwen3-Next),
models built from them with random weights, saved with `save_pretrained` (one file or shards). HARTS loads them
to transformers' logits within 1e-5 of the largest, for each sequence alone and in batches padded on the left
and on the right (transformers zeroes the padded rows of its GDN layers and masks them in its attention); HARTS
saves them back and transformers reads every weight back bitwise (its logits then agree with its own within the
last bits of fp32: the same weights at other addresses take other vectorised paths in its CPU kernels; measured
0 to 5.4e-7 of the largest logit, and 3.6e-7 between transformers' in-memory model and its own reload). The other
way, HARTS models of the shipped gdn-tiny config (and a Qwen3.5 variant without dense layers) saved by HARTS give
transformers HARTS's logits within the same tolerance. Only public APIs of transformers are used. On CPU inputs
transformers runs its PyTorch gated delta rule (chunks of 64, fp32), HARTS its own (chunks of 16 for gdn-tiny).

Weights (`qwen_weights`): test_hf_reference's `random_weights` with every matrix but the embedding, head and conv
halved, the (1 + w) norms' w near 0 (an effective scale near 1) and dt_bias −1 (decays of 0.1 to 0.9 a token).
With unit-variance matrices and transformers' dt_bias of 1 this random network amplifies rounding ~50-fold: both
transformers' and HARTS's fp32 logits then sit 2e-5 to 8e-5 (of the largest) from HARTS's float64 ones. Here each
is 2e-6 to 5e-6 from them (four seeds), and HARTS's from transformers' 1.1e-6 to 6.1e-6 over the cases below (logits
up to 5.9), fp32 rounding on both sides; a swapped q/k or b/a block, KV-head order or a (1 + w) norm read as w
moves the logits far beyond 1e-5 (planted).
"""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
import transformers

from harts.model.config import load_model_config
from harts.model.hf import hf_tensor_shapes, load_hf_checkpoint, save_hf_checkpoint
from harts.model.model import HybridModel
from tests.model.test_hf_reference import (
    LENGTHS, PADDINGS, TRANSFORMERS_TOLERANCE, harts_logits, max_error, offline, padded_logits, random_weights,
)

assert offline  # the fixture, used by name below

CLASSES = {"qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
           "qwen3_5_moe_text": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM)}


def transformers_config(model_type: str, **changes):
    """A tiny config built by transformers: 4 layers (GDN, GDN, GDN, attention), 2 key heads with 4 value heads,
    K = 8 != V = 12, 4 attention heads over 2 KV heads of 16 dims with a quarter rotated; Qwen3-Next's first layer
    dense."""
    settings = dict(
        vocab_size=97, hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=12,
        linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=20,
        shared_expert_intermediate_size=24, num_experts_per_tok=2, num_experts=6,
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )
    if model_type == "qwen3_next":
        settings.update(intermediate_size=40, mlp_only_layers=[0])
    settings.update(changes)
    return CLASSES[model_type][0](**settings)


CENTERED_NORMS = ("layernorm.weight", "mixer_norm.weight", "mlp_norm.weight", "q_norm.weight", "k_norm.weight",
                  "model.norm.weight", "final_norm.weight")
"""The (1 + w) RMSNorms, in transformers' names and HARTS's (not the GDN's gated norm)."""


def qwen_weights(tensors: dict[str, torch.Tensor], seed: int, fan_in) -> None:
    """`random_weights`, then matrices but the embedding, head and conv halved, the (1 + w) norms' w near 0 and
    dt_bias −1 (module docstring)."""
    random_weights(tensors, seed, fan_in)
    with torch.no_grad():
        for name, tensor in tensors.items():
            if name.endswith(CENTERED_NORMS):
                tensor.sub_(1.0)
            elif name.endswith("dt_bias"):
                tensor.fill_(-1.0)
            elif tensor.dim() >= 2 and not name.endswith(("embed_tokens.weight", "embed.weight", "lm_head.weight",
                                                          "conv1d.weight", "mixer.conv")):
                tensor.mul_(0.5)


def transformers_model(config, seed: int):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    qwen_weights(model.state_dict(), seed, lambda name, tensor: tensor.shape[-1])
    return model.eval()


def load_strict(root, model_type: str):
    """`from_pretrained` of the class of `model_type`, refusing any missing, unexpected or mis-shaped key."""
    model, info = CLASSES[model_type][1].from_pretrained(root, dtype=torch.float32, attn_implementation="eager",
                                                         output_loading_info=True)
    problems = {key: value for key, value in info.items() if value}
    assert not problems, problems
    return model.eval()


CASES = {
    "next-one-file": ("qwen3_next", {}, None),
    "next-sharded-unnormalised-irregular": (
        "qwen3_next", {"norm_topk_prob": False,
                       "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"]},
        "40KB"),
    "next-tied-full-rotary": ("qwen3_next", {"tie_word_embeddings": True, "partial_rotary_factor": 1.0}, None),
    "qwen3.5-one-file": ("qwen3_5_moe_text", {}, None),
    "qwen3.5-sharded-three-kv-groups": ("qwen3_5_moe_text", {"num_attention_heads": 6, "linear_num_value_heads": 6},
                                        "40KB"),
}


@pytest.mark.parametrize("case", CASES)
def test_transformers_save_pretrained_both_ways(tmp_path, offline, case):
    model_type, changes, shard = CASES[case]
    config = transformers_config(model_type, **changes)
    model = transformers_model(config, seed=42)
    root = tmp_path / "transformers"
    model.save_pretrained(root, max_shard_size=shard or "1GB")
    assert (root / "model.safetensors.index.json").is_file() == (shard is not None)
    assert json.loads((root / "config.json").read_text())["model_type"] == model_type
    rng = np.random.default_rng(42)
    sequences = [rng.integers(0, config.vocab_size, n).tolist() for n in (*LENGTHS, 5)]
    expected = {side: padded_logits(model, sequences, side) for side in PADDINGS}
    assert min(float(e.std()) for e in expected[None]) > 0.5, "logits too flat to compare"

    loaded, loaded_config = load_hf_checkpoint(root)
    assert loaded_config.hf_layout == model_type
    assert loaded_config.tie_embeddings == config.tie_word_embeddings
    actual = harts_logits(loaded, sequences)
    for side in PADDINGS:
        assert max_error(actual, expected[side]) <= TRANSFORMERS_TOLERANCE, side

    saved = tmp_path / "harts"
    files = save_hf_checkpoint(loaded, saved, max_shard_bytes=40_000 if shard else 10**9)
    assert (len([f for f in files if f.suffix == ".safetensors"]) > 1) == (shard is not None)
    reloaded = load_strict(saved, model_type)
    original = model.state_dict()
    assert reloaded.state_dict().keys() == original.keys()
    assert all(torch.equal(tensor, original[name]) for name, tensor in reloaded.state_dict().items())
    for side in PADDINGS:
        assert max_error(padded_logits(reloaded, sequences, side), expected[side]) <= 1e-6, side


def _gdn_tiny(model_type: str):
    config = load_model_config("gdn-tiny")
    if model_type == "qwen3_5_moe_text":
        config = replace(config, num_dense_layers=0, dense_hidden_size=0, hf_layout=model_type)
    return config


@pytest.mark.parametrize("model_type", CLASSES)
@pytest.mark.parametrize("max_shard_bytes", [10**9, 30_000], ids=["one-file", "sharded"])
def test_harts_model_runs_in_transformers(tmp_path, offline, model_type, max_shard_bytes):
    """A model of the shipped gdn-tiny config (chunks of 16, HARTS's training fields) saved by HARTS loads strictly
    in transformers, whose logits are HARTS's, alone and in batches padded on either side."""
    model = HybridModel(_gdn_tiny(model_type))
    model.init_weights(42)
    qwen_weights(model.state_dict(), 42,
                 lambda name, tensor: tensor.shape[-2] if name.endswith("_proj") else tensor.shape[-1])
    root = tmp_path / "harts"
    save_hf_checkpoint(model, root, max_shard_bytes=max_shard_bytes)
    assert json.loads((root / "config.json").read_text())["model_type"] == model_type
    reference = load_strict(root, model_type)
    rng = np.random.default_rng(42)
    sequences = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (*LENGTHS, 5)]
    actual = harts_logits(model, sequences)
    for side in PADDINGS:
        expected = padded_logits(reference, sequences, side)
        assert min(float(e.std()) for e in expected) > 0.5, "logits too flat to compare"
        assert max_error(actual, expected) <= TRANSFORMERS_TOLERANCE, side


def test_the_vision_language_prefix_is_the_text_model(tmp_path, offline):
    """Qwen3.5's vision-language checkpoints keep the text model under model.language_model. (transformers'
    Qwen3_5MoeForCausalLM reads it there too): the same weights load."""
    from safetensors.torch import load_file, save_file

    model = transformers_model(transformers_config("qwen3_5_moe_text"), seed=3)
    root = tmp_path / "plain"
    model.save_pretrained(root)
    renamed = tmp_path / "prefixed"
    renamed.mkdir()
    (renamed / "config.json").write_text((root / "config.json").read_text())
    tensors = load_file(root / "model.safetensors")
    save_file({name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name: t
               for name, t in tensors.items()}, renamed / "model.safetensors")
    plain, _ = load_hf_checkpoint(root)
    prefixed, _ = load_hf_checkpoint(renamed)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), prefixed.state_dict().values()))


def test_layout_shapes_are_transformers():
    """Every tensor of the layout is named and shaped as in transformers' own model of the same config (its
    state dict after its conversion: the per-expert tensors are fused there, so they are compared by count)."""
    for model_type in CLASSES:
        config = _gdn_tiny(model_type)
        ours = hf_tensor_shapes(config)
        theirs = {name: tuple(t.shape) for name, t in
                  transformers_model(_transformers_config_of(config, model_type), seed=0).state_dict().items()}
        experts = {name for name in ours if ".mlp.experts." in name}
        assert {name: shape for name, shape in ours.items() if name not in experts} == {
            name: shape for name, shape in theirs.items() if ".mlp.experts." not in name}, model_type


def _transformers_config_of(config, model_type: str):
    from harts.model.hf import hf_config_from_model

    hf = hf_config_from_model(config)
    hf.pop("harts")
    for key in ("architectures", "model_type", "dtype"):
        hf.pop(key)
    return CLASSES[model_type][0](**hf)
