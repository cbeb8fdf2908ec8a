"""Run the fused conv + SiLU kernels on CPU under the Triton interpreter (fp32) against the fp64
reference. Run as `TRITON_INTERPRET=1 python -m tests.ops.conv.interpreter CASE` (test_conv.py does,
in a subprocess); prints one JSON object: the relative error of every compared tensor."""

from __future__ import annotations

import json
import sys
from functools import partial

from tests.ops.kda.interpreter import patch_interpreter

# (rows, parts, channels per part, width): one row, odd rows, channels not a multiple of the tile,
# rows not a multiple of the tile, widths 1, 2 and 4.
SHAPES = [(1, 3, 40, 4), (63, 1, 128, 4), (70, 3, 136, 4), (33, 2, 64, 2), (5, 1, 8, 1)]


def _errors(actual, expected) -> list[float]:
    from tests.ops.kda.helpers import relative_error

    return [relative_error(a, e) for a, e in zip(actual, expected)]


def case_kernel() -> dict[str, float]:
    """`fused_shifted_conv_silu` against `naive_shifted_conv_silu`: output, dx and dw."""
    import torch

    from harts.ops.conv import fused_shifted_conv_silu, naive_shifted_conv_silu
    from tests.ops.kda.helpers import value_and_grads

    errors = {}
    for rows, parts, per_part, width in SHAPES:
        gen = torch.Generator().manual_seed(42)
        x = torch.randn(rows, parts * per_part, generator=gen)
        weight = torch.randn(parts * per_part, width, generator=gen)
        upstream = torch.randn(parts, rows, per_part, generator=gen)
        results = []
        for run, dtype in ((naive_shifted_conv_silu, torch.float64), (fused_shifted_conv_silu, torch.float32)):
            leaves = [x.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_()]
            results.append(value_and_grads(partial(run, num_parts=parts), leaves, upstream))
        for name, error in zip(("y", "dx", "dw"), _errors(results[1], results[0])):
            errors[f"{rows}x{parts}x{per_part}w{width}.{name}"] = error
    return errors


def _layout_cases():
    """(name, layout, x, weight, upstream) of both executions' layouts of two random steps (exception rows: path
    starts, forks, call boundaries, replay rows) with random fp32 inputs of 3 parts of 6 channels, width 4."""
    import numpy as np
    import torch

    from harts.runtime.layout import baseline_layout, compact_layout
    from harts.trees.trie import PrefixIndex
    from tests.trees.helpers import make_step, random_sequences

    for seed in range(2):
        rng = np.random.default_rng(seed)
        step = make_step(random_sequences(rng, 10, 60, 3))
        members = rng.permutation(step.num_trajectories)[:8]
        layouts = {
            "baseline": baseline_layout(step, members, conv_size=4, chunk_size=4),
            "compact": compact_layout(step, PrefixIndex.from_step(step), members, conv_size=4, chunk_size=4,
                                      replay=True),
        }
        for execution, layout in layouts.items():
            gen = torch.Generator().manual_seed(seed)
            x = torch.randn(layout.num_kda_rows, 3 * 6, generator=gen)
            weight = torch.randn(3 * 6, 4, generator=gen)
            upstream = torch.randn(3, layout.num_kda_rows, 6, generator=gen)
            yield f"{execution}{seed}", layout, x, weight, upstream


def case_layout() -> dict[str, float]:
    """`Layout.causal_conv_silu(fused=True)` (the kernel, then the exception rows: path starts,
    forks, call boundaries and replay rows) against SiLU of the gather reference, both executions."""
    import torch.nn.functional as F

    from harts.runtime.layout import naive_causal_conv
    from tests.ops.kda.helpers import value_and_grads

    def reference(x, weight, predecessors):
        return F.silu(naive_causal_conv(x, weight, predecessors)).view(-1, 3, 6).transpose(0, 1)

    errors = {}
    for case, layout, x, weight, upstream in _layout_cases():
        expected = value_and_grads(partial(reference, predecessors=layout.predecessors),
                                   [x.double().requires_grad_(), weight.double().requires_grad_()], upstream)
        got = value_and_grads(partial(layout.causal_conv_silu, num_parts=3, fused=True),
                              [x.requires_grad_(), weight.requires_grad_()], upstream)
        for name, error in zip(("y", "dx", "dw"), _errors(got, expected)):
            errors[f"{case}.{name}"] = error
        errors[f"{case}.exception_rows"] = float(len(layout.conv_exception_rows()))
    return errors


