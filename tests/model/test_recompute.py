"""Activation recomputation of all blocks or of the first N (`StepConfig.recompute_blocks`, Megatron's
block method): the same step gives the same loss and bitwise the same gradients as without
recomputation (the recomputed forward repeats the same ops on CPU), and exactly blocks 0 … N − 1 (none for 0) run
their forward twice (a pre-forward hook counts: the recomputation stops early, after the last saved
tensor). With `keep_attention` the recomputed MLA blocks keep their attention kernels' outputs: the same
bits again, and each MLA layer's kernel runs once (a dispatch mode counts the kernel calls), not twice."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harts.model.config import load_model_config
from harts.model.model import HybridModel
from harts.objective.step import StepConfig, build_layout, microbatch_extent, run_step, scaled_recompute_blocks
from harts.ops.attention.groups import attention_kernel_ops
from harts.ops.kda.keep import kda_intermediates_kept
from harts.trees.trie import PrefixIndex
from tests.objective.helpers import random_tree_step

SETTINGS = {"none": {}, "all": {"recompute": True}, "first-0": {"recompute": True, "recompute_blocks": 0},
            "first-1": {"recompute": True, "recompute_blocks": 1},
            "first-3": {"recompute": True, "recompute_blocks": 3}, "over": {"recompute": True, "recompute_blocks": 99},
            "all-keep-attention": {"recompute": True, "keep_attention": True},
            "first-3-keep-attention": {"recompute": True, "recompute_blocks": 3, "keep_attention": True}}


@pytest.fixture(scope="module")
def model_and_step():
    model = HybridModel(load_model_config("tiny"))
    model.init_weights(seed=42)
    step = random_tree_step(np.random.default_rng(42), num=6, max_len=40, vocab=3).step
    return model, step


def _run(model, step, settings):
    calls = [0] * len(model.blocks)
    hooks = [block.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
             for i, block in enumerate(model.blocks)]
    model.zero_grad(set_to_none=True)
    try:
        result = run_step(model, step, [np.arange(step.num_trajectories)], StepConfig(execution="compact", **settings))
    finally:
        for hook in hooks:
            hook.remove()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return result.loss, grads, calls


@pytest.mark.parametrize("name", SETTINGS)
def test_recomputed_blocks_and_gradients(model_and_step, name):
    model, step = model_and_step
    num_blocks = len(model.blocks)
    loss, grads, calls = _run(model, step, SETTINGS[name])
    reference_loss, reference_grads, _ = _run(model, step, SETTINGS["none"])
    recomputed = {"none": 0, "all": num_blocks, "first-0": 0, "first-1": 1, "first-3": 3, "over": num_blocks,
                  "all-keep-attention": num_blocks, "first-3-keep-attention": 3}[name]
    assert calls == [2] * recomputed + [1] * (num_blocks - recomputed)
    assert loss == reference_loss
    assert grads.keys() == reference_grads.keys()
    assert all(torch.equal(grads[k], reference_grads[k]) for k in grads)


class _AttentionKernelCalls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.kernels, self.calls = attention_kernel_ops(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in self.kernels
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def equal_head_dims_model():
    # SDPA's fused CPU kernel (a dispatcher op to keep) takes equal q/k and v head dims: 8 + 8 = 16 here.
    config = load_model_config("tiny")
    model = HybridModel(replace(config, mla=replace(config.mla, qk_nope_head_dim=8)))
    model.init_weights(seed=42)
    return model


@pytest.mark.parametrize("backend", ["sdpa", "naive"])
@pytest.mark.parametrize("execution", ["baseline", "compact"])
@pytest.mark.parametrize("recompute_blocks", [None, 3], ids=["all", "first-3"])
def test_kept_attention_runs_each_kernel_once(model_and_step, equal_head_dims_model, backend, execution,
                                              recompute_blocks):
    model, (_, step) = equal_head_dims_model, model_and_step
    counts, losses, grads = {}, {}, {}
    for keep in (False, True):
        config = StepConfig(execution=execution, attention_backend=backend, recompute=True,
                            recompute_blocks=recompute_blocks, keep_attention=keep)
        model.zero_grad(set_to_none=True)
        with _AttentionKernelCalls() as calls:
            losses[keep] = run_step(model, step, [np.arange(step.num_trajectories)], config).loss
        counts[keep] = calls.calls
        grads[keep] = [p.grad.clone() for p in model.parameters()]
    # The MLA block (block 3) runs its kernels once per attention group in the forward, and again in its
    # recomputation unless they are kept; with 3 blocks recomputed it is not recomputed at all.
    recomputed = recompute_blocks is None
    assert counts[True] > 0 and counts[False] == (2 if recomputed else 1) * counts[True]
    assert losses[True] == losses[False]
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))


@pytest.mark.parametrize("bad, message", [
    ({"keep_attention": True}, "keep_attention needs recompute"),
    ({"recompute": True, "keep_attention": True, "attention_backend": "flex"}, "attention backend among"),
    ({"recompute": True, "keep_attention": True, "attention_backend": "cudnn"}, "attention backend among"),
    ({"recompute": True, "keep_attention": 0}, "true or false"),
    ({"recompute": True, "keep_attention": 1}, "true or false"),
], ids=["without-recompute", "flex", "cudnn", "not-bool", "zero"])
def test_bad_keep_attention(bad, message):
    with pytest.raises(ValueError, match=message):
        StepConfig(**bad)


def test_recomputed_blocks_run_inside_the_kda_keeping_context(model_and_step):
    """With the layout's `keep_kda_intermediates` the recomputed blocks, and only they, run inside
    harts.ops.kda.keep's context, in their forward and in their recomputation (where fla's KDA calls then keep
    their intermediates; here the torch KDA ignores it, so the bits are the reference's)."""
    model, step = model_and_step
    seen = []
    hooks = [block.register_forward_pre_hook(lambda *_, i=i: seen.append((i, kda_intermediates_kept())))
             for i, block in enumerate(model.blocks)]
    config = StepConfig(execution="compact", recompute=True, recompute_blocks=3)
    config.keep_kda_intermediates = True  # past the check that asks for fla, whose kernels the CPU lacks
    model.zero_grad(set_to_none=True)
    try:
        result = run_step(model, step, [np.arange(step.num_trajectories)], config)
    finally:
        for hook in hooks:
            hook.remove()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    reference_loss, reference_grads, _ = _run(model, step, SETTINGS["first-3"])
    num_blocks = len(model.blocks)
    assert sorted(seen) == sorted([(i, True) for i in range(3)] * 2 + [(i, False) for i in range(3, num_blocks)])
    assert not kda_intermediates_kept()
    assert result.loss == reference_loss and all(torch.equal(grads[k], reference_grads[k]) for k in grads)


