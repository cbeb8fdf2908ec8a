"""The rows of a microbatch's multi-token-prediction (MTP) depths, in either execution (harts.model.mtp).

Depth k has one row per semantic position (x, i) with i >= k: trajectory x's row at position t = i - k, which reads
the previous depth's row of (x, i - 1) (the main layout's for k = 1) and the embedding of x_i = x_{t+k}, and whose
output predicts x_{i+1}, the target of (x, i) (harts.objective.targets): megatron-core's labels rolled k times.
- Per trajectory ("baseline"): a trajectory of length L > k is one packed sequence of its tokens x_k .. x_{L-1} at
  positions 0 .. L - k - 1: megatron-core's rolled sequence without the k trailing rows its roll fills with token 0
  (causal, so they change no other row, and their loss mask is 0).
- Under a tree ("compact"): the row of (x, i) is identified by the prefix x_0 .. x_i, i.e. by a trie node of depth i,
  so depth k's rows are the trie's compact rows of depth >= k with the trie's ancestor structure (`trimmed_tree`:
  the members' original lexicographic order with adjacent LCPs l reduced to max(l - k, 0) and lengths L - k, so
  trajectories that differ in a token before position k never share a row, as re-tokenising shifted sequences would
  make them). Positions are path positions minus k, so RoPE, the short conv and the KDA chunks see what the
  per-trajectory sequence sees. A row with several children carries one label per child, like the main LM head's
  rows at forks, and its multiplicity is the trie row's.
Invariant (tests/runtime/test_mtp.py, against a dict trie of prefixes): two positions of depth k share a row iff their
trajectories agree on tokens 0 .. i; depth k has Σ_x max(L_x - k, 0) rows per trajectory and the trie's nodes of
depth >= k under the tree; every row reads the previous depth's row of its parent node.
Legend: R_k rows of depth k, S_k its semantic positions, S_mb the microbatch's semantic positions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from harts.runtime.layout import Layout, packed_layout, tree_layout
from harts.trees.step import Step
from harts.trees.trie import PrefixIndex, SegmentTree


@dataclass(eq=False)
class MTPLayout:
    """Depth k's rows of a microbatch."""

    depth: int
    layout: Layout
    """The rows: `input_ids` the tokens x_{t+k}, `positions` t, `semantic_rows` the row of each of the depth's
    semantic positions, `multiplicity` q (compact: the trie row's; None per trajectory)."""
    hidden_rows: torch.Tensor
    """int64 [R_k] the row of depth k - 1 (the main layout's for k = 1) whose hidden state each row reads."""
    semantic_positions: np.ndarray
    """int64 [S_k] the microbatch's semantic positions (its members' concatenated, the main `Layout.semantic_rows`
    order) of the depth's semantic positions (x, i >= k), in `layout.semantic_rows` order."""

    @property
    def num_rows(self) -> int:
        return self.layout.num_rows

    def to(self, device: torch.device | str) -> MTPLayout:
        return replace(self, layout=self.layout.to(device), hidden_rows=self.hidden_rows.to(device))


def trimmed_tree(members: np.ndarray, lengths: np.ndarray, sorted_position: np.ndarray, lcp: np.ndarray,
                 depth: int) -> SegmentTree:
    """The segment tree of the trie nodes of depth >= `depth` of `members` (their `lengths`, lexicographic order
    `sorted_position` and its adjacent LCPs `lcp`, as `PrefixIndex.sort_members` gives them), path positions
    shifted down by `depth`; members of length <= `depth` have no node there and are left out. The LCP of two
    members kept on either side of left-out ones is at most the left-out lengths, so at most `depth`: reducing each
    adjacent LCP by `depth` (at least 0) is exact."""
    kept = np.flatnonzero(lengths > depth)
    new_index = np.full(len(members), -1, dtype=np.int64)
    new_index[kept] = np.arange(len(kept))
    sorted_kept = lengths[sorted_position] > depth
    trimmed_lcp = np.maximum(lcp[sorted_kept] - depth, 0)
    return SegmentTree.build(members[kept], lengths[kept] - depth, new_index[sorted_position[sorted_kept]],
                             trimmed_lcp)


def mtp_layouts(
    step: Step, members: np.ndarray, num_depths: int, *, execution: str, index: PrefixIndex | None = None,
    conv_size: int, chunk_size: int, replay: bool = True, attention_backend: str = "sdpa", kda_backend: str = "torch",
    gdn_kernel: str = "gdn",
) -> list[MTPLayout]:
    """The layouts of depths 1 .. `num_depths` of the microbatch `members` in `execution` ("baseline" or "compact",
    which needs the step's prefix `index`), stopping at the first depth with no row (every member of length <= k)."""
    members = np.asarray(members, dtype=np.int64)
    lengths = step.lengths[members]
    offsets = np.zeros(len(members) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.concatenate([step.trajectory_tokens(m) for m in members]).astype(np.int64)
    knobs = dict(conv_size=conv_size, chunk_size=chunk_size, attention_backend=attention_backend,
                 kda_backend=kda_backend, gdn_kernel=gdn_kernel)
    if execution == "compact":
        assert index is not None, "the compact MTP rows come from the step's prefix index"
        sorted_position, lcp = index.sort_members(members)
        previous_rows = SegmentTree.build(members, lengths, sorted_position, lcp).compact_map()
    else:
        previous_rows = np.arange(int(offsets[-1]), dtype=np.int64)
    layouts = []
    for depth in range(1, num_depths + 1):
        kept = np.flatnonzero(lengths > depth)
        if not len(kept):
            break
        semantic = np.concatenate([np.arange(offsets[j] + depth, offsets[j + 1]) for j in kept])
        if execution == "compact":
            tree = trimmed_tree(members, lengths, sorted_position, lcp, depth)
            rows = tree.compact_map()
            input_ids = np.empty(tree.num_compact_tokens, dtype=np.int64)
            input_ids[rows] = tokens[semantic]
            layout = tree_layout(tree, input_ids, replay=replay, compact_map=rows, **knobs)
        else:
            rows = np.arange(len(semantic), dtype=np.int64)
            layout = packed_layout(tokens[semantic], lengths[kept] - depth, members[kept], **knobs)
        hidden_rows = np.empty(layout.num_rows, dtype=np.int64)
        hidden_rows[rows] = previous_rows[semantic - 1]
        layouts.append(MTPLayout(depth=depth, layout=layout, hidden_rows=torch.from_numpy(hidden_rows),
                                 semantic_positions=semantic))
        previous_rows = np.full(len(tokens), -1, dtype=np.int64)
        previous_rows[semantic] = rows
    return layouts