def differing_positions(device: str = "cpu", dtype_name: str = "float32") -> dict[str, float]:
    """Both executions' fused conv over the same step, with a compact row's input at each of its
    semantic positions in the baseline: the count of semantic positions whose values differ in any
    bit (a row must not round differently for being a path start, fork or call boundary in one
    execution and a plain row in the other)."""
    import numpy as np
    import torch

    from harts.runtime.layout import baseline_layout, compact_layout
    from harts.trees.trie import PrefixIndex
    from tests.trees.helpers import make_step, random_sequences

    dtype = getattr(torch, dtype_name)
    counts = {}
    for seed in range(3):
        rng = np.random.default_rng(seed)
        step = make_step(random_sequences(rng, 10, 60, 3))
        members = np.arange(step.num_trajectories)
        baseline = baseline_layout(step, members, conv_size=4, chunk_size=4).to(device)
        compact = compact_layout(step, PrefixIndex.from_step(step), members, conv_size=4, chunk_size=4,
                                 replay=True).to(device)
        generator = torch.Generator().manual_seed(seed)
        x_compact = torch.randn(compact.num_rows, 3 * 6, generator=generator).to(device, dtype)
        x_baseline = x_compact.new_empty(baseline.num_rows, 3 * 6)
        x_baseline[baseline.semantic_rows] = x_compact[compact.semantic_rows]
        weight = torch.randn(3 * 6, 4, generator=torch.Generator().manual_seed(seed + 10)).to(device, dtype)
        y_compact = torch.stack([compact.from_kda_rows(part) for part in compact.causal_conv_silu(
            compact.kda_rows(x_compact), weight, 3, fused=True)])
        y_baseline = torch.stack(baseline.causal_conv_silu(x_baseline, weight, 3, fused=True))
        differ = (y_compact[:, compact.semantic_rows] != y_baseline[:, baseline.semantic_rows]).any(dim=2).any(dim=0)
        counts[f"seed{seed}.differing_positions"] = float(differ.sum())
        counts[f"seed{seed}.compact_exception_rows"] = float(len(compact.conv_exception_rows()))
    return counts


def case_tiles() -> dict[str, float]:
    """The shifted kernels at several tiles (what `harts bench conv-tiles` times) against the default tiles:
    the largest |Δ| of y and dx (0: the same bits) and dw's relative error (its tile sums round differently)."""
    import torch

    from harts.ops.conv.fused import shifted_conv_silu_backward, shifted_conv_silu_forward
    from tests.ops.kda.helpers import relative_error

    rows, parts, per_part, width = SHAPES[2]
    gen = torch.Generator().manual_seed(42)
    x = torch.randn(rows, parts * per_part, generator=gen)
    weight = torch.randn(parts * per_part, width, generator=gen)
    dy = torch.randn(parts, rows, per_part, generator=gen)
    y0, (dx0, dw0) = shifted_conv_silu_forward(x, weight, parts), shifted_conv_silu_backward(x, weight, dy)
    errors = {}
    for tile in ((16, 64, 2), (8, 256, 4), (64, 32, 1)):
        y, (dx, dw) = shifted_conv_silu_forward(x, weight, parts, tile), shifted_conv_silu_backward(x, weight, dy, tile)
        name = "x".join(map(str, tile))
        errors[f"{name}.y"] = float((y - y0).abs().max())
        errors[f"{name}.dx"] = float((dx - dx0).abs().max())
        errors[f"{name}.dw"] = relative_error(dw, dw0)
    return errors


def case_one_node() -> dict[str, float]:
    """`fused_conv_silu` (one node: the gathered rows written in place, skipped in the shifted backward) against
    the composition it replaces (the shifted node, `index_copy` of the gathered node's rows) on both executions'
    layouts: how many elements of y, dx and dw differ in value (0: the same), the exception rows, and how many
    aten ops of either made a new tensor of y's or x's size, besides allocations (the composition's full-size
    copies; the new node's none)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from harts.ops.conv.fused import fused_conv_silu, fused_gathered_conv_silu, fused_shifted_conv_silu
    from tests.ops.kda.helpers import value_and_grads

    class FullSize(TorchDispatchMode):
        def __init__(self, sizes):
            super().__init__()
            self.sizes, self.ops = sizes, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if (isinstance(out, torch.Tensor) and out.numel() in self.sizes and func not in ALLOCATIONS
                    and not func._schema.is_mutable):
                self.ops.append(str(func))
            return out

    ALLOCATIONS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                   torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default}

    def composition(x, weight, layout):
        y = fused_shifted_conv_silu(x, weight, 3)
        taps, distinct, slot = layout.conv_exception_taps()
        return y.index_copy(1, layout.conv_exception_rows(),
                            fused_gathered_conv_silu(x, weight, taps, 3, (distinct, slot)))

    def one_node(x, weight, layout):
        return fused_conv_silu(x, weight, 3, (layout.conv_exception_rows(), *layout.conv_exception_taps()))

    results = {}
    for case, layout, x, weight, upstream in _layout_cases():
        got = {}
        for name, run in (("composition", composition), ("one_node", one_node)):
            leaves = [x.clone().requires_grad_(), weight.clone().requires_grad_()]
            with FullSize({x.numel()}) as mode:
                got[name] = value_and_grads(partial(run, layout=layout), leaves, upstream)
            results[f"{case}.{name}_full_size_ops"] = float(len(mode.ops))
        for part, a, b in zip(("y", "dx", "dw"), got["one_node"], got["composition"]):
            results[f"{case}.{part}_differing"] = float((a != b).sum())
        results[f"{case}.exception_rows"] = float(len(layout.conv_exception_rows()))
    return results


if __name__ == "__main__":
    patch_interpreter()
    case = {"kernel": case_kernel, "layout": case_layout, "executions": differing_positions,
            "tiles": case_tiles, "one_node": case_one_node}[sys.argv[1]]
    print(json.dumps(case()))
