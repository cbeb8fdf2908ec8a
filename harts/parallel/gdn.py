"""Tensor parallelism of the Gated DeltaNet family's layers (harts.model.gdn), as harts.parallel.tensor does for
KDA and MLA: `shard_gdn` and `shard_gated_attention` cut a layer's parameters in place to this rank's heads and
return the names of the whole parameters whose gradient on a rank is partial.

- GDN: the rank's contiguous block of H / tp query/key heads and of the HV / tp value heads that read them (value
  head j reads key head j // (HV / H), so the blocks line up): `in_proj`'s rows of those heads in each of its parts
  (q, k, v, z, b, a: the rank's `in_proj` has the same [q | k | v | z | b | a] structure), the conv channels of
  q, k and v, A_log and dt_bias by value head, o_proj by input columns; the gated norm's per-head-dim weight stays
  whole (partial). The layout and its call schedule are per row: every rank runs the same schedule on its heads.
- Gated GQA: q_proj by heads (each head's query and gate rows), k_proj and v_proj by KV heads (the rank's query
  heads read exactly its KV heads), o_proj by input columns; q_norm and k_norm stay whole (partial).
Reference (tests/parallel/test_tensor.py): the ranks' sharded layers add up to the unsharded layer, forward and
every gradient, and the specs reassemble every cut parameter.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from harts.model.gdn import GatedAttentionLayer, GDNLayer
from harts.parallel.tensor import Sharder, head_index


def _set_linear_sizes(linear) -> None:
    linear.out_features, linear.in_features = linear.weight.shape


def shard_gdn(sharder: Sharder, layer: GDNLayer, rank: int, size: int) -> list[str]:
    c = layer.config
    key_width, value_width = layer.key_width, layer.value_width
    q = head_index(c.num_key_heads, c.key_head_dim, rank, size)
    v = head_index(c.num_value_heads, c.value_head_dim, rank, size)
    heads = head_index(c.num_value_heads, 1, rank, size)
    conv_rows = torch.cat([q, key_width + q, 2 * key_width + v])
    z0 = layer.conv_width
    b0 = z0 + value_width
    rows = torch.cat([conv_rows, z0 + v, b0 + heads, b0 + c.num_value_heads + heads])
    sharder.cut(layer.in_proj, "weight", 0, rows)
    _set_linear_sizes(layer.in_proj)
    sharder.cut(layer, "conv", 0, conv_rows)
    sharder.cut(layer, "A_log", 0, heads)
    sharder.cut(layer, "dt_bias", 0, heads)
    sharder.cut(layer.o_proj, "weight", 1, v)
    _set_linear_sizes(layer.o_proj)
    layer.config = replace(c, num_key_heads=c.num_key_heads // size, num_value_heads=c.num_value_heads // size)
    layer.key_width, layer.value_width = key_width // size, value_width // size
    layer.conv_width = 2 * layer.key_width + layer.value_width
    return [sharder.name(layer.o_norm.weight)]


def shard_gated_attention(sharder: Sharder, layer: GatedAttentionLayer, rank: int, size: int) -> list[str]:
    c = layer.config
    sharder.cut(layer.q_proj, "weight", 0, head_index(c.num_heads, 2 * c.head_dim, rank, size))
    for linear in (layer.k_proj, layer.v_proj):
        sharder.cut(linear, "weight", 0, head_index(c.num_kv_heads, c.head_dim, rank, size))
    sharder.cut(layer.o_proj, "weight", 1, head_index(c.num_heads, c.head_dim, rank, size))
    for linear in (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj):
        _set_linear_sizes(linear)
    layer.config = replace(c, num_heads=c.num_heads // size, num_kv_heads=c.num_kv_heads // size)
    return [sharder.name(layer.q_norm.weight), sharder.name(layer.k_norm.weight)]
