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
build is O(R + listed pairs) in numpy (two stable sorts of the pairs), once per layout (unlike the FlexAttention
block mask it replaces, which is built per call): `tree_plan` caches the device's copy on the groups object, and
`host_tile_lists` the lists on the groups' host copy, from which they are built, so that a layout moved to the
GPU neither reads its groups back (a wait for the device, in the first attention layer's forward) nor builds its
lists again when moved twice; the plan goes up in one asynchronous copy. `tree_mask_mismatch` checks in
O(R + Σ keys), once per host groups, that the groups' own query/key lists describe this same relation (a layout
whose rows are not in preorder is refused, not computed wrongly).
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
    # The pairs come out by key tile, each key tile's query tiles ascending.
    pair_k = np.repeat(run_tile, counts)
    pair_q = np.repeat(run_lo - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))
    # Key tile j (inside R) is full for the query tiles from the first whose rows all follow its last key row up to
    # the last whose rows all lie below its rows' smallest subtree end.
    tiles = np.arange(num_k_tiles, dtype=np.int64)
    min_end = np.minimum.reduceat(ends, tiles * block_k)
    key_stop = (tiles + 1) * block_k
    lowest = np.where(key_stop <= num_rows, -(-(key_stop - 1) // block_q), num_q_tiles)
    highest = np.where(min_end >= num_rows, num_q_tiles - 1, min_end // block_q - 1)
    full = (pair_q >= lowest[pair_k]) & (pair_q <= highest[pair_k])
    partial = ~full

    def csr(major: np.ndarray, minor: np.ndarray, num_major: int):
        # By major tile, full ones first; stable, so each part keeps the pairs' order, minor ascending (the pairs
        # are by key tile, then query tile ascending: either way round, minor ascending within a major tile).
        order = np.argsort(major * 2 + partial, kind="stable")
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
    groups = groups.on_host()
    q_index, q_ptr = groups.q_index.numpy(), groups.q_ptr.numpy()
    kv_index, kv_ptr = groups.kv_index.numpy(), groups.kv_ptr.numpy()
    ends = groups.row_subtree_end.numpy()
    num_rows = len(ends)
    if len(q_index) != num_rows or (np.bincount(q_index, minlength=num_rows) != 1).any():
        return f"the queries are not each of the {num_rows} rows once"
    own, keys = np.diff(q_ptr), np.diff(kv_ptr)
    ancestors = keys - own
    if (own < 1).any() or (ancestors < 0).any():
        return "a group without queries, or with fewer keys than queries"
    for name, index, ptr in (("queries", q_index, q_ptr), ("keys", kv_index, kv_ptr)):
        step = np.diff(index, prepend=-1)
        step[ptr[:-1]] = 1  # a group's first row is not compared with the previous group's last
        if (step <= 0).any():
            return f"a group's {name} are not in ascending rows"
    # Each key's i0 as a position in q_index: max(q_ptr, the key's position − kv_ptr − h + q_ptr) of its group.
    first_seen = q_index[np.maximum(np.repeat(q_ptr[:-1], keys),
                                    np.arange(len(kv_index)) + np.repeat(q_ptr[:-1] - kv_ptr[:-1] - ancestors, keys))]
    last_seen = np.repeat(q_index[q_ptr[1:] - 1], keys)
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


_HOST_LISTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BLOCK_MASKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PLAN_ARRAYS = ("subtree_end", "q_ptr", "q_num_full", "q_tiles", "q_order", "k_ptr", "k_num_full", "k_tiles",
                "k_order")
_ALIGNMENT = 4
"""int32 elements in 16 bytes: every array of a plan starts at a multiple of them in its buffer, as Triton
specialises a kernel on whether each pointer is 16-byte aligned (a plan's arrays that were not would compile the
kernels again, per layout)."""


def host_tile_lists(groups: AttentionGroups, block_q: int, block_k: int) -> TileLists:
    """The tile lists of `groups` built on the host from their host arrays (`AttentionGroups.on_host`: no read back
    from the device, which would wait for it), once per host groups and tile shape, after checking once per host
    groups that they are the tree mask (ValueError if not: `tree_mask_mismatch`)."""
    host = groups.on_host()
    built = _HOST_LISTS.setdefault(host, {})
    if "mismatch" not in built:
        built["mismatch"] = tree_mask_mismatch(host)
    if built["mismatch"] is not None:
        raise ValueError(f"attention backends 'flex', 'triton_tree' and 'flash4_tree' read the tree mask of rows in DFS "
                         f"preorder, and these attention groups are not one: {built['mismatch']}")
    if (block_q, block_k) not in built:
        built[block_q, block_k] = tile_lists(host.row_subtree_end.numpy(), block_q, block_k)
    return built[block_q, block_k]


def _upload(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """int32 copies of `arrays` on `device`: one host buffer (each array starting `_ALIGNMENT`-aligned) and one
    copy, to a GPU from pinned memory and asynchronous, so that the host does not wait for the device."""
    sizes = [len(x) for x in arrays]
    starts = np.concatenate([[0], np.cumsum([-(-size // _ALIGNMENT) * _ALIGNMENT for size in sizes])])
    buffer = np.zeros(int(starts[-1]), dtype=np.int32)
    for x, start in zip(arrays, starts):
        buffer[start : start + len(x)] = x
    flat = torch.from_numpy(buffer)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    else:
        flat = flat.to(device)
    return [flat[start : start + size] for start, size in zip(starts.tolist(), sizes)]


def tree_plan(groups: AttentionGroups, block_q: int, block_k: int, device: torch.device | str) -> TreePlan:
    """The tile lists of `groups` for tiles of block_q x block_k rows on `device`, built once per groups object
    (a layout's) and tile shape from the host's copy of the groups (`host_tile_lists`: a layout moved to the device
    builds them without waiting for it); ValueError when the groups are not the tree mask (`tree_mask_mismatch`)."""
    def build(host: AttentionGroups, lists: TileLists, device: torch.device) -> TreePlan:
        tensors = _upload([host.row_subtree_end.numpy(), *(getattr(lists, name) for name in _PLAN_ARRAYS[1:])],
                          device)
        return TreePlan(lists=lists, **dict(zip(_PLAN_ARRAYS, tensors)))

    return _per_layout(_PLANS, groups, block_q, block_k, device, build)


def _per_layout(cache: weakref.WeakKeyDictionary, groups: AttentionGroups, block_q: int, block_k: int,
                device: torch.device | str, build):
    """`build(host groups, their tile lists, device)`, once per groups object, tile shape and device in `cache`."""
    device = torch.device(device)
    built = cache.setdefault(groups, {})
    key = (block_q, block_k, device)
    if key not in built:
        host = groups.on_host()
        built[key] = build(host, host_tile_lists(host, block_q, block_k), device)
    return built[key]


def block_mask_arrays(lists: TileLists) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The query tiles' lists in FlexAttention's `BlockMask` form (int32, left-packed, key tiles ascending, padding
    0): (partial counts [Mq], partial key tiles [Mq, Mk], full counts [Mq], full key tiles [Mq, Mk]). A query tile
    reaching past R has no full tiles there (FlexAttention's full tiles have all their rows inside R)."""
    num_q, num_k = lists.num_q_tiles, lists.num_k_tiles
    lengths = np.diff(lists.q_ptr)
    tile = np.repeat(np.arange(num_q), lengths)
    full = np.arange(lists.num_pairs) - np.repeat(lists.q_ptr[:-1], lengths) < lists.q_num_full[tile]
    if lists.num_rows % lists.block_q:
        full &= tile < num_q - 1
    arrays = []
    for part in (~full, full):
        order = np.lexsort((lists.q_tiles[part], tile[part]))
        keys, tiles = lists.q_tiles[part][order], tile[part][order]
        counts = np.bincount(tiles, minlength=num_q)
        dense = np.zeros((num_q, num_k), dtype=np.int32)
        dense[tiles, np.arange(len(tiles)) - np.repeat(np.cumsum(counts) - counts, counts)] = keys
        arrays += [counts.astype(np.int32), dense]
    return tuple(arrays)


def tree_block_mask(groups: AttentionGroups, block_q: int, block_k: int, device: torch.device | str):
    """FlexAttention's `BlockMask` of the tree mask for tiles of block_q x block_k rows on `device`, from the tile
    lists (`host_tile_lists`: O(R + listed pairs) on the host, where `create_block_mask` evaluates the mask over all
    R x R pairs on every call), built once per groups object and tile shape; its mask_mod, which the kernels apply
    in the partial tiles, reads the subtree ends on `device`."""
    return tree_block_sparsity(groups, block_q, block_k, device)[0]


def tree_block_sparsity(groups: AttentionGroups, block_q: int, block_k: int, device: torch.device | str):
    """(`tree_block_mask`'s BlockMask, the int32 subtree ends [R] on `device` that its mask_mod reads), once per
    groups object, tile shape and device."""
    from torch.nn.attention.flex_attention import BlockMask

    def build(host: AttentionGroups, lists: TileLists, device: torch.device) -> tuple[BlockMask, torch.Tensor]:
        arrays = block_mask_arrays(lists)
        tensors = _upload([host.row_subtree_end.numpy(), *(a.reshape(-1) for a in arrays)], device)
        ends = tensors[0]
        partial_counts, partial_tiles, full_counts, full_tiles = (
            t.view(1, 1, *a.shape) for t, a in zip(tensors[1:], arrays))

        def tree_mask(batch, head, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx < ends[kv_idx])

        block_mask = BlockMask.from_kv_blocks(partial_counts, partial_tiles, full_counts, full_tiles,
                                              BLOCK_SIZE=(block_q, block_k), mask_mod=tree_mask,
                                              seq_lengths=(lists.num_rows, lists.num_rows))
        return block_mask, ends

    return _per_layout(_BLOCK_MASKS, groups, block_q, block_k, device, build)