@pytest.mark.parametrize("bad, message", [
    ({"keep_kda_intermediates": True, "kda_backend": "fla"}, "needs recompute"),
    ({"recompute": True, "keep_kda_intermediates": True}, "needs kda_backend 'fla', got 'torch'"),
    ({"recompute": True, "keep_kda_intermediates": 1, "kda_backend": "fla"}, "true or false"),
], ids=["without-recompute", "torch-kda", "not-bool"])
def test_bad_keep_kda_intermediates(bad, message):
    with pytest.raises(ValueError, match=message):
        StepConfig(**bad)


LARGEST = (65536, 65536, 65536)


@pytest.mark.parametrize("recompute_blocks, num_blocks, extent, extents, expected", [
    (12, 24, LARGEST, [LARGEST], 12),
    (12, 24, (23864,) * 3, [LARGEST, (23864,) * 3], 0),     # about a third: every block kept (32 capped at 24)
    (12, 24, (40000,) * 3, [LARGEST, (40000,) * 3], 5),     # kept 12 -> 19
    (12, 24, (40000, 41000, 200000), [(65536, 66000, 200000), (40000, 41000, 200000)], 12),  # as many KV rows
    (12, 24, (40000, 60000, 40000), [LARGEST, (40000, 60000, 40000)], 11),  # replay rows: kept 12 -> 13 (by KDA rows)
    # No microbatch of the step is at least (100, 100, 150) / 60 x this one: not the rows of one and the KV of another.
    (12, 24, (60, 60, 120), [(100, 100, 150), (80, 80, 200), (60, 60, 120)], 8),
    (3, 4, (10, 10, 10), [(30, 30, 30), (10, 10, 10)], 1),
    (4, 4, (10, 10, 10), [(30, 30, 30), (10, 10, 10)], 4),  # nothing kept in the largest: nothing kept here
    (9, 4, (10, 10, 10), [(30, 30, 30), (10, 10, 10)], 4),
], ids=["largest", "third", "compact-rows", "compact-kv", "replay-rows", "no-virtual-largest", "tiny", "all", "over"])
def test_scaled_recompute_blocks(recompute_blocks, num_blocks, extent, extents, expected):
    assert scaled_recompute_blocks(recompute_blocks, num_blocks, extent, extents) == expected


@pytest.mark.parametrize("execution", ["baseline", "compact"])
def test_recompute_by_rows_keeps_more_blocks_in_smaller_microbatches(model_and_step, execution):
    """`recompute_by_rows`: the step's largest microbatch recomputes `recompute_blocks`, a smaller one the first
    `scaled_recompute_blocks` (fewer); the loss and gradients are those without recomputation, bit for bit."""
    model, step = model_and_step
    num_blocks, trajectories = len(model.blocks), np.arange(step.num_trajectories)
    microbatches = [trajectories[:-1], trajectories[-1:]]
    config = StepConfig(execution=execution, recompute=True, recompute_blocks=3, recompute_by_rows=True)
    extents = [microbatch_extent(build_layout(step, m, model, config, PrefixIndex.from_step(step)))
               for m in microbatches]
    small = scaled_recompute_blocks(3, num_blocks, extents[1], extents)
    assert scaled_recompute_blocks(3, num_blocks, extents[0], extents) == 3 and small < 3  # the scaling is exercised
    calls = [0] * num_blocks
    hooks = [block.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
             for i, block in enumerate(model.blocks)]
    model.zero_grad(set_to_none=True)
    try:
        result = run_step(model, step, microbatches, config)
    finally:
        for hook in hooks:
            hook.remove()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    assert calls == [2 + (i < 3) + (i < small) for i in range(num_blocks)]
    model.zero_grad(set_to_none=True)
    reference = run_step(model, step, microbatches, StepConfig(execution=execution))
    assert result.loss == reference.loss
    assert all(torch.equal(grads[name], p.grad) for name, p in model.named_parameters() if p.grad is not None)


