"""Run `fused_norm_gate` on CPU under the Triton interpreter (fp32) against `naive_norm_gate` in fp64. Run as
`TRITON_INTERPRET=1 python -m tests.ops.norm_gate.interpreter kernel|rows|saved` (test_norm_gate.py does, in
a subprocess); prints one JSON object: the relative error of every compared tensor (`kernel`), whether each
row's output and gradients are the same bits when more rows follow it (`rows`: 1.0 or 0.0), or the shapes of
the tensors the autograd node keeps for the backward (`saved`)."""

from __future__ import annotations

import json
import sys

from tests.ops.kda.interpreter import patch_interpreter

# (rows, heads, head dim): one row; rows not a multiple of the tile and a head dim not a power of two; KDA's 128.
SHAPES = [(1, 1, 8), (37, 3, 24), (16, 2, 128)]


def _inputs(rows, heads, dim, seed=42):
    import torch

    gen = torch.Generator().manual_seed(seed)
    o = torch.randn(rows, heads, dim, generator=gen) * 2
    gate = torch.randn(rows, heads, dim, generator=gen) * 3
    weight = 1 + torch.randn(dim, generator=gen) / 4
    upstream = torch.randn(rows, heads, dim, generator=gen)
    return o, gate, weight, upstream


def _value_and_grads(run, o, gate, weight, upstream):
    from tests.ops.kda.helpers import value_and_grads

    return value_and_grads(lambda *leaves: run(*leaves, 1e-6), [t.detach().requires_grad_() for t in (o, gate, weight)],
                           upstream)


def case_kernel() -> dict[str, float]:
    import torch

    from harts.ops.norm_gate import fused_norm_gate, naive_norm_gate
    from tests.ops.kda.helpers import relative_error

    errors = {}
    for shape in SHAPES:
        o, gate, weight, upstream = _inputs(*shape)
        expected = _value_and_grads(naive_norm_gate, *(t.double() for t in (o, gate, weight, upstream)))
        actual = _value_and_grads(fused_norm_gate, o, gate, weight, upstream)
        for name, got, want in zip(("y", "d_o", "d_gate", "d_weight"), actual, expected):
            errors["x".join(map(str, shape)) + f".{name}"] = relative_error(got, want)
    return errors


def case_rows() -> dict[str, float]:
    import torch

    from harts.ops.norm_gate import fused_norm_gate

    same = {}
    o, gate, weight, upstream = _inputs(37, 2, 24)
    alone = _value_and_grads(fused_norm_gate, o[:5], gate[:5], weight, upstream[:5])
    among = _value_and_grads(fused_norm_gate, o, gate, weight, upstream)
    for name, a, b in zip(("y", "d_o", "d_gate"), alone, among):
        same[name] = float(torch.equal(a, b[:5]))
    return same


def case_saved() -> dict[str, list[str]]:
    import torch

    from harts.ops.norm_gate import fused_norm_gate

    o, gate, weight, _ = _inputs(37, 2, 24)
    kept = []

    def pack(t):
        kept.append("x".join(map(str, t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fused_norm_gate(*(t.requires_grad_() for t in (o, gate, weight)), 1e-6)
    return {"kept": kept}


if __name__ == "__main__":
    patch_interpreter()
    print(json.dumps({"kernel": case_kernel, "rows": case_rows, "saved": case_saved}[sys.argv[1]]()))
