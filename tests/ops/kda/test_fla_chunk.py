"""The fla path (`chunk_kda_fla`, `compact_kda(backend="fla")`) against the PyTorch reference.

On CPU the Triton kernels run under the interpreter in fp32 (a subprocess: tests/ops/kda/
interpreter.py), where they must agree with `chunk_kda_torch` to fp32 rounding. On CUDA (GPU-only
tests, `-m gpu`) bf16 inputs are compared with the fp32 reference within bf16 tolerances, and with
fla's own `chunk_kda`, whose numerics the path reproduces.
"""

import json

import numpy as np
import pytest
import torch

from harts.bench.kda_handoff import BF16_TOLERANCE, random_kda_leaves
from harts.ops.kda.chunk import chunk_kda_torch
from harts.ops.kda.compact import compact_kda, l2norm
from harts.planning.kda_calls import plan_kda_calls

from .helpers import per_trajectory, relative_error, segment_schedule, tree_from_shape
from .interpreter import run_interpreted


def _interpreted(case: str) -> dict[str, float]:
    return run_interpreted("tests.ops.kda.interpreter", case)


def test_interpreted_states_match_torch():
    """Interior, mid-chunk, zero and final state requests; outputs, states and every gradient."""
    errors = _interpreted("states")
    # Keeping fla's intermediates for the backward (harts.ops.kda.keep): the same bits, six more tensors kept.
    assert (errors.pop("kept_vs_recomputed"), errors.pop("kept_tensors")) == (0, 6), errors
    # and the backward reads them instead of computing them again (w/u and the states: two calls)
    assert (errors.pop("backward_recomputes"), errors.pop("backward_recomputes_kept")) == (2, 0), errors
    assert set(errors) == {"o", "final", "states", "dq", "dk", "dv", "dg", "dbeta", "dh0"}
    assert max(errors.values()) < 1e-5, errors


@pytest.mark.slow
def test_interpreted_compact_matches_per_trajectory():
    errors = _interpreted("compact")
    assert len(errors) == 18
    assert max(errors.values()) < 1e-5, errors


def _check_linked(errors: dict[str, float], schedules: tuple[str, ...]) -> None:
    for tag in schedules:
        assert errors.pop(f"{tag}.linked.recomputed_states") == 1  # one state pass recomputed in the backward
        assert errors.pop(f"{tag}.slots") == 2, errors
    assert errors.pop("segments.calls") == 3
    assert max(errors.values()) < 1e-5, errors


def test_interpreted_linked_calls_match_per_trajectory():
    """The calls of a schedule as one linked launch: outputs and gradients against the per-trajectory reference."""
    errors = _interpreted("linked")
    _check_linked(errors, ("segments",))
    assert set(errors) == {f"segments.{name}" for name in ("o", "dq", "dk", "dv", "dg", "dbeta")}


@pytest.mark.slow
def test_interpreted_linked_calls_match_separate_calls():
    errors = _interpreted("linked-full")
    assert errors.pop("planned.calls") == 2
    assert errors.pop("planned.separate.recomputed_states") == 2
    assert errors.pop("segments.separate.recomputed_states") == 3
    for tag in ("planned", "segments"):
        assert errors.pop(f"{tag}.o_vs_separate") == 0, errors
        # none recomputed with the intermediates kept, and the same values
        assert errors.pop(f"{tag}.kept.recomputed_states") == 0 and errors.pop(f"{tag}.kept_vs_linked") == 0
    _check_linked(errors, ("planned", "segments"))


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICE, HEADS, DIM, LOW = "cuda", 4, 128, torch.bfloat16


def _bf16_leaves(num_rows, num_seqs, seed=42):
    return random_kda_leaves(num_rows, num_seqs, HEADS, DIM, seed, DEVICE, LOW)


def _run_with_grads(run, leaves, weights, **kwargs):
    q, k, v, g, beta, h0 = leaves
    o, final, states = run(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kwargs)
    outputs = (o, final, states)
    loss = sum((x.float() * w).sum() for x, w in zip(outputs, weights))
    return [*outputs, *torch.autograd.grad(loss, leaves)]


