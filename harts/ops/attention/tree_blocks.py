"""Tile lists of the DFS tree mask over rows in place: which key tiles each query tile sees, and the transpose.

The `triton_tree` backend (harts.ops.attention.tree_triton) reads K and V in place, without per-group copies of
the ancestors. Its rows are in DFS preorder (both layouts' are: the compact rows of a microbatch's trie, or the
baseline's packed trajectories), where query row r sees key row c iff c <= r < subtree_end[c]
(`AttentionGroups.row_subtree_end`). Query tile i holds rows [i·Bq, (i+1)·Bq), key tile j rows [j·Bk, (j+1)·Bk).
A tile pair (i, j) is listed iff some query row of tile i sees some key row of j: exactly the tiles a dense mask
has any True in. It is *full* iff every query row of i (below R) sees every key row of j (all below R), so the
kernel needs no mask there; else *partial*, and the kernel masks by subtree_end.

Key row c is seen by the query rows [c, subtree_end[c]); in preorder two such intervals are nested or disjoint,
so a key tile's query tiles are the union of a few disjoint runs (its rows' intervals merged in one pass): the
build is O(R + listed pairs) in numpy, once per layout (`tree_plan` caches it on the groups object, like the
FlexAttention block mask it replaces, which is built per call). `tree_mask_mismatch` checks in O(R + Σ keys)
that the groups' own query/key lists describe this same relation (a layout whose rows are not in preorder is
refused, not computed wrongly).
Tested in tests/ops/attention/test_tree_blocks.py against the dense mask `visibility_mask` of the groups.
Legend: R rows, Bq / Bk rows of a query / key tile, P listed tile pairs.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from harts.ops.attention.query_groups import AttentionGroups


@dataclass(frozen=True, eq=False)
class TileLists:
    """The listed tile pairs of a tree mask, as two CSR lists (int64 numpy arrays)."""

    num_rows: int
    block_q: int
    block_k: int
    q_ptr: np.ndarray
    """[num_q_tiles + 1]: query tile i's key tiles are q_tiles[q_ptr[i]:q_ptr[i + 1]] ..."""
    q_num_full: np.ndarray
    """[num_q_tiles]: ... the first q_num_full[i] of them full, the rest partial (each part ascending)."""
    q_tiles: np.ndarray
    """[P] key tiles."""
    q_order: np.ndarray
    """[num_q_tiles]: the query tiles by descending list length (the kernels launch the heaviest first)."""
    k_ptr: np.ndarray
    """[num_k_tiles + 1]: key tile j's query tiles are k_tiles[k_ptr[j]:k_ptr[j + 1]], full ones first."""
    k_num_full: np.ndarray
    k_tiles: np.ndarray
    """[P] query tiles."""
    k_order: np.ndarray

    @property
    def num_q_tiles(self) -> int:
        return len(self.q_order)

    @property
    def num_k_tiles(self) -> int:
        return len(self.k_order)

    @property
    def num_pairs(self) -> int:
        return len(self.q_tiles)

    @property
    def num_full(self) -> int:
        return int(self.q_num_full.sum())


def tile_lists(subtree_end: np.ndarray, block_q: int, block_k: int) -> TileLists:
    """The tile lists of the tree mask `c <= r < subtree_end[c]` over R = len(subtree_end) rows in preorder."""
    ends = np.asarray(subtree_end, dtype=np.int64)
    num_rows = len(ends)
    rows = np.arange(num_rows, dtype=np.int64)
    assert num_rows > 0 and (ends > rows).all() and (ends <= num_rows).all(), "subtree ends of rows in preorder"
    num_q_tiles, num_k_tiles = -(-num_rows // block_q), -(-num_rows // block_k)
    # Key row c sees query tiles first..last; within a key tile, runs of overlapping intervals merge. The offset
    # of each key tile makes one running maximum serve every tile (a tile's values exceed all earlier tiles').
    first, last, key_tile = rows // block_q, (ends - 1) // block_q, rows // block_k
    offset = key_tile * (num_q_tiles + 1)
    running = np.maximum.accumulate(last + offset)
    starts = np.flatnonzero(first + offset > np.concatenate([[-1], running[:-1]]))
    stops = np.append(starts[1:], num_rows) - 1
    run_lo, run_hi, run_tile = first[starts], running[stops] - offset[stops], key_tile[starts]
    counts = run_hi - run_lo + 1
    pair_k = np.repeat(run_tile, counts)
    pair_q = np.repeat(run_lo - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))
    min_end = np.minimum.reduceat(ends, np.arange(0, num_rows, block_k))
    full = (((pair_k + 1) * block_k <= num_rows) & ((pair_k + 1) * block_k - 1 <= pair_q * block_q)
            & (min_end[pair_k] >= np.minimum((pair_q + 1) * block_q, num_rows)))

    def csr(major: np.ndarray, minor: np.ndarray, num_major: int):
        order = np.lexsort((minor, ~full, major))
        lengths = np.bincount(major, minlength=num_major)
        ptr = np.zeros(num_major + 1, dtype=np.int64)
        np.cumsum(lengths, out=ptr[1:])
        return ptr, np.bincount(major[full], minlength=num_major), minor[order], np.argsort(-lengths, kind="stable")

    q_ptr, q_num_full, q_tiles, q_order = csr(pair_q, pair_k, num_q_tiles)
    k_ptr, k_num_full, k_tiles, k_order = csr(pair_k, pair_q, num_k_tiles)
    return TileLists(num_rows=num_rows, block_q=block_q, block_k=block_k, q_ptr=q_ptr, q_num_full=q_num_full,
                     q_tiles=q_tiles, q_order=q_order, k_ptr=k_ptr, k_num_full=k_num_full, k_tiles=k_tiles,
                     k_order=k_order)


