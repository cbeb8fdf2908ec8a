"""The `triton_tree` backend (harts.ops.attention.tree_triton) against the dense mask.

On the CPU its kernels run under the Triton interpreter (a subprocess: tests/ops/attention/interpreter.py): output,
log-sum-exp, dq, dk and dv against `naive_group_attention` in fp64 on tiny trees, head dims, tile shapes and dtypes,
and the kept-output recomputation. They are also compiled for Hopper (sm_90) here, without a GPU, which catches
what the interpreter does not check (types the compiler infers, shared memory per block). A model's step with the
kernels stood in for by the dense mask counts the plan's builds (one per microbatch). On CUDA (`-m gpu`):
MLA's and other head dims at realistic sizes, against the dense reference and, on a `paper-slice` microbatch of
65,536 rows, against the varlen backend.
"""

import math

import numpy as np
import pytest
import torch

from harts.ops.attention.groups import group_attention, naive_group_attention
from tests.ops import hopper
from tests.ops.attention.helpers import LAYOUTS, named_layout
from tests.ops.kda.interpreter import run_interpreted

FIELDS = ("out", "lse", "dq", "dk", "dv")


def _interpreted(case: str) -> dict[str, float]:
    return run_interpreted("tests.ops.attention.interpreter", case)


def test_interpreted_trees_match_the_dense_mask():
    """Forks inside tiles and at tile boundaries, 1-row segments, a deep chain, several trees, a random step's
    compact, baseline and baseline-split layouts (fp32, tiles of 16)."""
    errors = _interpreted("trees")
    assert set(errors) == {f"{name}.{field}" for name in LAYOUTS for field in FIELDS}
    assert max(errors.values()) < 1e-5, errors


@pytest.mark.slow
def test_interpreted_head_dims_and_tiles_match_the_dense_mask():
    """MLA's 192/128, 16/16, 8/8, 48/20, 256/256; tiles 32 x 16, 16 x 32, 16 x 64 (fp32)."""
    errors = _interpreted("shapes")
    assert len(errors) == 5 * (5 + 6)
    assert max(errors.values()) < 1e-5, errors


def test_interpreted_half_precision_matches_the_dense_mask():
    """bf16 and fp16 at MLA's head dims, against fp64 from the same rounded inputs: within the rounding of the
    output and of P and dS to the inputs' dtype (the lse is fp32)."""
    errors = _interpreted("dtypes")
    assert len(errors) == 2 * 2 * 5
    for name, error in errors.items():
        bound = 1e-5 if name.endswith(".lse") else 1.5e-2 if "bfloat16" in name else 1.5e-3
        assert error < bound, (name, error)


def test_interpreted_kept_attention_runs_the_forward_once():
    """Under a checkpoint with harts.ops.attention.keep's keeper the forward kernel runs once instead of twice and
    the gradients are the same bits; the autograd function against the dense reference."""
    errors = _interpreted("keep")
    assert (errors.pop("launches_recomputed"), errors.pop("launches_kept"), errors.pop("kept_vs_recomputed")) == (
        2, 1, 0)
    assert max(errors.values()) < 1e-5, errors


HOPPER_SHARED_MEMORY = 232448
"""Bytes of shared memory one block may take on sm_90."""


def _compile_for_hopper(kernel, dtype, constants: dict, launch: dict):
    """`kernel` compiled for sm_90 with pointers of `dtype` (fp32 log-sum-exp and delta, int32 tile lists) and the
    given constexprs, without a GPU."""
    element = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    pointers = {"LSE": "*fp32", "DELTA": "*fp32",
                **dict.fromkeys(("ENDS", "ORDER", "PTR", "NUM_FULL", "TILES"), "*i32")}
    signature = {}
    for param in kernel.params:
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
        elif name.isupper():
            signature[name] = pointers.get(name, f"*{element}")
        else:
            signature[name] = "fp32" if name in ("qk_scale", "scale") else "i32"
    return hopper.compile_sm90(kernel, signature, constants, options=launch)