@pytest.mark.parametrize("bad, message", [
    ({"recompute": True, "recompute_by_rows": True}, "needs recompute_blocks"),
    ({"recompute": True, "recompute_blocks": 2, "recompute_by_rows": 1}, "true or false"),
], ids=["every-block", "not-bool"])
def test_bad_recompute_by_rows(bad, message):
    with pytest.raises(ValueError, match=message):
        StepConfig(**bad)


@pytest.mark.parametrize("bad", [{"recompute_blocks": 1}, {"recompute": True, "recompute_blocks": -1},
                                 {"recompute": True, "recompute_blocks": True}],
                         ids=["without-recompute", "negative", "bool"])
def test_bad_recompute_blocks(bad):
    with pytest.raises(ValueError, match="recompute_blocks"):
        StepConfig(**bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["varlen", "flash4", "flash4_tree"])
@pytest.mark.parametrize("execution", ["baseline", "compact"])
def test_kept_attention_on_cuda(model_and_step, monkeypatch, backend, execution):
    """On CUDA in bf16 each backend's forward kernel runs once per attention call instead of twice when the
    recomputation keeps it (varlen's and flash4's ops, counted at the dispatcher; flash4_tree's kernel calls,
    which are not an op), the loss is the same bits (FA4's and flash's backward may add dq in another order: the
    gradients are compared closely, not bitwise)."""
    if backend.startswith("flash4"):
        pytest.importorskip("flash_attn.cute", reason=f"{backend} needs the optional flash-attn-4 package")
    _, step = model_and_step
    config = load_model_config("tiny")
    mla = replace(config.mla, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64)  # head dims FA4 runs
    with torch.device("cuda"):
        model = HybridModel(replace(config, mla=mla))
    model.init_weights(seed=42)
    tree_calls = []
    if backend == "flash4_tree":
        from harts.ops.attention import flash4_tree

        forward = flash4_tree.flash4_tree_forward
        monkeypatch.setattr(flash4_tree, "flash4_tree_forward", lambda *a: tree_calls.append(1) or forward(*a))
    counts, losses, grads = {}, {}, {}
    for keep in (False, True):
        # The KDA backend plays no part here; torch's runs the tiny model's chunks of 16 without fla's autotuning.
        config = StepConfig(execution=execution, attention_backend=backend, kda_backend="torch", dtype="bf16",
                            recompute=True, keep_attention=keep)
        model.zero_grad(set_to_none=True)
        tree_calls.clear()
        with _AttentionKernelCalls() as calls:
            losses[keep] = run_step(model, step, [np.arange(step.num_trajectories)], config).loss
        counts[keep] = calls.calls + len(tree_calls)
        grads[keep] = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert counts[True] > 0 and counts[False] == 2 * counts[True]
    assert losses[True] == losses[False]
    assert (grads[True] - grads[False]).norm() <= 1e-3 * grads[False].norm()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("execution", ["baseline", "compact"])
def test_kept_kda_intermediates_on_cuda(model_and_step, execution):
    """On CUDA in bf16 with fla's KDA, recomputed blocks that keep fla's intermediates give the loss and gradients
    of recomputing them, within the spread of two runs that recompute (0 where the kernels are deterministic)."""
    _, step = model_and_step
    config = load_model_config("tiny")
    with torch.device("cuda"):
        model = HybridModel(replace(config, kda=replace(config.kda, chunk_size=64)))  # fla's chunks
    model.init_weights(seed=42)
    losses, grads = [], []
    for keep in (False, False, True):
        config = StepConfig(execution=execution, kda_backend="fla", dtype="bf16", recompute=True,
                            keep_kda_intermediates=keep)
        model.zero_grad(set_to_none=True)
        losses.append(run_step(model, step, [np.arange(step.num_trajectories)], config).loss)
        grads.append(torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None]))
    spread = (grads[1] - grads[0]).norm() / grads[0].norm()
    gap = (grads[2] - grads[0]).norm() / grads[0].norm()
    print(f"{execution}: kept vs recomputed {gap:.3g}, two recomputing runs {spread:.3g}")
    assert abs(losses[2] - losses[0]) <= 10 * abs(losses[1] - losses[0]) + 1e-6 * abs(losses[0])
    assert gap <= 10 * spread + 1e-6
