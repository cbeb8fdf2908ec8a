"""Inputs of the gated delta rule and the per-trajectory reference the compact GDN is compared with."""

from __future__ import annotations

import numpy as np
import torch

from harts.ops.gdn.chunk import chunk_gdn_torch
from harts.trees.trie import SegmentTree


def gdn_inputs(shape: tuple[int, ...], heads: int, value_heads: int, key_dim: int, value_dim: int,
               dtype: torch.dtype, seed: int, gate_scale: float = 1.0) -> list[torch.Tensor]:
    """q, k (L2-normalised), v, g ≤ 0, β ∈ (0, 1) of leading shape `shape`, as leaves requiring grad."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(*shape, heads, key_dim, generator=gen, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(*shape, heads, key_dim, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(*shape, value_heads, value_dim, generator=gen, dtype=torch.float64)
    g = -torch.rand(*shape, value_heads, generator=gen, dtype=torch.float64) * gate_scale
    beta = torch.rand(*shape, value_heads, generator=gen, dtype=torch.float64)
    return [x.to(dtype).requires_grad_() for x in (q, k, v, g, beta)]


def per_trajectory_gdn(inputs: list[torch.Tensor], tree: SegmentTree, chunk: int) -> torch.Tensor:
    """Every member trajectory its own sequence from position 0, one packed call over the semantic rows
    gathered through m: o [S, HV, V]."""
    index = torch.from_numpy(tree.compact_map())
    semantic = [x.index_select(0, index).unsqueeze(0) for x in inputs]
    cu = np.concatenate([[0], np.cumsum(tree.member_lengths)])
    o, _, _ = chunk_gdn_torch(*semantic, cu_seqlens=torch.from_numpy(cu), chunk_size=chunk)
    return o[0]