@pytest.mark.parametrize("lengths", [[4096], [1000, 64, 2500, 77, 33, 2048], [1, 63, 64, 65, 127, 128, 129]],
                         ids=["one", "mixed", "edges"])
@pytest.mark.parametrize("chunk", [32, 64], ids=lambda b: f"B{b}")
@pytest.mark.gpu
@requires_cuda
def test_gpu_states_match_fp32_reference(lengths, chunk):
    from harts.ops.kda.fla_chunk import chunk_kda_fla

    leaves = _bf16_leaves(sum(lengths), len(lengths))
    reference = [x.detach().float().requires_grad_() for x in leaves]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), device=DEVICE)
    rng = np.random.default_rng(42)
    offsets, ptr = [], [0]
    for length in lengths:
        offsets += sorted({length, *range(chunk, length, chunk), int(rng.integers(0, length + 1))})
        ptr.append(len(offsets))
    kwargs = dict(cu_seqlens=cu, chunk_size=chunk, state_offsets=np.array(offsets), state_ptr=np.array(ptr))
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    weights = [torch.randn(shape, generator=gen, device=DEVICE) for shape in
               [(1, sum(lengths), HEADS, DIM), (len(lengths), HEADS, DIM, DIM), (len(offsets), HEADS, DIM, DIM)]]
    actual = _run_with_grads(chunk_kda_fla, leaves, weights, **kwargs)
    expected = _run_with_grads(chunk_kda_torch, reference, weights, **kwargs)
    names = ["o", "final", "states", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
    errors = {name: relative_error(a, e) for name, a, e in zip(names, actual, expected)}
    print(json.dumps(errors))
    assert all(errors[name] < BF16_TOLERANCE[name] for name in names), errors


PACKED_LENGTHS = [1000, 64, 2500, 77]


@pytest.mark.gpu
@requires_cuda
def test_gpu_without_states_reproduces_fla_chunk_kda():
    """Same stages as fla's `chunk_kda`, only the state pass is ours: the results agree closely."""
    from fla.ops.kda import chunk_kda

    from harts.ops.kda.fla_chunk import chunk_kda_fla

    lengths = PACKED_LENGTHS
    leaves = _bf16_leaves(sum(lengths), len(lengths))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), device=DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    weights = [torch.randn(1, sum(lengths), HEADS, DIM, generator=gen, device=DEVICE),
               torch.randn(len(lengths), HEADS, DIM, DIM, generator=gen, device=DEVICE)]
    q, k, v, g, beta, h0 = leaves
    ours = chunk_kda_fla(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)[:2]
    theirs = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    grads = [torch.autograd.grad(sum((x.float() * w).sum() for x, w in zip(out, weights)), leaves)
             for out in (ours, theirs)]
    errors = {name: relative_error(a, e) for name, a, e in
              zip(["o", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0"], [*ours, *grads[0]], [*theirs, *grads[1]])}
    print(json.dumps(errors))
    assert errors["o"] < 5e-3 and max(errors.values()) < 1e-2, errors


GPU_TREE = ([-1, 0, 0, 0, 1, 1, 2, 6], [3000, 700, 1500, 64, 900, 333, 2048, 17])


@pytest.mark.parametrize("planner", ["plan", "segment"])
@pytest.mark.gpu
@requires_cuda
def test_gpu_compact_matches_per_trajectory(planner):
    """bf16 compact execution on fla against the fp32 per-trajectory reference, and against fla's
    per-trajectory `chunk_kda` (the baseline's numerics)."""
    from fla.ops.kda import chunk_kda

    chunk = 64
    tree = tree_from_shape(*GPU_TREE)
    schedule = (plan_kda_calls if planner == "plan" else segment_schedule)(tree, chunk, replay=True)
    low = _bf16_leaves(tree.num_compact_tokens, 1)[:5]
    leaves = [x.detach()[0].requires_grad_() for x in low]
    reference = [x.detach().float().requires_grad_() for x in leaves]
    index = torch.from_numpy(tree.compact_map()).to(DEVICE)
    weight = torch.randn(len(index), HEADS, DIM, generator=torch.Generator(device=DEVICE).manual_seed(0), device=DEVICE)

    o = compact_kda(*leaves, schedule, backend="fla").index_select(0, index)
    grads = torch.autograd.grad((o.float() * weight).sum(), leaves)
    expected = per_trajectory(reference, tree, chunk)
    grads_expected = torch.autograd.grad((expected * weight).sum(), reference)
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(tree.member_lengths)])).to(DEVICE)
    semantic = [x.index_select(0, index)[None] for x in leaves]
    baseline = chunk_kda(*semantic, cu_seqlens=cu)[0][0]
    grads_baseline = torch.autograd.grad((baseline.float() * weight).sum(), leaves)

    names = ["dq", "dk", "dv", "dg", "dbeta"]
    errors = {"o": relative_error(o, expected)}
    errors |= {n: relative_error(a, e) for n, a, e in zip(names, grads, grads_expected)}
    drift = {"o": relative_error(o, baseline)}
    drift |= {n: relative_error(a, e) for n, a, e in zip(names, grads, grads_baseline)}
    print(json.dumps({"vs_fp32": errors, "vs_fla_per_trajectory": drift}))
    assert all(errors[n] < BF16_TOLERANCE[n] for n in errors), errors
    # The baseline rounds each trajectory's gradient of a shared row to bf16 before summing; the
    # compact path sums inside the kernel, so gradients differ at bf16 rounding, outputs barely.
    assert drift["o"] < 5e-3 and max(drift.values()) < 1e-2, drift