def tree_mask_mismatch(groups: AttentionGroups) -> str | None:
    """Why the groups' visibility (query i of a group sees its keys j <= h + i) is not the tree mask
    `c <= r < row_subtree_end[c]`, or None when it is. With every group's queries and keys ascending (so no pair
    twice), the groups' pairs are the tree mask's iff each one is in it and they are as many: key j is seen by
    the group's queries from i0 = max(0, j − h) to the last, the smallest and largest of them, so it lies in
    the tree mask iff key_j <= query_i0 and query_last < subtree_end[key_j]."""
    q_index, q_ptr = groups.q_index.cpu().numpy(), groups.q_ptr.cpu().numpy()
    kv_index, kv_ptr = groups.kv_index.cpu().numpy(), groups.kv_ptr.cpu().numpy()
    ends = groups.row_subtree_end.cpu().numpy()
    num_rows = len(ends)
    if len(q_index) != num_rows or (np.bincount(q_index, minlength=num_rows) != 1).any():
        return f"the queries are not each of the {num_rows} rows once"
    own, keys = np.diff(q_ptr), np.diff(kv_ptr)
    ancestors = keys - own
    if (own < 1).any() or (ancestors < 0).any():
        return "a group without queries, or with fewer keys than queries"
    for name, index, ptr in (("queries", q_index, q_ptr), ("keys", kv_index, kv_ptr)):
        inside = np.ones(len(index), dtype=bool)
        inside[ptr[:-1]] = False
        if (np.diff(index, prepend=-1)[inside] <= 0).any():
            return f"a group's {name} are not in ascending rows"
    group = np.repeat(np.arange(len(own)), keys)
    j = np.arange(len(kv_index)) - kv_ptr[group]
    first_seen = q_index[q_ptr[group] + np.maximum(0, j - ancestors[group])]
    last_seen = q_index[q_ptr[group + 1] - 1]
    if not ((kv_index <= first_seen) & (last_seen < ends[kv_index])).all():
        return "a group sees a key row outside the tree mask (rows not in DFS preorder?)"
    if groups.num_pairs != int((ends - np.arange(num_rows)).sum()):
        return "the tree mask holds pairs that no group sees"
    return None


@dataclass(frozen=True, eq=False)
class TreePlan:
    """A layout's tile lists on a device (int32), what the kernels read."""

    lists: TileLists
    subtree_end: torch.Tensor
    q_ptr: torch.Tensor
    q_num_full: torch.Tensor
    q_tiles: torch.Tensor
    q_order: torch.Tensor
    k_ptr: torch.Tensor
    k_num_full: torch.Tensor
    k_tiles: torch.Tensor
    k_order: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.lists.num_rows

    @property
    def by_query(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_order, q_ptr, q_num_full, q_tiles): the query tiles' lists, which the forward and dQ kernels walk."""
        return self.q_order, self.q_ptr, self.q_num_full, self.q_tiles

    @property
    def by_key(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k_order, k_ptr, k_num_full, k_tiles): the key tiles' lists, which the dK/dV kernel walks."""
        return self.k_order, self.k_ptr, self.k_num_full, self.k_tiles


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tree_plan(groups: AttentionGroups, block_q: int, block_k: int, device: torch.device | str) -> TreePlan:
    """The tile lists of `groups` for tiles of block_q x block_k rows on `device`, built once per groups object
    (a layout's) and tile shape; ValueError when the groups are not the tree mask (`tree_mask_mismatch`)."""
    device = torch.device(device)
    plans = _PLANS.setdefault(groups, {})
    key = (block_q, block_k, device)
    if key not in plans:
        mismatch = tree_mask_mismatch(groups)
        if mismatch is not None:
            raise ValueError(f"attention backend 'triton_tree' reads the tree mask of rows in DFS preorder, and "
                             f"these attention groups are not one: {mismatch}")
        ends = groups.row_subtree_end.cpu().numpy()
        lists = tile_lists(ends, block_q, block_k)

        def put(x: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int32)).to(device)

        plans[key] = TreePlan(lists=lists, subtree_end=put(ends), **{
            name: put(getattr(lists, name)) for name in
            ("q_ptr", "q_num_full", "q_tiles", "q_order", "k_ptr", "k_num_full", "k_tiles", "k_order")})
    return plans[key]
