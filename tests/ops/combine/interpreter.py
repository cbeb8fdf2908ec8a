"""Run `fused_combine` and `fused_gather_combine` on CPU under the Triton interpreter against the fp64
reference. Run as `TRITON_INTERPRET=1 python -m tests.ops.combine.interpreter kernel|gather`
(test_combine.py does, in a subprocess); prints one JSON object: the relative error of every compared
tensor."""

from __future__ import annotations

import json
import sys

from tests.ops.kda.interpreter import patch_interpreter

# (rows, top_k, D, dtype): k = 1 and a k that is not a power of two, D not a multiple of the tile
# and larger than one tile (the backward's loop over D).
SHAPES = [(1, 1, 8, "bfloat16"), (13, 3, 600, "float16"), (9, 8, 1100, "bfloat16")]


def case_kernel() -> dict[str, float]:
    import torch

    from harts.ops.combine import fused_combine, naive_combine
    from tests.ops.kda.helpers import relative_error, value_and_grads

    errors = {}
    for rows, top_k, hidden, dtype in SHAPES:
        gen = torch.Generator().manual_seed(42)
        probs = torch.rand(rows, top_k, generator=gen)
        y = (torch.randn(rows, top_k, hidden, generator=gen) * 3).to(getattr(torch, dtype))
        upstream = torch.randn(rows, hidden, generator=gen)
        results = []
        for run, cast in ((naive_combine, torch.float64), (fused_combine, None)):
            leaves = [probs.to(cast or probs.dtype).requires_grad_(), y.to(cast or y.dtype).requires_grad_()]
            results.append(value_and_grads(run, leaves, upstream))
        assert results[1][0].dtype == torch.float32 and results[1][2].dtype == y.dtype
        for name, actual, expected in zip(("out", "dprobs", "dy"), results[1], results[0]):
            errors[f"{rows}x{top_k}x{hidden}.{name}"] = relative_error(actual, expected)
    return errors


def case_gather() -> dict[str, float]:
    """fused_gather_combine, weighted and plain, against the fp64 reference over shuffled rows; the weighted
    sum must equal fused_combine on the gathered rows bit for bit (reported as an error too)."""
    import torch

    from harts.ops.combine import fused_combine, fused_gather_combine, naive_gather_combine
    from tests.ops.kda.helpers import relative_error

    errors = {}
    for rows, top_k, hidden, dtype in SHAPES:
        gen = torch.Generator().manual_seed(42)
        probs = torch.rand(rows, top_k, generator=gen)
        y = (torch.randn(rows * top_k, hidden, generator=gen) * 3).to(getattr(torch, dtype))
        index = torch.randperm(rows * top_k, generator=gen).view(rows, top_k)
        name = f"{rows}x{top_k}x{hidden}"
        weighted = fused_gather_combine(probs, y, index)
        errors[f"{name}.weighted"] = relative_error(weighted, naive_gather_combine(probs.double(), y.double(), index))
        gathered = fused_combine(probs, y[index.reshape(-1)].view(rows, top_k, hidden))
        errors[f"{name}.weighted_vs_combine"] = float((weighted != gathered).any())
        plain = fused_gather_combine(None, y, index)
        assert plain.dtype == y.dtype
        errors[f"{name}.plain"] = relative_error(plain, naive_gather_combine(None, y.double(), index))
        # an addend in y's dtype: in the fp32 sum (bit for bit the sum, then the addend), and rounded once
        add = (torch.randn(rows, hidden, generator=gen) * 3).to(y.dtype)
        summed = fused_gather_combine(probs, y, index, add, torch.float32)
        errors[f"{name}.added_vs_sum_then_add"] = float((summed != weighted + add.float()).any())
        rounded = fused_gather_combine(probs, y, index, add, y.dtype)
        assert rounded.dtype == y.dtype
        errors[f"{name}.added"] = relative_error(
            rounded, naive_gather_combine(probs.double(), y.double(), index, add.double()))
    return errors


if __name__ == "__main__":
    patch_interpreter()
    print(json.dumps({"kernel": case_kernel, "gather": case_gather}[sys.argv[1]]()))