@pytest.mark.parametrize("dims, dtype", [
    ((192, 128), torch.bfloat16),
    pytest.param((192, 128), torch.float32, marks=pytest.mark.slow),
    pytest.param((256, 256), torch.bfloat16, marks=pytest.mark.slow),
    pytest.param((24, 16), torch.float16, marks=pytest.mark.slow),
], ids=["mla-bf16", "mla-fp32", "gdn-bf16", "small-fp16"])
def test_kernels_compile_for_hopper(dims, dtype):
    """The four kernels at the backend's tiles compile for sm_90 and fit its shared memory."""
    from harts.ops.attention import tree_triton

    qk_dim, v_dim = dims
    q = torch.empty(1, 1, qk_dim, dtype=dtype, device="meta")
    shapes = tree_triton._shapes(q, q, torch.empty(1, 1, v_dim, dtype=dtype, device="meta"))
    rows = tree_triton.tile_rows(dtype, qk_dim, v_dim)
    tiles = dict(BLOCK_M=rows, BLOCK_N=rows)
    kernels = {"forward": tree_triton._tree_forward, "backward_kv": tree_triton._tree_backward_kv,
               "backward_q": tree_triton._tree_backward_q}
    assert set(kernels) == set(tree_triton.KERNEL_LAUNCH)
    compiled = [_compile_for_hopper(kernel, dtype, {**shapes, **tiles}, tree_triton.KERNEL_LAUNCH[name])
                for name, kernel in kernels.items()]
    compiled.append(_compile_for_hopper(tree_triton._tree_delta, dtype, dict(
        F=shapes["F"], BLOCK_F=shapes["BLOCK_F"], BLOCK_M=rows), {"num_warps": 4}))
    for kernel in compiled:
        assert 0 < kernel.metadata.shared <= HOPPER_SHARED_MEMORY, (kernel.name, kernel.metadata.shared)


def test_the_backend_refuses_cpu_tensors():
    layout = named_layout("fork-inside")
    x = torch.randn(layout.num_rows, 2, 16)
    with pytest.raises(ValueError, match="attention backend 'triton_tree' runs Triton kernels on CUDA .* on cpu"):
        group_attention(x, x, x, layout.groups, 0.25, "triton_tree")


def _dense_tree_forward(q, k, v, plan, scale):
    """The kernels' forward, (out, lse [H, R]), from the dense tree mask of the plan's subtree ends (a stand-in)."""
    ends = plan.subtree_end.long()
    rows = torch.arange(len(ends))
    visible = (rows[None, :] <= rows[:, None]) & (rows[:, None] < ends[None, :])
    scores = (scale * torch.einsum("rhe,che->hrc", q, k)).masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.einsum("hrc,chf->rhf", torch.exp(scores - lse[..., None]), v), lse


def _dense_tree_backward(dout, q, k, v, out, lse, plan, scale):
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    with torch.enable_grad():
        again, _ = _dense_tree_forward(*leaves, plan, scale)
    return torch.autograd.grad(again, leaves, dout)


def test_a_step_builds_one_plan_per_microbatch(monkeypatch):
    """A compact step of two microbatches through a model of two MLA layers, every block recomputed and the attention
    kept (as `bench speedup --recompute --keep-attention` runs it): each microbatch's layout is checked and its tile
    lists built once, not per layer, recomputation or backward, and all its attention calls read that one plan. On
    the CPU the kernels are stood in for by the plan's dense tree mask; the loss is the sdpa backend's."""
    pytest.importorskip("triton")
    from dataclasses import replace

    from harts.model.config import load_model_config
    from harts.model.model import HybridModel
    from harts.objective.step import StepConfig, run_step
    from harts.ops.attention import groups as groups_module
    from harts.ops.attention import tree_blocks, tree_triton
    from tests.ops.attention.helpers import random_step
    from tests.ops.kda.interpreter import counting_calls

    config = replace(load_model_config("tiny"), num_layers=8)
    assert config.layer_kinds().count("mla") == 2
    model = HybridModel(config)
    model.init_weights(seed=42)
    step = random_step(3, num=12, max_len=60, vocab=3)
    halves = np.array_split(np.arange(step.num_trajectories), 2)
    read = []

    def forward(q, k, v, plan, scale):
        read.append(plan)
        return _dense_tree_forward(q, k, v, plan, scale)

    def backward(dout, q, k, v, out, lse, plan, scale):
        read.append(plan)
        return _dense_tree_backward(dout, q, k, v, out, lse, plan, scale)

    monkeypatch.setattr(tree_triton, "tree_attention_forward", forward)
    monkeypatch.setattr(tree_triton, "tree_attention_backward", backward)
    # The backend itself, past its check for CUDA tensors.
    monkeypatch.setitem(groups_module.BACKENDS, "triton_tree", tree_triton.triton_tree_attention)
    losses = {}
    for backend in ("triton_tree", "sdpa"):
        step_config = StepConfig(execution="compact", attention_backend=backend, kda_backend="torch", recompute=True,
                                 keep_attention=True)
        with counting_calls(tree_blocks, "tile_lists", "tree_mask_mismatch") as builds, \
                counting_calls(tree_triton, "tree_plan") as lookups:
            losses[backend] = run_step(model, step, halves, step_config).loss
        model.zero_grad(set_to_none=True)
        if backend == "triton_tree":
            assert builds == {"tile_lists": 2, "tree_mask_mismatch": 2}
            # Per microbatch and MLA layer: looked up in the forward and the recomputation; its forward kernel once
            # (kept), its backward once.
            assert lookups == {"tree_plan": 2 * 2 * 2} and len(read) == 2 * 2 * 2
            assert len({id(plan) for plan in read}) == 2
    assert losses["triton_tree"] == pytest.approx(losses["sdpa"], rel=1e-5)


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}


