"""Collectives with autograd on 3 gloo ranks against the same function computed in one process.

Every rank can regenerate every rank's inputs (seeded by rank), so each rank checks its own
forward output and input gradient against the single-process formula; the largest relative
error per op over the ranks comes back. Three ranks make shards, splits and padding uneven.
"""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from harts.parallel.comm import (
    all_reduce_,
    all_to_all_counts,
    all_to_all_rows,
    copy_to_group,
    gather_rows,
    gather_rows_no_grad,
    pad_rows,
    padded_rows,
    reduce_from_group,
    reduce_scatter_rows,
    scatter_rows,
)
from harts.parallel.config import ParallelConfig
from harts.parallel.launch import launch

WIDTH, SHARD = 5, 4
OPS = ("copy_to_group", "reduce_from_group", "scatter_rows", "gather_rows/reduce_scatter", "gather_rows/split",
       "gather_rows_no_grad", "reduce_scatter_rows", "all_to_all_rows", "all_to_all_counts")


def _tensor(seed: int, rank: int, rows: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(rows, WIDTH, generator=generator, dtype=torch.float64)


def _splits(n: int) -> np.ndarray:
    """splits[s, d]: rows rank s sends to rank d (some zero)."""
    return np.random.default_rng(42).integers(0, 4, size=(n, n))


def _error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm().clamp(min=1e-30))


def _check_ops(groups) -> dict[str, float]:
    group = dist.group.WORLD
    n, me = dist.get_world_size(), dist.get_rank()
    errors = {}

    x = _tensor(1, 0, SHARD).requires_grad_()
    y = copy_to_group(x, group)
    (y * _tensor(2, me, SHARD)).sum().backward()
    errors["copy_to_group"] = max(_error(y, x), _error(x.grad, sum(_tensor(2, r, SHARD) for r in range(n))))

    x = _tensor(3, me, SHARD).requires_grad_()
    y = reduce_from_group(x, group)
    (y * _tensor(4, me, SHARD)).sum().backward()
    errors["reduce_from_group"] = max(_error(y, sum(_tensor(3, r, SHARD) for r in range(n))),
                                      _error(x.grad, _tensor(4, me, SHARD)))

    x = _tensor(5, 0, n * SHARD).requires_grad_()
    y = scatter_rows(x, group)
    (y * _tensor(6, me, SHARD)).sum().backward()
    errors["scatter_rows"] = max(_error(y, x[me * SHARD : (me + 1) * SHARD]),
                                 _error(x.grad, torch.cat([_tensor(6, r, SHARD) for r in range(n)])))

    for grad in ("reduce_scatter", "split"):
        x = _tensor(7, me, SHARD).requires_grad_()
        y = gather_rows(x, group, grad=grad)
        (y * _tensor(8, me, n * SHARD)).sum().backward()
        mine = slice(me * SHARD, (me + 1) * SHARD)
        upstream = _tensor(8, me, n * SHARD)
        if grad == "reduce_scatter":
            upstream = sum(_tensor(8, r, n * SHARD) for r in range(n))
        errors[f"gather_rows/{grad}"] = max(_error(y, torch.cat([_tensor(7, r, SHARD) for r in range(n)])),
                                            _error(x.grad, upstream[mine]))
    errors["gather_rows_no_grad"] = _error(gather_rows_no_grad(_tensor(7, me, SHARD), group),
                                           torch.cat([_tensor(7, r, SHARD) for r in range(n)]))

    x = _tensor(9, me, n * SHARD).requires_grad_()
    y = reduce_scatter_rows(x, group)
    (y * _tensor(10, me, SHARD)).sum().backward()
    errors["reduce_scatter_rows"] = max(
        _error(y, sum(_tensor(9, r, n * SHARD) for r in range(n))[me * SHARD : (me + 1) * SHARD]),
        _error(x.grad, torch.cat([_tensor(10, r, SHARD) for r in range(n)])),
    )

    splits = _splits(n)
    sent = {s: _tensor(11, s, int(splits[s].sum())) for s in range(n)}
    upstream = {d: _tensor(12, d, int(splits[:, d].sum())) for d in range(n)}

    def block(tensor, sizes, index):
        start = int(sizes[:index].sum())
        return tensor[start : start + int(sizes[index])]

    x = sent[me].clone().requires_grad_()
    y = all_to_all_rows(x, splits[:, me].tolist(), splits[me].tolist(), group)
    (y * upstream[me]).sum().backward()
    errors["all_to_all_rows"] = max(
        _error(y, torch.cat([block(sent[s], splits[s], me) for s in range(n)])),
        _error(x.grad, torch.cat([block(upstream[d], splits[:, d], me) for d in range(n)])),
    )
    counts = torch.from_numpy(splits[me]).view(n, 1) * 10 + me
    received = all_to_all_counts(counts, group)
    expected = torch.tensor([[int(splits[s, me]) * 10 + s] for s in range(n)])
    errors["all_to_all_counts"] = float((received - expected).abs().max())

    worst = torch.tensor([errors[op] for op in OPS], dtype=torch.float64)
    all_reduce_(worst, group, op=dist.ReduceOp.MAX)
    return dict(zip(OPS, worst.tolist()))


@pytest.fixture(scope="module")
def errors():
    return launch(_check_ops, ParallelConfig(name="three-ranks", dp=3))


@pytest.mark.parametrize("op", OPS)
def test_collective_equals_single_process(errors, op):
    assert errors[op] <= 1e-12, errors


def test_padding():
    assert [padded_rows(r, 3) for r in (0, 1, 3, 4, 7)] == [0, 1, 1, 2, 3]
    x = torch.ones(2, 3, requires_grad=True)
    padded = pad_rows(x, 5)
    assert padded.shape == (5, 3) and padded[2:].abs().sum() == 0
    padded.sum().backward()
    assert torch.equal(x.grad, torch.ones(2, 3))
    assert pad_rows(x, 2) is x
