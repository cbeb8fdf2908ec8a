"""harts.model.config: a model config with a size of zero, a NaN or a negative epsilon is refused by file and key."""

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from harts.model.config import MTPConfig, load_model_config

REPO = Path(__file__).resolve().parents[2]
BAD = {
    "zero-kda-heads": ("kda", "num_heads", 0, "kda.num_heads must be a positive integer, got 0"),
    "zero-mla-heads": ("mla", "num_heads", 0, "mla.num_heads must be a positive integer, got 0"),
    "odd-rope-dim": ("mla", "qk_rope_head_dim", 3, "mla.qk_rope_head_dim must be an even integer >= 0, got 3"),
    "nan-norm-eps": (None, "norm_eps", float("nan"), "model.norm_eps must be a finite number in (0, 1), got nan"),
    "negative-norm-eps": (None, "norm_eps", -1e-6, "model.norm_eps must be a finite number in (0, 1), got -1e-06"),
    "zero-latent-eps": ("mla", "latent_norm_eps", 0.0, "mla.latent_norm_eps must be a finite number in (0, 1)"),
    "zero-vocabulary": (None, "vocab_size", 0, "model.vocab_size must be a positive integer, got 0"),
    "nan-aux-loss": ("moe", "aux_loss_coeff", float("nan"), "MoEConfig: aux_loss_coeff must be a finite number >= 0"),
    "zero-chunk": ("kda", "chunk_size", 0, "kda.chunk_size must be a positive integer, got 0"),
    # the Gated DeltaNet family (gdn-tiny)
    "gdn-value-heads": ("gdn", "num_value_heads", 3, "gdn.num_value_heads (3) must be a multiple of num_key_heads (2)"),
    "gdn-zero-key-dim": ("gdn", "key_head_dim", 0, "gdn.key_head_dim must be a positive integer, got 0"),
    "gqa-kv-heads": ("gated_attention", "num_kv_heads", 3, "gated_attention.num_kv_heads (3) must divide num_heads"),
    "gqa-odd-rotary": ("gated_attention", "rotary_dim", 5, "gated_attention.rotary_dim must be an even integer"),
    "gqa-rotary-above-head": ("gated_attention", "rotary_dim", 18, "in [0, head_dim = 16], got 18"),
    "gdn-beside-kda": (None, "kda", {"num_heads": 2, "head_dim": 16}, "give exactly one linear-attention section"),
    "no-attention": (None, "gated_attention", None, "give exactly one attention section, mla or gated_attention"),
    "unknown-hf-layout": (None, "hf_layout", "llama", "model.hf_layout must be one of"),
    "gdn-in-kimi-layout": (None, "hf_layout", "kimi_linear", "'kimi_linear' is not a layout of this model's"),
    "gdn-in-bailing-layout": (None, "hf_layout", "bailing_hybrid", "'bailing_hybrid' is not a layout of this"),
    "gate-without-shared-expert": ("moe", "shared_expert_hidden_size", 0, "shared_expert_gate needs a shared expert"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_sizes_and_epsilons_are_refused_by_file_and_key(tmp_path, case):
    section, key, value, message = BAD[case]
    base = "gdn-tiny" if case.startswith(("gdn", "gqa", "no-attention", "unknown-hf", "gate-without")) else "tiny"
    config = yaml.safe_load((REPO / f"configs/models/{base}.yaml").read_text())
    (config[section] if section else config)[key] = value
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError) as error:
        load_model_config(str(path))
    assert str(error.value).startswith(f"{path}: ") and message in str(error.value)


@pytest.mark.parametrize("name", ["tiny", "cpu-small", "h200", "ling3-tiny", "ling3-tiny-mtp", "ling3-tiny-shape",
                                  "ling3-tiny-8l", "kimi-tiny", "bailing-tiny", "gdn-tiny", "gdn-h200"])
def test_the_shipped_models_pass(name):
    assert load_model_config(name).name == name


def test_ling3_tiny_mtp_is_ling3_tiny_with_its_mtp_layer():
    """ling3-tiny-mtp is ling3-tiny but for its name and Ling-3.0-tiny's one MLA MTP layer, with the MTP loss on."""
    with_mtp = load_model_config("ling3-tiny-mtp")
    assert with_mtp.mtp == MTPConfig(num_layers=1, loss_scaling_factor=0.1, layer_kind="mla")
    assert load_model_config("ling3-tiny").mtp is None
    assert replace(with_mtp, name="ling3-tiny", mtp=None) == load_model_config("ling3-tiny")


def test_ling3_tiny_8l_is_ling3_tiny_with_8_layers():
    """ling3-tiny-8l (for measuring Ling-3.0-tiny's layers on an 80 GB GPU) differs from ling3-tiny only in its name and
    its first 8 of 24 layers, two whole layer groups."""
    eight = load_model_config("ling3-tiny-8l")
    assert eight.num_layers == 8 and eight.num_layers % eight.layers_per_group == 0
    assert replace(eight, name="ling3-tiny", num_layers=24) == load_model_config("ling3-tiny")


BAD_MTP = {
    "zero-depths": ({"num_layers": 0}, "mtp.num_layers must be a positive integer, got 0"),
    "negative-factor": ({"num_layers": 1, "loss_scaling_factor": -0.1},
                        "mtp.loss_scaling_factor must be a finite number >= 0, got -0.1"),
    "unknown-kind": ({"num_layers": 1, "layer_kind": "gdn"}, "mtp.layer_kind must be one of ('mla', 'kda'), got 'gdn'"),
    "unknown-key": ({"num_layers": 1, "depth": 2}, "unknown key 'mtp.depth'"),
}


def _with_mtp(tmp_path, mtp):
    config = yaml.safe_load((REPO / "configs/models/tiny.yaml").read_text())
    config["mtp"] = mtp
    path = tmp_path / "mtp.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_an_mtp_section_is_read_with_its_defaults(tmp_path):
    config = load_model_config(str(_with_mtp(tmp_path, {"num_layers": 2})))
    assert (config.mtp.num_layers, config.mtp.loss_scaling_factor, config.mtp.layer_kind) == (2, 0.1, "mla")
    assert load_model_config("tiny").mtp is None


@pytest.mark.parametrize("case", BAD_MTP)
def test_a_bad_mtp_section_is_refused_by_file_and_key(tmp_path, case):
    mtp, message = BAD_MTP[case]
    path = _with_mtp(tmp_path, mtp)
    with pytest.raises(ValueError) as error:
        load_model_config(str(path))
    assert str(error.value).startswith(f"{path}: ") and message in str(error.value)