def _relative_errors(got, want) -> dict[str, float]:
    return {name: float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, want)}


def _run(backend: str, inputs, grad, groups, scale):
    out = group_attention(*inputs, groups, scale, backend)
    return (out, *torch.autograd.grad(out, inputs, grad))


def _cuda_inputs(num_rows, heads, qk_dim, v_dim, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((num_rows, heads, qk_dim), (num_rows, heads, qk_dim), (num_rows, heads, v_dim), (num_rows, heads, v_dim))
    q, k, v, grad = (torch.randn(*shape, generator=gen, device="cuda").to(dtype) for shape in shapes)
    return [x.requires_grad_() for x in (q, k, v)], grad


def _synthetic_layout(trees: str, execution: str, capacity: int):
    """The first microbatch's layout of a shipped trees config's step 0 (HARTS or per-trajectory plan)."""
    from harts.bench.attention import _layouts
    from harts.trees.sources import iter_steps

    (_, step, _), = iter_steps(trees, 0, [0])
    return _layouts(step, capacity, 1)[execution][0]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("dims", [(192, 128), (64, 32), (256, 256)], ids=["mla", "small", "gdn"])
@pytest.mark.parametrize("execution", ["baseline", "compact"])
def test_gpu_matches_the_dense_reference(execution, dims, dtype):
    """16 heads on a `cpu-small` microbatch (a few thousand rows, trees with ancestors), against fp64 from the same
    rounded inputs."""
    layout = _synthetic_layout("cpu-small", execution, 4096)
    groups = layout.groups.to("cuda")
    qk_dim, v_dim = dims
    inputs, grad = _cuda_inputs(layout.num_rows, 16, qk_dim, v_dim, dtype)
    got = _run("triton_tree", inputs, grad, groups, qk_dim ** -0.5)
    reference = [x.detach().double().requires_grad_() for x in inputs]
    out = naive_group_attention(*reference, groups, qk_dim ** -0.5)
    want = (out, *torch.autograd.grad(out, reference, grad.double()))
    errors = _relative_errors(got, want)
    assert max(errors.values()) < TOLERANCE[dtype], errors


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("execution", ["baseline", "compact"])
def test_gpu_paper_slice_matches_varlen(execution):
    """A 65,536-row microbatch of the `paper-slice` trees at MLA's shape in bf16: the same output and gradients as
    the varlen backend (ancestor KV gathered), within bf16 rounding, and deterministic."""
    layout = _synthetic_layout("paper-slice", execution, 65536)
    groups = layout.groups.to("cuda")
    inputs, grad = _cuda_inputs(layout.num_rows, 16, 192, 128, torch.bfloat16)
    got = _run("triton_tree", inputs, grad, groups, 192 ** -0.5)
    errors = _relative_errors(got, _run("varlen", inputs, grad, groups, 192 ** -0.5))
    assert max(errors.values()) < 1e-2, errors
    assert all(torch.equal(a, b) for a, b in zip(got, _run("triton_tree", inputs, grad, groups, 192 ** -0.5)))
    assert all(math.isfinite(float(x.float().norm())) for x in got)


@pytest.mark.gpu
@requires_cuda
def test_gpu_model_step_keeps_attention_and_matches_varlen():
    """A compact step of the tiny model (bf16, every block recomputed): keeping the attention gives the same loss
    bits, and the loss is the varlen backend's within bf16 rounding."""
    from harts.model.config import load_model_config
    from harts.model.model import HybridModel
    from harts.objective.step import StepConfig, run_step
    from tests.ops.attention.helpers import random_step

    step = random_step(3, num=16, max_len=200, vocab=3)
    with torch.device("cuda"):
        model = HybridModel(load_model_config("tiny"))
    model.init_weights(seed=42)
    members = [np.arange(step.num_trajectories)]
    losses = {}
    for backend, keep in (("triton_tree", False), ("triton_tree", True), ("varlen", False)):
        config = StepConfig(execution="compact", attention_backend=backend, kda_backend="torch", dtype="bf16",
                            recompute=True, keep_attention=keep)
        losses[backend, keep] = float(run_step(model, step, members, config).loss)
    assert losses["triton_tree", True] == losses["triton_tree", False]
    assert losses["triton_tree", False] == pytest.approx(losses["varlen", False], rel=1e-2)
