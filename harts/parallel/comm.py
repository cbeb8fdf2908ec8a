"""Collectives with autograd, for regions of a model split across a process group.

The forward/backward pairs are megatron-core's tensor-parallel mappings (own implementation):
- `copy_to_group`: identity forward, all-reduce backward (entering a region whose ranks each
  compute a part of the downstream gradient);
- `reduce_from_group`: all-reduce forward, identity backward (leaving such a region; also a
  sum over ranks of a value that every rank then uses identically, e.g. an MoE loss numerator);
- `scatter_rows` / `gather_rows` / `reduce_scatter_rows`: row sharding for sequence
  parallelism. Rows are split in equal shards of P rows: the caller pads R rows to n·P first
  (`padded_rows`, `pad_rows`). `gather_rows(..., grad="reduce_scatter")` is for consumers that
  each compute a partial gradient (a tensor-parallel region), `grad="split"` for consumers that
  compute the same full gradient on every rank (the replicated LM head and loss);
- `all_to_all_rows`: uneven all-to-all of rows (expert dispatch), backward the reverse exchange.
Every op is the identity when the group has one rank. Collectives run on contiguous tensors of
the caller's dtype (gloo on CPU, NCCL on CUDA: the same code).

Reference (tests/parallel/test_comm.py): on 2 and 3 gloo ranks, each op's forward and the
gradients it returns equal the single-process computation of the same function.
Legend: R rows, P rows of a shard, n ranks of the group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd import Function

# torch 2.13 renamed the single-tensor collectives (the old names warn); 2.11 has only the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: dist.ProcessGroup) -> int:
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup) -> int:
    return dist.get_rank(group)


def padded_rows(num_rows: int, size: int) -> int:
    """P: rows per shard when R rows are split in `size` equal shards (the last ones padded)."""
    return -(-num_rows // size)


def pad_rows(x: torch.Tensor, num_rows: int) -> torch.Tensor:
    """x with zero rows appended up to `num_rows` rows (differentiable)."""
    missing = num_rows - x.shape[0]
    assert missing >= 0, "cannot pad to fewer rows"
    return x if not missing else torch.cat([x, x.new_zeros(missing, *x.shape[1:])])


def all_reduce_(tensor: torch.Tensor, group: dist.ProcessGroup, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce without autograd (counts, gradients, reported sums)."""
    if group_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _all_gather_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty(group_size(group) * x.shape[0], *x.shape[1:])
    _all_gather_single(out, x, group=group)
    return out


def _reduce_scatter_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = group_size(group)
    assert x.shape[0] % size == 0, "reduce-scatter needs rows divisible by the group size"
    out = x.new_empty(x.shape[0] // size, *x.shape[1:])
    _reduce_scatter_single(out, x.contiguous(), group=group)
    return out


def _own_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size, rank = group_size(group), group_rank(group)
    assert x.shape[0] % size == 0, "row shards need rows divisible by the group size"
    shard = x.shape[0] // size
    return x[rank * shard : (rank + 1) * shard].contiguous()


class _CopyToGroup(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_(grad.contiguous().clone(), ctx.group), None


class _ReduceFromGroup(Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterRows(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _own_rows(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_rows(grad, ctx.group), None


class _GatherRows(Function):
    @staticmethod
    def forward(ctx, x, group, reduce_grad):
        ctx.group, ctx.reduce_grad = group, reduce_grad
        return _all_gather_rows(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:
            return _reduce_scatter_rows(grad, ctx.group), None, None
        return _own_rows(grad, ctx.group), None, None


class _ReduceScatterRows(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_rows(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_rows(grad, ctx.group), None


class _AllToAllRows(Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        out = x.new_empty(sum(output_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(sum(ctx.input_splits), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), ctx.input_splits, ctx.output_splits, group=ctx.group)
        return out, None, None, None


def copy_to_group(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return x if group_size(group) == 1 else _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceFromGroup.apply(x, group)


def scatter_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's shard of replicated rows [n·P, ...] -> [P, ...]; backward all-gathers."""
    return x if group_size(group) == 1 else _ScatterRows.apply(x, group)


def gather_rows(x: torch.Tensor, group: dist.ProcessGroup, *, grad: str) -> torch.Tensor:
    """All shards [P, ...] -> [n·P, ...]; backward "reduce_scatter" (partial consumers) or "split"."""
    if grad not in ("reduce_scatter", "split"):
        raise ValueError(f"gather_rows: grad must be 'reduce_scatter' or 'split', got {grad!r}")
    return x if group_size(group) == 1 else _GatherRows.apply(x, group, grad == "reduce_scatter")


@torch.no_grad()
def gather_rows_no_grad(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return x if group_size(group) == 1 else _all_gather_rows(x, group)


def reduce_scatter_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum of every rank's [n·P, ...], this rank's [P, ...] shard of it; backward all-gathers."""
    return x if group_size(group) == 1 else _ReduceScatterRows.apply(x, group)


def all_to_all_rows(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Rows input_splits[j] of x go to rank j; output_splits[j] rows come from rank j, in rank order."""
    return x if group_size(group) == 1 else _AllToAllRows.apply(x, output_splits, input_splits, group)


@torch.no_grad()
def all_to_all_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """counts [n, m] (row j for rank j) -> [n, m] (row j from rank j)."""
    if group_size(group) == 1:
        return counts
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out
