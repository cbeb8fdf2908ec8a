"""harts.model.flops against an independent count: torch's FlopCounterMode over the forward and the backward of a
step of the tiny config of each family (harts.objective.step.run_step, the per-trajectory execution, CPU, fp32, the
naive and sdpa attention backends); against the parameters of the model built on the meta device, for every shipped
config; and against terms written by hand.

What the counter sees (docs/flops.md, "Checked against a counter"), so what each check compares:
- aten.mm and aten.addmm are the weight products, 2·m·n·k each as the formula counts them. The backward adds one LM
  head per LM-head row (the compact log-probs recompute each chunk's logits instead of keeping them) and accumulates
  the LM head's weight gradient with the in-place addmm_, for which the counter has no formula: added here. Forward:
  the formula's weight products / 3; forward and backward: the formula's + one LM head per LM-head row.
- aten.bmm is the sequence mixing: the chunked KDA / GDN reference's products (harts.ops.kda.chunk: the formula's
  chunk work per row, over each sequence's rows padded to whole chunks) and SDPA's products, forced to its math path
  (the CPU's fused kernel has no counter formula), over the whole [queries, keys] rectangle: L² per trajectory with
  the sdpa backend's per-group calls, R² per microbatch with the naive backend's one dense mask, where the formula
  counts the causal pairs L(L + 1)/2. The short conv is elementwise (not seen). Forward: the formula's sequence
  mixing / 3 with those three substitutions. The backward's products are 2.0-2.1 times the forward's (the triangular
  solve's backward adds an O(B²) product per row; a zero initial state skips one): the 3 × convention, within that.
Both sides are exact integer counts of the same products, so the comparisons are exact (no tolerance).
In the compact execution the KDA / GDN layers also run their projections on the replay rows (an overhead the
formula leaves out): the counted weight products are the formula's over the compact rows plus exactly those.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from harts.config import shipped_configs
from harts.model.config import MTPConfig, load_model_config
from harts.model.flops import MIXERS, decoder_work, estimate_model_flops, mtp_work
from harts.model.model import HybridModel
from harts.model.moe import MoE
from harts.objective.step import StepConfig, run_step
from tests.objective.helpers import random_tree_step

FAMILIES = {
    # id: (model config, MTP layers)
    "kda-mla": ("tiny", None),  # low-rank gates and query, a dense first layer, a shared expert
    "kda-mla-kimi": ("kimi-tiny", None),  # full-rank query, NoPE MLA
    "ling": ("bailing-tiny", None),  # full-rank KDA gates, gated MLA, group-limited routing, SwiGLU limits
    "gdn-gqa": ("gdn-tiny", None),  # GDN, gated GQA with partial rotary, the gated shared expert
    "ling-mtp": ("bailing-tiny", MTPConfig(num_layers=1, loss_scaling_factor=0.1)),  # Ling-3.0's MTP layer
    "kda-mtp2": ("tiny", MTPConfig(num_layers=2, loss_scaling_factor=0.1, layer_kind="kda")),
}
BACKENDS = ("naive", "sdpa")


def _config(family: str):
    name, mtp = FAMILIES[family]
    config = load_model_config(name)
    return config if mtp is None else replace(config, mtp=mtp)


def _addmm_inplace_flop(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


@functools.cache
def _step():
    """Six trajectories sharing prefixes (lengths 2-40), in two microbatches."""
    step = random_tree_step(np.random.default_rng(0), num=6, max_len=40, vocab=50).step
    return step, (np.arange(3), np.arange(3, 6))


@functools.cache
def _counted(family: str, backend: str, execution: str = "baseline"):
    """(forward counts, forward + backward counts, the step's result) of the step by op name."""
    torch.manual_seed(0)
    model = HybridModel(_config(family))
    model.init_weights(seed=0)
    step, microbatches = _step()
    config = StepConfig(execution=execution, attention_backend=backend)
    counts, results = [], []
    for backward in (False, True):
        counter = FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: _addmm_inplace_flop})
        with sdpa_kernel([SDPBackend.MATH]), counter:
            results.append(run_step(model, step, list(microbatches), config, backward=backward))
        counts.append({str(op): flops for op, flops in counter.get_flop_counts()["Global"].items()})
    return counts[0], counts[1], results[1]


def _matmuls(counts: dict[str, int]) -> int:
    return sum(counts.get(op, 0) for op in ("aten.mm", "aten.addmm", "aten.addmm_"))


