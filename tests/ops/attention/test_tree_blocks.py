"""The tile lists of the tree mask (harts.ops.attention.tree_blocks) against the dense mask of the groups, the check
that groups are the tree mask, and the plans' cache: no Triton, no GPU."""

import warnings

import numpy as np
import pytest
import torch

from harts.ops.attention import tree_blocks
from harts.ops.attention.groups import visibility_mask
from harts.ops.attention.query_groups import AttentionGroups
from harts.ops.attention.tree_blocks import tile_lists, tree_mask_mismatch, tree_plan
from tests.ops.attention.helpers import LAYOUTS, named_layout
from tests.ops.kda.interpreter import counting_calls

BLOCKS = [(16, 16), (32, 16), (16, 32), (64, 64), (1, 1), (3, 5)]


def _tiles(mask: np.ndarray, block_q: int, block_k: int) -> tuple[np.ndarray, np.ndarray]:
    """(any, all) of each tile of a dense [R, R] mask, the tiles past R padded with (False, True)."""
    num_rows = len(mask)
    num_q, num_k = -(-num_rows // block_q), -(-num_rows // block_k)
    any_, all_ = np.zeros((num_q, num_k), bool), np.zeros((num_q, num_k), bool)
    for i in range(num_q):
        for j in range(num_k):
            tile = mask[i * block_q : (i + 1) * block_q, j * block_k : (j + 1) * block_k]
            any_[i, j] = tile.any()
            # A key tile reaching past R has keys the kernel must mask: never full.
            all_[i, j] = tile.all() and (j + 1) * block_k <= num_rows
    return any_, all_


def _pairs(ptr, num_full, tiles, major_is_q: bool):
    """{(query tile, key tile): full} of a CSR list, checking its order: full tiles first, each part ascending."""
    pairs = {}
    for major in range(len(ptr) - 1):
        listed = tiles[ptr[major] : ptr[major + 1]]
        split = num_full[major]
        for part in (listed[:split], listed[split:]):
            assert (np.diff(part) > 0).all(), (major, listed)
        for index, minor in enumerate(listed):
            pairs[(major, int(minor)) if major_is_q else (int(minor), major)] = index < split
    return pairs


@pytest.mark.parametrize("blocks", BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
@pytest.mark.parametrize("name", LAYOUTS)
def test_tile_lists_are_the_dense_masks_tiles(name, blocks):
    """Listed tiles = the tiles where the groups' dense mask has a True; full = all True (keys inside R); both
    lists hold the same pairs; the launch orders are permutations by descending list length."""
    layout = named_layout(name)
    mask = visibility_mask(layout.groups, layout.num_rows).numpy()
    lists = tile_lists(layout.groups.row_subtree_end.numpy(), *blocks)
    any_, all_ = _tiles(mask, *blocks)
    assert (lists.num_q_tiles, lists.num_k_tiles) == any_.shape
    by_q = _pairs(lists.q_ptr, lists.q_num_full, lists.q_tiles, True)
    by_k = _pairs(lists.k_ptr, lists.k_num_full, lists.k_tiles, False)
    assert by_q == by_k
    assert set(by_q) == set(zip(*np.nonzero(any_)))
    assert {pair for pair, full in by_q.items() if full} == set(zip(*np.nonzero(any_ & all_)))
    assert lists.num_pairs == int(any_.sum()) and lists.num_full == int((any_ & all_).sum())
    for ptr, order in ((lists.q_ptr, lists.q_order), (lists.k_ptr, lists.k_order)):
        assert sorted(order.tolist()) == list(range(len(ptr) - 1))
        assert (np.diff(np.diff(ptr)[order]) <= 0).all()


@pytest.mark.parametrize("seed", range(20))
def test_tile_lists_of_random_forests(seed):
    """Random forests in preorder (each row a child of a random row on the previous row's path, or a new root),
    tiles of random shapes."""
    rng = np.random.default_rng(seed)
    num_rows = int(rng.integers(1, 200))
    ends, path = np.zeros(num_rows, np.int64), []
    for row in range(num_rows):
        depth = int(rng.integers(0, len(path) + 1))
        while len(path) > depth:
            ends[path.pop()] = row
        path.append(row)
    ends[path] = num_rows
    r, c = np.meshgrid(np.arange(num_rows), np.arange(num_rows), indexing="ij")
    mask = (c <= r) & (r < ends[c])
    blocks = int(rng.integers(1, 40)), int(rng.integers(1, 40))
    lists = tile_lists(ends, *blocks)
    any_, all_ = _tiles(mask, *blocks)
    by_q = _pairs(lists.q_ptr, lists.q_num_full, lists.q_tiles, True)
    assert by_q == _pairs(lists.k_ptr, lists.k_num_full, lists.k_tiles, False)
    assert by_q == {pair: bool(all_[pair]) for pair in zip(*np.nonzero(any_))}


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_layouts_groups_are_the_tree_mask(name):
    assert tree_mask_mismatch(named_layout(name).groups) is None


def _replaced(groups: AttentionGroups, **fields) -> AttentionGroups:
    names = ("q_index", "q_ptr", "kv_index", "kv_ptr", "row_subtree_end", "max_q", "max_k")
    return AttentionGroups(**{name: fields.get(name, getattr(groups, name)) for name in names})


def _shuffled_rows(groups):
    position = torch.randperm(len(groups.q_index), generator=torch.Generator().manual_seed(1))
    return _replaced(groups, q_index=position[groups.q_index], kv_index=position[groups.kv_index])


def _dropped_ancestor(groups):
    """The first group with ancestors loses its first ancestor (its keys one fewer)."""
    own, keys = torch.diff(groups.q_ptr), torch.diff(groups.kv_ptr)
    g = int(torch.nonzero(keys > own)[0])
    start = int(groups.kv_ptr[g])
    kv_index = torch.cat([groups.kv_index[:start], groups.kv_index[start + 1 :]])
    kv_ptr = groups.kv_ptr - (torch.arange(len(groups.kv_ptr)) > g).long()
    return _replaced(groups, kv_index=kv_index, kv_ptr=kv_ptr)


def _repeated_query(groups):
    q_index = groups.q_index.clone()
    q_index[1] = q_index[0]
    return _replaced(groups, q_index=q_index)


def _wide_subtree(groups):
    ends = groups.row_subtree_end.clone()
    ends[0] = len(ends) if ends[0] < len(ends) else ends[0]
    ends[1] = len(ends)
    return _replaced(groups, row_subtree_end=ends)


@pytest.mark.parametrize("corrupt, message", [
    (_shuffled_rows, "outside the tree mask|not in ascending rows"),
    (_dropped_ancestor, "pairs that no group sees"),
    (_repeated_query, "queries are not each of the"),
    (_wide_subtree, "pairs that no group sees"),
], ids=["rows-shuffled", "ancestor-dropped", "query-repeated", "subtree-end-too-far"])
def test_groups_that_are_not_the_tree_mask_are_refused(corrupt, message):
    """Groups whose rows are not in preorder, or whose lists disagree with the subtree ends, are named, and the
    backend's plan refuses them with a ValueError instead of computing another attention."""
    groups = corrupt(named_layout("fork-inside").groups)
    assert tree_mask_mismatch(groups) is not None
    with pytest.raises(ValueError, match=f"attention backends .*'triton_tree'.* read the tree mask .*({message})"):
        tree_plan(groups, 16, 16, "cpu")


def test_plans_are_built_once_per_groups_and_tile_shape():
    groups = named_layout("forest").groups
    plan = tree_plan(groups, 16, 16, "cpu")
    assert tree_plan(groups, 16, 16, "cpu") is plan
    other = tree_plan(groups, 32, 16, "cpu")
    assert other is not plan and other.lists.block_q == 32
    assert plan.q_tiles.dtype == torch.int32 and torch.equal(plan.q_tiles.long(), torch.from_numpy(plan.lists.q_tiles))
    assert torch.equal(plan.subtree_end.long(), groups.row_subtree_end)


def test_moved_groups_build_their_plan_from_the_host_copy():
    """Groups moved off the host (here to the meta device, whose tensors hold no data: any read back fails) build
    their plan from the host groups they were moved from, checked and listed once however often they are moved;
    the plan is the host groups' own."""
    groups = named_layout("forest").groups
    moved = [groups.to("meta") for _ in range(2)]
    assert all(m.row_subtree_end.is_meta and m.on_host() is groups for m in moved)
    with counting_calls(tree_blocks, "tile_lists", "tree_mask_mismatch") as counts:
        plans = [tree_plan(m, 16, 16, "cpu") for m in moved]
        assert plans[0] is not plans[1] and plans[0].lists is plans[1].lists
        own = tree_plan(groups, 16, 16, "cpu")
    assert counts == {"tile_lists": 1, "tree_mask_mismatch": 1}
    for name in ("subtree_end", "q_ptr", "q_num_full", "q_tiles", "q_order", "k_ptr", "k_num_full", "k_tiles",
                 "k_order"):
        assert torch.equal(getattr(plans[1], name), getattr(own, name)), name
    assert groups.to("cpu").host is None and moved[0].to("meta").on_host() is groups
    assert tree_mask_mismatch(moved[0]) is None


def test_plan_arrays_start_16_byte_aligned():
    """The plan's arrays share one buffer, each starting at a multiple of 16 bytes (Triton specialises kernels on
    pointer alignment); rows and tiles here are not multiples of 4."""
    plan = tree_plan(named_layout("fork-inside").groups, 16, 16, "cpu")
    tensors = [plan.subtree_end, *plan.by_query, *plan.by_key]
    assert len(plan.subtree_end) % 4 and len(plan.q_ptr) % 4
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    assert all(t.data_ptr() % 16 == 0 and t.is_contiguous() and t.dtype == torch.int32 for t in tensors)


@pytest.mark.parametrize("blocks", [(16, 16), (32, 16), (16, 48), (128, 96)], ids=lambda b: f"{b[0]}x{b[1]}")
@pytest.mark.parametrize("name", LAYOUTS)
def test_block_masks_are_flex_attentions_own(name, blocks):
    """`tree_block_mask` (from the tile lists) holds the partial and the full tiles of each query tile that
    FlexAttention's `create_block_mask` finds by evaluating the tree mask over every pair, in both directions; its
    mask_mod is the tree mask (eager FlexAttention on the CPU applies it to every pair: the naive attention's
    values)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from harts.ops.attention.groups import naive_group_attention

    groups = named_layout(name).groups
    ends, num_rows = groups.row_subtree_end, len(groups.row_subtree_end)
    ours = tree_blocks.tree_block_mask(groups, *blocks, "cpu")
    assert tree_blocks.tree_block_mask(groups, *blocks, "cpu") is ours
    expected = create_block_mask(lambda b, h, q, k: (k <= q) & (q < ends[k]), None, None, num_rows, num_rows,
                                 device="cpu", BLOCK_SIZE=blocks)

    def listed(counts, indices):
        return [sorted(row[:count].tolist()) for count, row in zip(counts[0, 0], indices[0, 0])]

    for counts, indices in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
                            ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")):
        assert listed(getattr(ours, counts), getattr(ours, indices)) == \
            listed(getattr(expected, counts), getattr(expected, indices)), counts
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, num_rows, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 2, num_rows, 4, generator=generator, dtype=torch.float64)
    with warnings.catch_warnings():  # eager FlexAttention's advice to compile it
        warnings.simplefilter("ignore", UserWarning)
        out = flex_attention(q, k, v, block_mask=ours, scale=0.5)
    expected_out = naive_group_attention(*(t[0].transpose(0, 1) for t in (q, k, v)), groups, 0.5)
    torch.testing.assert_close(out[0].transpose(0, 1), expected_out, rtol=1e-12, atol=1e-12)
