"""Model FLOPs of a training step: the count behind the speedup record's MFU and FLOPs efficiency (docs/flops.md).

`decoder_work(config)` and `mtp_work(config)` are the forward FLOPs of one row (a token, or a compact row) through
the decoder and the LM head, or through one MTP depth (its `eh_proj`, its block and the shared LM head), in three
parts: the weight products (2 × in × out of every matrix a row is multiplied by: projections, the dense MLP or the
router, the k routed experts and the shared expert with its gate, the LM head; not the embedding lookup, norms,
biases or gates' elementwise work), the linear-attention work per row (the chunked KDA / GDN form's products with
chunk size B, and the short convolution) and the attention work per causal (query, key) pair (MLA's or gated GQA's
scores and values). `estimate_model_flops` scales them to a step: 3 × forward (forward + backward, no
recomputation, no replay rows) over the given rows and pairs, MTP depths included when given.
Arithmetic on the config only. Tested against torch's FlopCounterMode over a forward and backward of the tiny
configs of each family, against the parameters of the model built on the meta device (the weight products are
2 × the active parameters less the embedding and the elementwise ones) and against hand-written terms
(tests/model/test_flops.py, tests/bench/speedup/test_metrics.py).
Legend: D hidden, V vocabulary, H heads, HV value heads, K/V linear-attention key/value head dims, B chunk size,
W conv width, E/F MLA query-key/value head dims.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

TRAINING_FACTOR = 3
"""Forward + backward = 3 × forward: each weight product has two more of its size in the backward (the input's and
the weight's gradients), and the sequence mixing is counted the same way."""


@dataclass(frozen=True)
class ForwardWork:
    """Forward FLOPs of one row through a stack of layers."""

    matmul_per_row: int
    """The weight products."""
    linear_attention_per_row: int
    """The linear-attention layers' chunked form and short convolutions."""
    attention_per_pair: int
    """The attention layers' work per causal (query, key) pair."""

    def __add__(self, other: ForwardWork) -> ForwardWork:
        return ForwardWork(self.matmul_per_row + other.matmul_per_row,
                           self.linear_attention_per_row + other.linear_attention_per_row,
                           self.attention_per_pair + other.attention_per_pair)


def _kda_work(c) -> ForwardWork:
    kda, D = c.kda, c.hidden_size
    width = kda.num_heads * kda.head_dim
    if kda.full_rank_gates:
        gates = 2 * D * width
    else:
        rank = kda.gate_rank or kda.head_dim
        gates = 2 * (D * rank + rank * width)
    weights = 4 * D * width + gates + D * kda.num_heads  # q, k, v, o; the decay and output gates; beta
    chunk = _chunk_work(kda.num_heads, kda.head_dim, kda.head_dim, kda.chunk_size)
    return ForwardWork(2 * weights, chunk + 2 * kda.conv_size * 3 * width, 0)


def _gdn_work(c) -> ForwardWork:
    gdn, D = c.gdn, c.hidden_size
    key_width = gdn.num_key_heads * gdn.key_head_dim
    value_width = gdn.num_value_heads * gdn.value_head_dim
    # in_proj: q, k, v, z, b, a; then o_proj.
    weights = D * (2 * key_width + 2 * value_width + 2 * gdn.num_value_heads) + value_width * D
    chunk = _chunk_work(gdn.num_value_heads, gdn.key_head_dim, gdn.value_head_dim, gdn.chunk_size)
    return ForwardWork(2 * weights, chunk + 2 * gdn.conv_size * (2 * key_width + value_width), 0)


def _chunk_work(value_heads: int, key_dim: int, value_dim: int, chunk: int) -> int:
    """Forward FLOPs per row of the chunked gated delta rule (fla's `chunk_kda` / `chunk_gated_delta_rule`,
    harts.ops.kda.chunk), per value head: within its chunk of B rows the key-key and query-key products
    (2·B·K each), the products of the inverted B×B system with the keys and the values (2·B·K, 2·B·V) and of the
    query-key scores with the new values (2·B·V); with the chunk's entry state S [K, V] the new values u − w·S, the
    output q·S and the state update kᵀ·v (2·K·V each). The B×B triangular inversion (O(B²) per row) is left out."""
    return 2 * value_heads * (chunk * (3 * key_dim + 2 * value_dim) + 3 * key_dim * value_dim)


def _mla_work(c) -> ForwardWork:
    mla, D = c.mla, c.hidden_size
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    heads = mla.num_heads
    query = D * mla.q_lora_rank + mla.q_lora_rank * heads * qk if mla.q_lora_rank else D * heads * qk
    weights = (query + D * (mla.kv_lora_rank + mla.qk_rope_head_dim)
               + mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
               + heads * mla.v_head_dim * D + (D * heads if mla.output_gate else 0))
    return ForwardWork(2 * weights, 0, 2 * heads * (qk + mla.v_head_dim))


def _gqa_work(c) -> ForwardWork:
    gqa, D = c.gated_attention, c.hidden_size
    width = gqa.num_heads * gqa.head_dim
    # The query projection doubled for the output gate; grouped k and v; o.
    weights = D * (2 * width + 2 * gqa.num_kv_heads * gqa.head_dim) + width * D
    return ForwardWork(2 * weights, 0, 2 * gqa.num_heads * 2 * gqa.head_dim)


MIXERS = {"kda": _kda_work, "gdn": _gdn_work, "mla": _mla_work, "gqa": _gqa_work}
"""The forward work of one token mixer by layer kind (`ModelConfig.layer_kind`), from the model config."""


def _mlp_work(c, dense: bool) -> ForwardWork:
    D, moe = c.hidden_size, c.moe
    if dense:
        return ForwardWork(2 * 3 * D * c.dense_hidden_size, 0, 0)
    weights = (D * moe.num_experts + moe.top_k * 3 * D * moe.expert_hidden_size + 3 * D * moe.shared_expert_hidden_size
               + (D if moe.shared_expert_gate else 0))  # router, the k routed experts, the shared expert and its gate
    return ForwardWork(2 * weights, 0, 0)


def _lm_head(c) -> ForwardWork:
    return ForwardWork(2 * c.hidden_size * c.vocab_size, 0, 0)


def decoder_work(config) -> ForwardWork:
    """Forward FLOPs of one row through the decoder's layers and the LM head."""
    work = _lm_head(config)
    for index, kind in enumerate(config.layer_kinds()):
        work = work + MIXERS[kind](config) + _mlp_work(config, dense=index < config.num_dense_layers)
    return work


def mtp_work(config) -> ForwardWork:
    """Forward FLOPs of one row of one MTP depth: `eh_proj` [2D -> D], its block (the mixer `mtp.layer_kind`, the
    MoE) and the shared LM head. ValueError for a model without MTP layers."""
    if config.mtp is None:
        raise ValueError(f"model {config.name!r} has no MTP layers")
    D = config.hidden_size
    return (ForwardWork(2 * 2 * D * D, 0, 0) + MIXERS[config.mtp.layer_kind](config) + _mlp_work(config, dense=False)
            + _lm_head(config))


def estimate_model_flops(model_config, rows: int, attention_pairs: int, mtp_rows: Sequence[int] = (),
                         mtp_attention_pairs: Sequence[int] = ()) -> dict[str, float]:
    """Training FLOPs (`TRAINING_FACTOR` × forward) of `rows` rows whose attention layers see `attention_pairs`
    causal (query, key) pairs, and of the MTP depths' `mtp_rows` and `mtp_attention_pairs` (one entry per depth
    that ran), in two parts:
    - "matmul": the weight products (`ForwardWork.matmul_per_row`), the model-FLOPs count of the parameters alone;
    - "attention": what sequence mixing adds: the linear-attention chunk work and convolutions per row and the
      attention's per pair.
    MFU is reported both ways (harts.bench.speedup.metrics.mfu_metrics): over "matmul" alone, and over the sum."""
    if len(mtp_rows) != len(mtp_attention_pairs):
        raise ValueError(f"mtp_rows ({len(mtp_rows)} depths) and mtp_attention_pairs ({len(mtp_attention_pairs)}) "
                         "must have one entry per MTP depth")
    decoder = decoder_work(model_config)
    matmul = decoder.matmul_per_row * rows
    mixing = decoder.linear_attention_per_row * rows + decoder.attention_per_pair * attention_pairs
    if len(mtp_rows):
        depth = mtp_work(model_config)
        for depth_rows, depth_pairs in zip(mtp_rows, mtp_attention_pairs):
            matmul += depth.matmul_per_row * depth_rows
            mixing += depth.linear_attention_per_row * depth_rows + depth.attention_per_pair * depth_pairs
    return {"matmul": float(TRAINING_FACTOR * matmul), "attention": float(TRAINING_FACTOR * mixing)}