@pytest.mark.parametrize("planner", ["plan", "segment"])
@pytest.mark.gpu
@requires_cuda
def test_gpu_linked_calls_match_separate_calls_and_repeat_bit_for_bit(planner, deterministic_cuda):
    """A random tree of 40 segments: the calls as one linked launch agree with the calls one by one (the same
    kernels; the backward adds a slot's consumers' gradients in another order), and repeat bit for bit (the
    consumers' gradients are added in a fixed order, not by atomics). Deterministic algorithms on: the gradient of
    the rows' gather adds replayed rows' gradients by `index_add_`, whose CUDA kernel uses atomics otherwise."""
    from harts.ops.kda.compact import prepare_schedule

    rng = np.random.default_rng(7)
    parent = [-1] + [int(rng.integers(0, v)) for v in range(1, 40)]
    tree = tree_from_shape(parent, [int(rng.integers(1, 700)) for _ in parent])
    schedule = (plan_kda_calls if planner == "plan" else segment_schedule)(tree, 64, replay=True)
    leaves = [x.detach()[0].requires_grad_() for x in _bf16_leaves(tree.num_compact_tokens, 1)[:5]]
    weight = torch.randn(tree.num_compact_tokens, HEADS, DIM, generator=torch.Generator(device=DEVICE).manual_seed(0),
                         device=DEVICE)
    runs = []
    for separate in (False, False, True):
        prepared = prepare_schedule(schedule, DEVICE, "fla", calls="separate" if separate else "linked")
        assert (prepared.linked is None) == separate
        o = compact_kda(*leaves, prepared)
        runs.append([o, *torch.autograd.grad((o.float() * weight).sum(), leaves)])
    assert schedule.num_calls > 2
    names = ["o", "dq", "dk", "dv", "dg", "dbeta"]
    repeats = {name: (a.float() - b.float()).abs().max().item() for name, a, b in zip(names, runs[0], runs[1])}
    assert not any(repeats.values()), repeats
    errors = {name: relative_error(a, e) for name, a, e in zip(names, *runs[1:])}
    print(json.dumps(errors))
    assert errors["o"] < 1e-3 and max(errors.values()) < 5e-3, errors


@pytest.mark.gpu
@requires_cuda
def test_gpu_l2norm_matches_fla():
    from fla.modules.l2norm import l2norm as fla_l2norm

    x = torch.randn(4096, HEADS, DIM, generator=torch.Generator().manual_seed(42)).to(DEVICE)
    assert relative_error(l2norm(x), fla_l2norm(x)) < 1e-6
