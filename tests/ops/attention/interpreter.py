"""Run the `triton_tree` kernels on the CPU under the Triton interpreter and compare them with the dense mask.

Run as `TRITON_INTERPRET=1 python -m tests.ops.attention.interpreter CASE` (test_tree_triton.py does, in a
subprocess, because the variable must be set before any Triton kernel is defined). Prints one JSON object: for
every compared tensor (output, lse, dq, dk, dv of each layout, head dims, tile shape and dtype), its relative error
against `naive_group_attention` in fp64 from the same rounded inputs.

Besides the patches of tests/ops/kda/interpreter.py, one more: the interpreter multiplies bf16 operands of `tl.dot`
as their raw 16-bit integers (numpy has no bf16); here they are widened to fp32 first, which is what the tensor
cores compute (exact products, fp32 sums). Fresh float tensors are filled with NaN, as tests/ops/kda/conftest.py
does, so that an output element the kernels never write shows up.
"""

from __future__ import annotations

import json
import sys

from tests.ops.kda.interpreter import patch_interpreter


def patch_bf16_dot() -> None:
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    builder = interpreter.InterpreterBuilder
    create_dot = builder.create_dot

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = (handle.data.astype(np.uint32) << 16).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def patched(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = patched


def fill_fresh_tensors_with_nan() -> None:
    import torch

    empty, empty_like = torch.empty, torch.empty_like

    def nan_filled(tensor):
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    torch.empty = lambda *a, **k: nan_filled(empty(*a, **k))
    torch.empty_like = lambda *a, **k: nan_filled(empty_like(*a, **k))


def _inputs(num_rows: int, heads: int, qk_dim: int, v_dim: int, dtype, seed: int):
    """q, k, v in `dtype` (v a column slice of a wider tensor, as MLA's is) and an upstream gradient."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(num_rows, heads, qk_dim, generator=gen).to(dtype) for _ in range(2))
    kv = torch.randn(num_rows, heads, qk_dim + v_dim, generator=gen).to(dtype)
    v = kv[..., qk_dim:]
    grad = torch.randn(num_rows, heads, v_dim, generator=gen).to(dtype)
    return q, k, v, grad


def _reference(q, k, v, grad, groups, scale):
    """(out, lse [H, R], dq, dk, dv) in fp64 from the dense mask."""
    import torch

    from harts.ops.attention.groups import naive_group_attention, visibility_mask

    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out = naive_group_attention(*leaves, groups, scale)
    grads = torch.autograd.grad(out, leaves, grad.double())
    scores = scale * torch.einsum("rhe,che->hrc", leaves[0].detach(), leaves[1].detach())
    scores = scores.masked_fill(~visibility_mask(groups, q.shape[0]), float("-inf"))
    return out.detach(), torch.logsumexp(scores, dim=-1), *grads


def _compare(tag: str, layout_name: str, qk_dim: int, v_dim: int, dtype, blocks=(16, 16), heads: int = 2,
             seed: int = 42) -> dict[str, float]:
    import math

    import torch

    from harts.ops.attention.tree_blocks import tree_plan
    from harts.ops.attention.tree_triton import tree_attention_backward, tree_attention_forward

    from ..kda.helpers import relative_error
    from .helpers import named_layout

    layout = named_layout(layout_name)
    q, k, v, grad = _inputs(layout.num_rows, heads, qk_dim, v_dim, dtype, seed)
    scale = qk_dim ** -0.5
    plan = tree_plan(layout.groups, *blocks, "cpu")
    out, lse = tree_attention_forward(q, k, v, plan, scale)
    grads = tree_attention_backward(grad, q, k, v, out, lse, plan, scale)
    errors = {}
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads),
                               _reference(q, k, v, grad, layout.groups, scale)):
        error = relative_error(got, want)
        errors[f"{tag}.{name}"] = error if math.isfinite(error) and torch.isfinite(got).all() else math.inf
    return errors


def case_trees() -> dict[str, float]:
    """Every named layout (forks inside tiles and at their boundaries, 1-row segments, a deep chain, several trees,
    a random step's compact, baseline and baseline-split layouts) in fp32, q/k head dim 24 (two parts: 16 + 8
    padded to 16), v 16, tiles of 16 x 16."""
    import torch

    from .helpers import LAYOUTS

    errors = {}
    for name in LAYOUTS:
        errors.update(_compare(name, name, 24, 16, torch.float32))
    return errors


def case_shapes() -> dict[str, float]:
    """Head dims (MLA's 192/128, one part 16/16, small 8/8 padded, 48/20, GDN's 256/256) and tile shapes
    (32 x 16, 16 x 32, 16 x 64) on trees with ancestors, fp32."""
    import torch

    errors = {}
    for qk_dim, v_dim in ((192, 128), (16, 16), (8, 8), (48, 20), (256, 256)):
        errors.update(_compare(f"fork-inside.{qk_dim}x{v_dim}", "fork-inside", qk_dim, v_dim, torch.float32))
    for blocks in ((32, 16), (16, 32), (16, 64)):
        for name in ("deep-chain", "random-compact"):
            errors.update(_compare(f"{name}.{blocks[0]}x{blocks[1]}", name, 24, 16, torch.float32, blocks))
    return errors


def case_dtypes() -> dict[str, float]:
    """bf16 and fp16 inputs at MLA's head dims (fp32 products and sums; P and dS rounded to the inputs' dtype)."""
    import torch

    errors = {}
    for dtype in (torch.bfloat16, torch.float16):
        for name in ("deep-chain", "random-compact"):
            errors.update(_compare(f"{name}.{str(dtype)[6:]}", name, 192, 128, dtype))
    return errors


def case_keep() -> dict[str, float]:
    """`tree_attention` under an activation checkpoint that keeps its output (harts.ops.attention.keep): the
    forward kernel runs once instead of twice, and the gradients are the same bits as recomputing it; and the
    autograd path (`tree_attention`) against the dense reference."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from harts.ops.attention import tree_triton
    from harts.ops.attention.keep import keeper_contexts

    from ..kda.helpers import relative_error
    from ..kda.interpreter import counting_calls
    from .helpers import named_layout

    layout = named_layout("fork-inside")
    plan = tree_triton.tree_plan(layout.groups, 16, 16, "cpu")
    q, k, v, grad = _inputs(layout.num_rows, 2, 24, 16, torch.float32, 7)
    weight = torch.randn(24, 24, generator=torch.Generator().manual_seed(3))

    def block(q, k, v):
        return torch.tanh(tree_triton.tree_attention(q @ weight, k, v, plan, 0.2))

    results, launches = {}, {}
    for keep in (False, True):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        context = {"context_fn": keeper_contexts} if keep else {}
        with counting_calls(tree_triton, "tree_attention_forward") as counts:
            out = checkpoint(block, *leaves, use_reentrant=False, **context)
            results[keep] = (out, *torch.autograd.grad(out, leaves, grad))
        launches[keep] = counts["tree_attention_forward"]
    reference = [x.double().requires_grad_() for x in (q, k, v)]
    from harts.ops.attention.groups import naive_group_attention

    want = torch.tanh(naive_group_attention(reference[0] @ weight.double(), *reference[1:], layout.groups, 0.2))
    want = (want, *torch.autograd.grad(want, reference, grad.double()))
    errors = {"launches_recomputed": launches[False], "launches_kept": launches[True],
              "kept_vs_recomputed": max((a - b).abs().max().item() for a, b in zip(results[True], results[False]))}
    for name, got, expected in zip(("out", "dq", "dk", "dv"), results[False], want):
        errors[f"autograd.{name}"] = relative_error(got.detach(), expected.detach())
    return errors


if __name__ == "__main__":
    patch_interpreter()
    patch_bf16_dot()
    fill_fresh_tensors_with_nan()
    case = {"trees": case_trees, "shapes": case_shapes, "dtypes": case_dtypes, "keep": case_keep}[sys.argv[1]]
    print(json.dumps(case()))
