"""Run `fused_swiglu` and `fused_weighted_swiglu_backward` on CPU under the Triton interpreter (fp32)
against the fp64 references, without and with a clipping limit (LIMIT clips about a fifth of the SiLU values and
half of the up values). Run as `TRITON_INTERPRET=1 python -m tests.ops.swiglu.interpreter
kernel|weighted|kernel-limit|weighted-limit` (test_swiglu.py does, in a subprocess); prints one JSON object: the
relative error of every compared tensor."""

from __future__ import annotations

import json
import sys

from tests.ops.kda.interpreter import patch_interpreter

# (rows, F): one row, rows and columns not multiples of the tile.
SHAPES = [(1, 8), (37, 300), (16, 256)]
LIMIT = 2.0


def case_kernel(limit: float | None = None) -> dict[str, float]:
    from functools import partial

    import torch

    from harts.ops.swiglu import fused_swiglu, naive_swiglu
    from tests.ops.kda.helpers import relative_error, value_and_grads

    errors = {}
    for rows, columns in SHAPES:
        gen = torch.Generator().manual_seed(42)
        gate_up = torch.randn(rows, 2 * columns, generator=gen) * 3
        upstream = torch.randn(rows, columns, generator=gen)
        results = []
        for run, dtype in ((partial(naive_swiglu, limit=limit), torch.float64),
                           (partial(fused_swiglu, limit=limit), torch.float32)):
            results.append(value_and_grads(run, [gate_up.to(dtype).requires_grad_()], upstream))
        for name, actual, expected in zip(("y", "d_gate_up"), results[1], results[0]):
            errors[f"{rows}x{columns}.{name}"] = relative_error(actual, expected)
    return errors


def case_weighted(limit: float | None = None) -> dict[str, float]:
    import torch

    from harts.ops.swiglu import fused_weighted_swiglu_backward, naive_weighted_swiglu_backward
    from tests.ops.kda.helpers import relative_error

    errors = {}
    for rows, columns in SHAPES:
        gen = torch.Generator().manual_seed(42)
        gate_up = torch.randn(rows, 2 * columns, generator=gen) * 3
        weight = torch.rand(rows, generator=gen) * 2
        grad = torch.randn(rows, columns, generator=gen)
        expected = naive_weighted_swiglu_backward(gate_up.double(), weight.double(), grad.double(), limit)
        actual = fused_weighted_swiglu_backward(gate_up, weight, grad, limit)
        for name, got, want in zip(("d_gate_up", "d_weight", "weighted"), actual, expected):
            errors[f"{rows}x{columns}.{name}"] = relative_error(got, want)
    return errors


if __name__ == "__main__":
    patch_interpreter()
    cases = {"kernel": case_kernel, "weighted": case_weighted,
             "kernel-limit": lambda: case_kernel(LIMIT), "weighted-limit": lambda: case_weighted(LIMIT)}
    print(json.dumps(cases[sys.argv[1]]()))
