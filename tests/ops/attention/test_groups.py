import numpy as np
import pytest
import torch
import torch.nn.functional as F

from harts.ops.attention.groups import (
    BACKENDS,
    group_attention,
    naive_group_attention,
    sdpa_group_attention,
    visibility_mask,
)
from harts.ops.attention.query_groups import permute_rows
from harts.runtime.layout import baseline_layout, compact_layout
from harts.trees.trie import PrefixIndex
from tests.ops.attention.helpers import random_splits, random_step, standin_flash4, varlen_standin


def _layout(step, execution: str):
    """The step's baseline layout for "baseline", its compact layout otherwise (chunk size 64)."""
    members = np.arange(step.num_trajectories)
    if execution == "baseline":
        return baseline_layout(step, members, conv_size=4, chunk_size=64)
    return compact_layout(step, PrefixIndex.from_step(step), members, conv_size=4, chunk_size=64)


def _ancestor_or_self(layout, step):
    """mask[r, c]: row c holds a path position <= row r's on r's path (from the semantic map)."""
    rows = layout.semantic_rows.numpy()
    mask = np.zeros((layout.num_rows, layout.num_rows), dtype=bool)
    start = 0
    for k in layout.members:
        path = rows[start : start + step.lengths[k]]
        for i, r in enumerate(path):
            mask[r, path[: i + 1]] = True
        start += step.lengths[k]
    return mask


@pytest.mark.parametrize("execution", ["baseline", "baseline-split", "compact"])
@pytest.mark.parametrize("seed", range(4))
def test_groups_see_exactly_the_path(execution, seed):
    step = random_step(42 + seed)
    members = np.arange(step.num_trajectories)
    if execution == "compact":
        layout = compact_layout(step, PrefixIndex.from_step(step), members, conv_size=4, chunk_size=8)
    else:
        splits = random_splits(step, members, seed) if execution == "baseline-split" else None
        layout = baseline_layout(step, members, conv_size=4, chunk_size=8, attention_splits=splits)
        if splits is not None:
            assert layout.groups.num_groups == len(members) + sum(len(c) for c in splits)
    expected = _ancestor_or_self(layout, step)
    assert (visibility_mask(layout.groups, layout.num_rows).numpy() == expected).all()
    # The DFS tree mask (flex backend) describes the same relation.
    subtree_end = layout.groups.row_subtree_end.numpy()
    r, c = np.meshgrid(np.arange(layout.num_rows), np.arange(layout.num_rows), indexing="ij")
    assert ((c <= r) & (r < subtree_end[c]) == expected).all()