def _mtp_rows(config, step) -> list[int]:
    return [] if config.mtp is None else [int(np.maximum(step.lengths - k, 0).sum())
                                          for k in range(1, config.mtp.num_layers + 1)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_weight_products_are_the_counted_matmuls(family, backend):
    config = _config(family)
    step, _ = _step()
    forward, both, result = _counted(family, backend)
    mtp_rows = _mtp_rows(config, step)
    assert (result.num_mtp_rows or []) == mtp_rows
    flops = estimate_model_flops(config, step.num_semantic_tokens, 0, mtp_rows, [0] * len(mtp_rows))
    assert _matmuls(forward) * 3 == flops["matmul"]
    lm_head_rows = step.num_semantic_tokens + sum(mtp_rows)
    assert _matmuls(both) == flops["matmul"] + 2 * config.hidden_size * config.vocab_size * lm_head_rows


def _linear_attention_chunk_work(config, kind: str) -> int:
    """The formula's per-row chunk work of a linear-attention layer, without its conv (which the counter does not
    see: 2 × the conv's weights)."""
    work = MIXERS[kind](config).linear_attention_per_row
    c = config.linear_attention
    channels = (3 * c.num_heads * c.head_dim if kind == "kda"
                else 2 * c.num_key_heads * c.key_head_dim + c.num_value_heads * c.value_head_dim)
    return work - 2 * c.conv_size * channels


def _counted_mixing(config, kind: str, lengths: list[int], microbatch_rows: list[int], backend: str) -> int:
    """What the counter sees of one layer's sequence mixing over per-trajectory sequences of `lengths`."""
    if kind in ("kda", "gdn"):
        chunk = config.linear_attention.chunk_size
        return _linear_attention_chunk_work(config, kind) * sum(-(-n // chunk) * chunk for n in lengths)
    rectangle = sum(n * n for n in (lengths if backend == "sdpa" else microbatch_rows))
    return MIXERS[kind](config).attention_per_pair * rectangle


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_sequence_mixing_is_the_counted_batched_products(family, backend):
    config = _config(family)
    step, microbatches = _step()
    forward, both, _ = _counted(family, backend)
    lengths = step.lengths.astype(np.int64)
    expected = 0
    depths = [(0, kind) for kind in config.layer_kinds()]
    depths += [(k, config.mtp.layer_kind) for k in range(1, 1 + (config.mtp.num_layers if config.mtp else 0))]
    for depth, kind in depths:
        sequences = [int(n) - depth for n in lengths if n > depth]
        rows = [int(np.maximum(lengths[m] - depth, 0).sum()) for m in microbatches]
        expected += _counted_mixing(config, kind, sequences, rows, backend)
    assert forward["aten.bmm"] == expected
    assert 2.0 <= (both["aten.bmm"] - forward["aten.bmm"]) / forward["aten.bmm"] <= 2.1
    assert set(both) <= {"aten.mm", "aten.addmm", "aten.addmm_", "aten.bmm"}


@pytest.mark.parametrize("family", ["kda-mla", "ling", "gdn-gqa", "ling-mtp"])
def test_compact_weight_products_add_only_the_replay_rows(family):
    """The compact execution's counted weight products: the formula's over its compact rows (and MTP rows) plus the
    linear-attention layers' projections over the replay rows."""
    config = _config(family)
    forward, _, result = _counted(family, "sdpa", "compact")
    rows = sum(info["rows"] for info in result.layout_info)
    replay = sum(info["replay_rows"] for info in result.layout_info)
    assert rows < _step()[0].num_semantic_tokens and replay > 0
    mtp_rows = result.num_mtp_rows or []
    flops = estimate_model_flops(config, rows, 0, mtp_rows, [0] * len(mtp_rows))
    linear_layers = config.layer_kinds().count(config.linear_kind)
    replay_work = replay * linear_layers * MIXERS[config.linear_kind](config).matmul_per_row
    assert _matmuls(forward) * 3 == flops["matmul"] + 3 * replay_work


def _matrix_parameters(module: torch.nn.Module) -> int:
    """Parameters a row multiplies as matrices: every parameter of two or more dimensions but the embedding and the
    short convs' taps, the routed experts counted k of E."""
    moe_routed = {f"{name}.{tensor}" for name, layer in module.named_modules() if isinstance(layer, MoE)
                  for tensor in ("gate_up_proj", "down_proj")}
    total = 0
    for name, parameter in module.named_parameters():
        if parameter.dim() < 2 or name == "embed.weight" or name.endswith("_conv") or name.endswith("mixer.conv"):
            continue
        if name in moe_routed:
            moe = module.get_submodule(name.rsplit(".", 1)[0]).config
            total += parameter.numel() * moe.top_k // moe.num_experts
        else:
            total += parameter.numel()
    return total


@pytest.mark.parametrize("name", sorted(shipped_configs("models")) + ["kda-mtp2", "tied-head"])
def test_weight_products_are_twice_the_matrix_parameters(name):
    """Per row, the formula's forward weight products are 2 × the parameters the row multiplies as matrices (the
    model's own, on the meta device: every decoder matrix, the k routed experts, the LM head; an MTP depth's layer
    and the shared head): Ling-3.0-tiny's full-rank KDA gates and gated MLA, GDN's, all of them."""
    if name == "kda-mtp2":
        config = _config(name)
    elif name == "tied-head":
        config = replace(load_model_config("tiny"), tie_embeddings=True)
    else:
        config = load_model_config(name)
    with torch.device("meta"):
        model = HybridModel(config)
    decoder = _matrix_parameters(model) - (0 if model.mtp is None else _matrix_parameters(model.mtp))
    if config.tie_embeddings:
        decoder += config.vocab_size * config.hidden_size  # the head is the embedding table, multiplied again
    assert decoder_work(config).matmul_per_row == 2 * decoder
    if config.mtp is not None:
        for layer in model.mtp.layers:
            head = config.vocab_size * config.hidden_size
            assert mtp_work(config).matmul_per_row == 2 * (_matrix_parameters(layer) + head)


def test_terms_written_by_hand():
    """configs/models/tiny.yaml (D 64, V 256; KDA, KDA, KDA, MLA; the first layer dense) and gdn-tiny (GDN, GDN, GDN,
    gated GQA), and bailing-tiny with an MTP layer: each term spelled out."""
    tiny = decoder_work(load_model_config("tiny"))
    kda = 4 * 64 * 32 + 2 * (64 * 16 + 16 * 32) + 64 * 2  # q, k, v, o; the two low-rank gates; beta
    mla = (64 * 24 + 24 * 2 * 24) + 64 * (32 + 8) + 32 * 2 * (16 + 16) + 2 * 16 * 64
    dense, moe = 3 * 64 * 128, 64 * 4 + 2 * 3 * 64 * 32 + 3 * 64 * 32  # router, 2 routed experts, shared
    assert tiny.matmul_per_row == 2 * (64 * 256 + 3 * kda + mla + dense + 3 * moe)
    # Per head and row: B(3K + 2V) + 3KV (chunk 16, K = V = 16); the conv: 4 taps over q, k, v (3 x 32 channels).
    assert tiny.linear_attention_per_row == 3 * (2 * 2 * (16 * 5 * 16 + 3 * 16 * 16) + 2 * 4 * 96)
    assert tiny.attention_per_pair == 2 * 2 * (24 + 16)

    gdn_tiny = decoder_work(load_model_config("gdn-tiny"))
    gdn = 64 * (2 * 2 * 16 + 2 * 4 * 8 + 2 * 4) + 4 * 8 * 64  # in_proj: q, k, v, z, b, a; o
    gqa = 64 * (4 * 16 * 2 + 2 * 2 * 16) + 4 * 16 * 64  # the doubled (gated) query, grouped k and v, o
    gated_moe = moe + 64  # the shared expert's gate
    assert gdn_tiny.matmul_per_row == 2 * (64 * 256 + 3 * gdn + gqa + dense + 3 * gated_moe)
    # Per value head (4) and row: chunk 16, K = 16, V = 8; the conv over q, k (2 x 32) and v (32).
    assert gdn_tiny.linear_attention_per_row == 3 * (2 * 4 * (16 * (48 + 16) + 3 * 16 * 8) + 2 * 4 * 96)
    assert gdn_tiny.attention_per_pair == 2 * 4 * 2 * 16

    ling = _config("ling-mtp")
    full_kda = 4 * 64 * 32 + 2 * 64 * 32 + 64 * 2  # full-rank decay and output gates
    gated_mla = mla + 64 * 2  # the head-wise output gate
    ling_moe = 64 * 8 + 2 * 3 * 64 * 32 + 3 * 64 * 32
    assert decoder_work(ling).matmul_per_row == 2 * (64 * 256 + 3 * full_kda + gated_mla + dense + 3 * ling_moe)
    assert mtp_work(ling).matmul_per_row == 2 * (2 * 64 * 64 + gated_mla + ling_moe + 64 * 256)
    assert mtp_work(ling).attention_per_pair == tiny.attention_per_pair


def test_a_step_is_three_forwards_over_its_rows_pairs_and_mtp_depths():
    config = _config("kda-mtp2")
    decoder, depth = decoder_work(config), mtp_work(config)
    flops = estimate_model_flops(config, 100, 3000, [90, 80], [2500, 2000])
    assert flops["matmul"] == 3 * (100 * decoder.matmul_per_row + 170 * depth.matmul_per_row)
    assert flops["attention"] == 3 * (100 * decoder.linear_attention_per_row + 3000 * decoder.attention_per_pair
                                      + 170 * depth.linear_attention_per_row + 4500 * depth.attention_per_pair)
    assert estimate_model_flops(config, 100, 3000) == estimate_model_flops(replace(config, mtp=None), 100, 3000)
    with pytest.raises(ValueError, match="one entry per MTP depth"):
        estimate_model_flops(config, 100, 3000, [90, 80], [2500])
    with pytest.raises(ValueError, match="model 'tiny' has no MTP layers"):
        estimate_model_flops(load_model_config("tiny"), 100, 3000, [90], [2500])
