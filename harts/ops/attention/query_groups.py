"""Query groups with ancestor KV views: how both executions describe causal attention over rows of a tree.

The R rows (packed trajectories, or the compact rows of a microbatch) are split into G query groups;
group g's queries are rows `q_index[q_ptr[g]:q_ptr[g+1]]` (l_g rows, consecutive positions of one path)
and its keys are rows `kv_index[kv_ptr[g]:kv_ptr[g+1]]`: the h_g ancestor rows of the path, then the
group's own l_g rows. Query i of the group sees keys j <= h_g + i (causal, aligned bottom-right). A
trajectory of the baseline is one group with h = 0. For the DFS tree-mask backend, rows must be in DFS
preorder and `row_subtree_end[r]` is one past the last descendant row of r: key c is visible to query r
iff c <= r < row_subtree_end[c].

Also the row permutations the backends share (`permute_rows`, whose backward gathers by the inverse
permutation). Every attention backend (harts.ops.attention.groups, .split) imports this module and no
other of them. Tested in tests/ops/attention/test_groups.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, eq=False)
class AttentionGroups:
    q_index: torch.Tensor
    """int64 [R] query rows, grouped (every row exactly once)."""
    q_ptr: torch.Tensor
    """int64 [G + 1]."""
    kv_index: torch.Tensor
    """int64 [Σ (h + l)] key rows per group: ancestors, then the group's own rows."""
    kv_ptr: torch.Tensor
    """int64 [G + 1]."""
    row_subtree_end: torch.Tensor
    """int64 [R] one past the last DFS-descendant row of each row."""
    max_q: int
    max_k: int
    q_inverse: torch.Tensor | None = None
    """int64 [R]: each row's position in q_index (its inverse permutation); None: compute it."""
    q_in_order: bool = False
    """q_index is 0..R−1 (the varlen backend then skips both query and output permutations)."""
    kv_in_order: bool = False
    """kv_index is 0..R−1 (no ancestors: the baseline's packed trajectories; no KV gather)."""
    host: AttentionGroups | None = field(default=None, repr=False)
    """These groups on the host, when `to` moved them from there: what host-side work reads (`on_host`)."""

    @property
    def num_groups(self) -> int:
        return len(self.q_ptr) - 1

    @property
    def num_kv_rows(self) -> int:
        return int(self.kv_ptr[-1])

    @property
    def num_pairs(self) -> int:
        """(query, key) pairs attended: Σ_g l_g·h_g + l_g·(l_g + 1)/2 (every ancestor, causal within the
        group), the attention's work; a trajectory of L rows has L·(L + 1)/2."""
        own = self.q_ptr[1:] - self.q_ptr[:-1]
        ancestors = self.kv_ptr[1:] - self.kv_ptr[:-1] - own
        return int((own * ancestors + own * (own + 1) // 2).sum())

    def to(self, device: torch.device | str) -> AttentionGroups:
        on_host = self.q_index.device.type == "cpu"
        return AttentionGroups(
            q_index=self.q_index.to(device), q_ptr=self.q_ptr.to(device),
            kv_index=self.kv_index.to(device), kv_ptr=self.kv_ptr.to(device),
            row_subtree_end=self.row_subtree_end.to(device), max_q=self.max_q, max_k=self.max_k,
            q_inverse=None if self.q_in_order else self.query_inverse().to(device),
            q_in_order=self.q_in_order, kv_in_order=self.kv_in_order,
            host=None if torch.device(device).type == "cpu" else self if on_host else self.host,
        )

    def on_host(self) -> AttentionGroups:
        """These groups on the host: themselves, the host groups `to` moved them from, or else a copy (which waits
        for the device). Host-side work per layout (the `triton_tree` backend's tile lists) reads these, so that it
        neither waits for the device nor copies its arrays back."""
        if self.q_index.device.type == "cpu":
            return self
        return self.host if self.host is not None else self.to("cpu")

    def query_inverse(self) -> torch.Tensor:
        if self.q_inverse is not None:
            return self.q_inverse
        return inverse_permutation(self.q_index)


class _PermuteRows(torch.autograd.Function):
    """x[index] for a permutation `index` of the rows; the backward gathers by the inverse
    permutation instead of accumulating (advanced indexing's backward sorts the indices first)."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.inverse = inverse
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(0, ctx.inverse), None, None


def inverse_permutation(index: torch.Tensor) -> torch.Tensor:
    """int64 inverse of a permutation `index` of 0..n−1: inverse[index[i]] = i."""
    return torch.empty_like(index).scatter_(0, index, torch.arange(len(index), device=index.device))


def permute_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Rows `x[index]` where `index` is a permutation with inverse permutation `inverse`."""
    return _PermuteRows.apply(x, index, inverse)