@pytest.mark.parametrize("seed", range(3))
def test_sdpa_matches_naive(seed):
    step = random_step(7 + seed, num=10, max_len=30)
    layout = compact_layout(step, PrefixIndex.from_step(step), np.arange(step.num_trajectories), conv_size=4, chunk_size=4)
    gen = torch.Generator().manual_seed(seed)
    rows, heads = layout.num_rows, 2
    q = torch.randn(rows, heads, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(rows, heads, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(rows, heads, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(rows, heads, 6, generator=gen, dtype=torch.float64)
    outs = []
    for fn in (naive_group_attention, sdpa_group_attention):
        out = fn(q, k, v, layout.groups, 0.3)
        grads = torch.autograd.grad(out, (q, k, v), grad)
        outs.append((out, *grads))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("cuts", [[0], [5, 5], [7, 3], [10**6]], ids=["zero", "repeated", "falling", "past-end"])
def test_bad_attention_splits(cuts):
    step = random_step(3, num=1, max_len=40)
    splits = [np.asarray(cuts)]
    with pytest.raises(ValueError, match="attention splits of member 0 must rise inside"):
        baseline_layout(step, np.arange(1), conv_size=4, chunk_size=8, attention_splits=splits)


def test_in_order_flags():
    """The baseline's groups read rows in place (no gathers); a compact tree's keys include ancestors."""
    step = random_step(3, num=16, max_len=200, vocab=3)
    members = np.arange(step.num_trajectories)
    baseline = baseline_layout(step, members, conv_size=4, chunk_size=8).groups
    compact = compact_layout(step, PrefixIndex.from_step(step), members, conv_size=4, chunk_size=8).groups
    assert baseline.q_in_order and baseline.kv_in_order
    assert not compact.kv_in_order and compact.num_kv_rows > len(compact.q_index)
    for groups in (baseline, compact):
        assert groups.q_in_order == torch.equal(groups.q_index, torch.arange(len(groups.q_index)))


def test_unknown_backend():
    step = random_step(1)
    layout = baseline_layout(step, np.arange(step.num_trajectories), conv_size=4, chunk_size=8)
    x = torch.zeros(layout.num_rows, 1, 4)
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        group_attention(x, x, x, layout.groups, 1.0, "fast")
    assert set(BACKENDS) == {"naive", "sdpa", "varlen", "flex", "cudnn", "flash4", "triton_tree", "flash4_tree"}


def test_flash4_refuses_cpu_tensors():
    """Without the optional package or off CUDA, flash4 is a one-line ValueError, not a traceback."""
    step = random_step(0, num=3, max_len=40, vocab=3)
    layout = baseline_layout(step, np.arange(step.num_trajectories), conv_size=4, chunk_size=64)
    x = torch.randn(layout.num_rows, 2, 8)
    with pytest.raises(ValueError, match="flash4"):
        group_attention(x, x, x, layout.groups, 1.0, "flash4")


@pytest.mark.parametrize("execution", ["baseline", "compact", "compact-rows-shuffled"])
def test_packed_attention_matches_naive(execution):
    """The packing shared by the varlen and flash4 backends (queries in group order, each group's keys gathered,
    the output back in row order), with a per-group dense kernel standing in for the GPU's varlen call; the
    shuffled rows take the query permutation and its inverse."""
    from harts.ops.attention.groups import _bottom_right, _packed_attention
    from harts.ops.attention.query_groups import AttentionGroups

    step = random_step(4, num=12, max_len=120, vocab=3)
    layout = _layout(step, execution)
    groups = layout.groups
    if execution == "compact-rows-shuffled":
        position = torch.randperm(layout.num_rows, generator=torch.Generator().manual_seed(1))
        groups = AttentionGroups(
            q_index=position[groups.q_index], q_ptr=groups.q_ptr, kv_index=position[groups.kv_index],
            kv_ptr=groups.kv_ptr, row_subtree_end=groups.row_subtree_end, max_q=groups.max_q, max_k=groups.max_k,
        )
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(layout.num_rows, 2, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    v = torch.randn(layout.num_rows, 2, 4, generator=generator, dtype=torch.float64)

    def attend(q, k, v, cu_q, cu_k):
        assert cu_q.dtype == cu_k.dtype == torch.int32
        pieces = []
        for g in range(len(cu_q) - 1):
            qg, kg, vg = q[cu_q[g] : cu_q[g + 1]], k[cu_k[g] : cu_k[g + 1]], v[cu_k[g] : cu_k[g + 1]]
            mask = _bottom_right(len(qg), len(kg), len(kg) - len(qg))
            pieces.append(F.scaled_dot_product_attention(qg.transpose(0, 1), kg.transpose(0, 1), vg.transpose(0, 1),
                                                         attn_mask=mask, scale=0.5).transpose(0, 1))
        return torch.cat(pieces)

    got = _packed_attention(q, k, v, groups, attend)
    torch.testing.assert_close(got, naive_group_attention(q, k, v, groups, 0.5), rtol=1e-12, atol=1e-12)


def test_flash4_probe_turns_any_failure_into_one_cached_line(monkeypatch):
    """FA4 fails on unsupported shapes with assertions or multi-line compiler errors; the probe keeps one line per
    shape and runs each shape once."""
    calls = []

    def refusing(q, k, v, **kwargs):
        calls.append((q.shape, v.shape, kwargs["causal"]))
        if v.shape[-1] == 4:
            raise RuntimeError("Operation creation failed:\nerror: unknown: expected top-level shape equivalence")
        return varlen_standin(q, k, v, **kwargs)

    groups_module = standin_flash4(monkeypatch, refusing)
    cpu = torch.device("cpu")
    failure = groups_module._flash4_failure(2, 8, 4, torch.float32, cpu)
    assert failure == "Operation creation failed: error: unknown: expected top-level shape equivalence"
    assert groups_module._flash4_failure(2, 8, 4, torch.float32, cpu) == failure and len(calls) == 1
    with torch.inference_mode():  # a caller's inference mode must not fail the probe's backward
        assert groups_module._flash4_failure(2, 8, 8, torch.float32, cpu) is None and len(calls) == 2
    assert calls[1] == (torch.Size([32, 2, 8]), torch.Size([32, 2, 8]), True)


@pytest.mark.parametrize("region", ["checkpoint", "autocast-no-grad"])
def test_flash4_probe_runs_apart_from_the_callers_autograd_state(monkeypatch, region):
    """The first flash4 call of a process may come inside an activation checkpoint's forward (whose saved-tensor
    hooks would route the probe's backward into the block's recomputation) or under no_grad and autocast: the
    probe's forward and backward run as if alone."""
    from torch.utils.checkpoint import checkpoint

    def standin(q, k, v, **kwargs):
        # (Under no_grad, or inside the checkpoint's hooks, the probe's backward would fail: a failure line.)
        assert not torch.is_autocast_enabled("cpu")
        return varlen_standin(q, k, v, **kwargs)

    groups_module = standin_flash4(monkeypatch, standin)
    x = torch.ones(3, requires_grad=True)
    failures = []

    def block(x):
        failures.append(groups_module._flash4_failure(2, 8, 8, torch.float32, torch.device("cpu")))
        return x * x

    if region == "checkpoint":
        checkpoint(block, x, use_reentrant=False).sum().backward()
    else:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            block(x)
    assert failures[0] is None, failures


def test_flash4_version_names_the_installed_package(monkeypatch):
    """A refusal names the installed FA4 release beside the one harts calls (its module functions change)."""
    import importlib.metadata

    from harts.ops.attention import groups as groups_module

    monkeypatch.setattr(importlib.metadata, "version", lambda name: {"flash-attn-4": "4.0.0b40"}[name])
    assert groups_module._flash4_version() == "flash-attn-4 4.0.0b40"

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert groups_module._flash4_version() == "flash-attn-4 of unknown version"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash4_unsupported_head_dims_are_a_value_error():
    pytest.importorskip("flash_attn.cute", reason="flash4 needs the optional flash-attn-4 package")
    step = random_step(0, num=3, max_len=40, vocab=3)
    layout = baseline_layout(step, np.arange(step.num_trajectories), conv_size=4, chunk_size=64)
    groups = layout.groups.to("cuda")
    q = torch.randn(layout.num_rows, 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(layout.num_rows, 2, 32, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"\(flash-attn-4 4\.\S+; harts calls the kernels of flash-attn-4 4\.0\.0b36\) "
                                         "does not run 2 heads of head dims 64/32"):
        group_attention(q, q, v, groups, 0.125, "flash4")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("execution", ["baseline", "compact"])
@pytest.mark.parametrize(
    "backend, dims",
    [("varlen", (64, 32)), ("flex", (64, 32)), ("cudnn", (64, 32)), ("flash4", (64, 64)), ("flash4", (192, 128)),
     ("triton_tree", (64, 32)), ("triton_tree", (192, 128)), ("flash4_tree", (64, 64)), ("flash4_tree", (192, 128))],
    ids=["varlen", "flex", "cudnn", "flash4-64", "flash4-mla", "triton-tree-64", "triton-tree-mla", "flash4-tree-64",
         "flash4-tree-mla"],
)
def test_gpu_backends_match_naive(backend, dims, execution):
    # FA4 on Hopper does not compile v head dim 32 (a CuTe layout error), so it runs at equal dims and at MLA's.
    if backend in ("flash4", "flash4_tree"):
        pytest.importorskip("flash_attn.cute", reason=f"{backend} needs the optional flash-attn-4 package")
    qk_dim, v_dim = dims
    step = random_step(3, num=16, max_len=200, vocab=3)
    layout = _layout(step, execution)
    groups = layout.groups.to("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, heads = layout.num_rows, 4
    q, k = (torch.randn(rows, heads, qk_dim, generator=gen, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    v = torch.randn(rows, heads, v_dim, generator=gen, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(rows, heads, v_dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = naive_group_attention(*ref, groups, 0.125)
    expected_grads = torch.autograd.grad(expected, ref, grad.double())
    out = group_attention(q, k, v, groups, 0.125, backend)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    for got, want in zip((out, *grads), (expected, *expected_grads)):
        error = (got.double() - want).norm() / want.norm()
        assert error < 1e-2, error


@pytest.mark.parametrize("seed", range(3))
def test_permute_rows_matches_indexing(seed):
    """permute_rows (gather by the inverse permutation in backward) against advanced indexing."""
    generator = torch.Generator().manual_seed(seed)
    index = torch.randperm(50, generator=generator)
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(50)
    x = torch.randn(50, 3, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(50, 3, 4, generator=generator, dtype=torch.float64)
    out = permute_rows(x, index, inverse)
    torch.testing.assert_close(out, x[index], rtol=0, atol=0)
    (grad,) = torch.autograd.grad((out * upstream).sum(), x)
    (expected,) = torch.autograd.grad((x[index] * upstream).sum(), x)
    torch.testing.assert_close(grad, expected, rtol=0, atol=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_num_pairs_counts_the_visible_pairs(seed):
    """The pairs a layout's attention computes: the dense visibility mask's count; the baseline's is
    Σ L(L + 1)/2, the compact trie's one per (row, ancestor-or-self) and so fewer."""
    step = random_step(seed, num=12, max_len=150, vocab=3)
    members = np.arange(step.num_trajectories)
    baseline = baseline_layout(step, members, conv_size=4, chunk_size=8)
    compact = compact_layout(step, PrefixIndex.from_step(step), members, conv_size=4, chunk_size=8)
    for layout in (baseline, compact):
        assert layout.groups.num_pairs == int(visibility_mask(layout.groups, layout.num_rows).sum())
    assert baseline.groups.num_pairs == sum(int(n) * (int(n) + 1) // 2 for n in step.lengths)
    assert compact.groups.num_pairs == int((compact.positions + 1).sum()) < baseline.groups.num_pairs
