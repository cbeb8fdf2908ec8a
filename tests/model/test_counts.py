"""harts.model.counts against a closed-form count of the shapes, and Ling-3.0-tiny's published figures.

The closed form is written here from the layer definitions (harts.model.layers, harts.model.moe): per KDA layer
3·D·HK (q, k, v) + the gates' projections (full-rank: 2·D·HK; low-rank: 2·(D·r + r·HK) + the g bias) + D·H (β) +
HK·D (o) + 3·HK·W (convs) + HK + H + K (dt_bias, A_log, o_norm); per MLA layer the query (D·H·E or D·r + r + r·H·E),
kv_a D·(c + E_r) + c (norm) + c·H·(E_n + F) + H·F·D (o) (+ H·D with the output gate, + biases); per MoE layer
E·3·F·D + 3·S·D + E·D (router); dense MLP 3·D·I; 2·D norms a layer, the final norm, embedding and head; per MTP
depth 3·D norms, eh_proj 2·D·D and a block (its mixer, the MoE, 2·D norms). Active: k of the E routed experts.
"""

import pytest

from harts.model.config import ModelConfig, load_model_config
from harts.model.counts import parameter_counts


def closed_form(config: ModelConfig) -> tuple[int, int]:
    D, V = config.hidden_size, config.vocab_size
    kda, mla, moe = config.kda, config.mla, config.moe
    HK = kda.num_heads * kda.head_dim
    if kda.full_rank_gates:
        gates = 2 * D * HK + (HK if kda.output_gate_bias else 0)
    else:
        rank = kda.gate_rank or kda.head_dim
        gates = 2 * (D * rank + rank * HK) + (HK if kda.output_gate_bias else 0)
    kda_layer = 3 * D * HK + gates + D * kda.num_heads + HK * D + 3 * HK * kda.conv_size + HK + kda.num_heads \
        + kda.head_dim
    E = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    H = mla.num_heads
    query = D * H * E if not mla.q_lora_rank else D * mla.q_lora_rank + mla.q_lora_rank + mla.q_lora_rank * H * E
    mla_layer = query + D * (mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.kv_lora_rank \
        + mla.kv_lora_rank * H * (mla.qk_nope_head_dim + mla.v_head_dim) + H * mla.v_head_dim * D \
        + (H * D if mla.output_gate else 0)
    routed = moe.num_experts * 3 * moe.expert_hidden_size * D
    moe_rest = 3 * moe.shared_expert_hidden_size * D + moe.num_experts * D
    kinds = config.layer_kinds()
    num_moe = config.num_layers - config.num_dense_layers
    common = V * D * (1 if config.tie_embeddings else 2) + D + 2 * D * config.num_layers \
        + kinds.count("kda") * kda_layer + kinds.count("mla") * mla_layer \
        + config.num_dense_layers * 3 * D * config.dense_hidden_size + num_moe * moe_rest
    if config.mtp is not None:
        # Per depth: enorm, hnorm, eh_proj [D, 2D], final_layernorm, and a block (2 norms, the mixer, the MoE).
        mixer = kda_layer if config.mtp.layer_kind == "kda" else mla_layer
        common += config.mtp.num_layers * (3 * D + 2 * D * D + 2 * D + mixer + moe_rest)
        num_moe += config.mtp.num_layers
    return common + num_moe * routed, common + num_moe * routed * moe.top_k // moe.num_experts


@pytest.mark.parametrize("name", ["tiny", "bailing-tiny", "ling3-tiny", "ling3-tiny-8l", "ling3-tiny-mtp",
                                  "ling3-tiny-shape", "kimi-tiny", "cpu-small"])
def test_counts_are_the_closed_form(name):
    config = load_model_config(name)
    counts = parameter_counts(config)
    assert (counts.total, counts.active) == closed_form(config)
    assert counts.embedding == counts.head == config.vocab_size * config.hidden_size


def test_ling3_tiny_has_the_published_counts():
    """Ling-3.0-tiny's card: 7.9B total, 1.3B activated, to one decimal. The total rounds to 7.9B (7.893B); the
    activated count is 1.38B, 1.3B truncated (rounded it would read 1.4B): no reading of the published config makes
    both figures one rounding of the counts (docs/models.md)."""
    counts = parameter_counts(load_model_config("ling3-tiny"))
    assert round(counts.total / 1e9, 1) == 7.9
    assert int(counts.active / 1e8) / 10 == 1.3
    assert (counts.total, counts.active) == (7_893_389_856, 1_381_732_896)
    shape = parameter_counts(load_model_config("ling3-tiny-shape"))
    assert round(shape.total / 1e9, 2) == 10.43  # the shape this project ran as ling3-tiny before


def test_the_mtp_layer_is_counted_apart():
    """ling3-tiny-mtp: the MTP layer in the total and the active count, and apart (`mtp`, `mtp_active`); without it,
    ling3-tiny's counts, the card's."""
    with_mtp = parameter_counts(load_model_config("ling3-tiny-mtp"))
    assert (with_mtp.total, with_mtp.active) == (8_209_994_528, 1_415_222_048)
    assert (with_mtp.mtp, with_mtp.mtp_active) == (316_604_672, 33_489_152)
    assert with_mtp.without_mtp == parameter_counts(load_model_config("ling3-tiny"))
    assert parameter_counts(load_model_config("ling3-tiny")).mtp == 0


def test_a_tied_head_counts_once():
    config = load_model_config("tiny")
    tied = parameter_counts(ModelConfig(**{**config.__dict__, "tie_embeddings": True}))
    assert tied.head == 0 and parameter_counts(config).total - tied.total == config.vocab_size * config.hidden_size
