"""Run the fla path on CPU under the Triton interpreter and compare it with `chunk_kda_torch`.

Run as `TRITON_INTERPRET=1 python -m tests.ops.kda.interpreter CASE` (test_fla_chunk.py does, in
a subprocess, because the variable must be set before any Triton kernel is defined). Prints one
JSON object: the relative error of every compared tensor.

Three patches make Triton 3.6's interpreter run fla's kernels (and ours) on this CPU, none of
which changes what a kernel computes: the autotuner takes its first config instead of timing
(there is no GPU driver to time with); a scalar loaded from memory converts to a Python index
even when numpy holds it as a one-element array (numpy 2 refuses `int()` of such arrays); and
the variable of a `for ... in range(...)` loop is wrapped as a Triton scalar, as the compiler
does, so kernels may call `.to()` on it.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import sys


def run_interpreted(module: str, case: str) -> dict[str, float]:
    """`python -m module case` under the interpreter in a subprocess from the repository root: the
    JSON object its last line prints (the relative errors of a case). Every kernel launch of the case
    is then compiled for Hopper as it was specialized (tests/ops/hopper.py): the interpreter runs
    code the compiler may refuse."""
    import subprocess
    import tempfile
    from pathlib import Path

    from tests.ops.hopper import LAUNCHES, compile_launches

    with tempfile.TemporaryDirectory() as folder:
        launches = os.path.join(folder, "launches.jsonl")
        env = dict(os.environ, TRITON_INTERPRET="1", **{LAUNCHES: launches})
        done = subprocess.run([sys.executable, "-m", module, case], cwd=Path(__file__).resolve().parents[3],
                              env=env, capture_output=True, text=True, timeout=900, check=False)
        assert done.returncode == 0, done.stderr[-4000:]
        compile_launches(launches)
    return json.loads(done.stdout.strip().splitlines()[-1])


def patch_interpreter() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before importing triton"
    from tests.ops.hopper import LAUNCHES, record_launches

    if os.environ.get(LAUNCHES):
        record_launches(os.environ[LAUNCHES])
    import triton.runtime.autotuner as autotuner
    import triton.runtime.interpreter as interpreter

    autotuner.Autotuner.do_bench = property(lambda self: (lambda fn, quantiles=None: [0.0, 0.0, 0.0]))
    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched

    def visit_for(self, node):
        self.generic_visit(node)
        if isinstance(node.target, ast.Name):
            wrap = ast.Call(
                func=ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()), attr="to_tensor",
                                   ctx=ast.Load()),
                args=[ast.Name(id=node.target.id, ctx=ast.Load()), ast.Constant(value=False)], keywords=[],
            )
            node.body.insert(0, ast.Assign(targets=[ast.Name(id=node.target.id, ctx=ast.Store())], value=wrap))
        return node

    interpreter.ASTTransformer.visit_For = visit_for


@contextlib.contextmanager
def counting_calls(module, *names):
    """Counts the calls of `module`'s functions `names` (as the module's other code finds them) while entered."""
    counts = dict.fromkeys(names, 0)
    originals = {name: getattr(module, name) for name in names}

    def counted(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in names:
        setattr(module, name, counted(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(module, name, original)


def case_states() -> dict[str, float]:
    """One varlen call with interior, final, mid-chunk and zero-offset state requests."""
    import numpy as np
    import torch

    from harts.ops.kda import fla_chunk
    from harts.ops.kda.chunk import chunk_kda_torch
    from harts.ops.kda.fla_chunk import chunk_kda_fla
    from harts.ops.kda.keep import keeping_kda_intermediates

    from .helpers import relative_error

    gen = torch.Generator().manual_seed(42)
    lengths = [70, 1, 64, 33]
    total, heads, key_dim, value_dim, chunk = sum(lengths), 1, 16, 16, 32
    q = torch.randn(1, total, heads, key_dim, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(1, total, heads, key_dim, generator=gen), dim=-1)
    v = torch.randn(1, total, heads, value_dim, generator=gen)
    g = -torch.rand(1, total, heads, key_dim, generator=gen)
    beta = torch.rand(1, total, heads, generator=gen)
    h0 = torch.randn(len(lengths), heads, key_dim, value_dim, generator=gen)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta, h0)]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]))
    offsets = np.array([32, 64, 40, 70, 1, 0, 32, 50, 64, 33])
    ptr = np.array([0, 4, 5, 9, 10])
    errors = {}
    results, num_saved, recomputed = [], [], []
    for run, keep in ((chunk_kda_torch, False), (chunk_kda_fla, False), (chunk_kda_fla, True)):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            with keeping_kda_intermediates() if keep else contextlib.nullcontext():
                o, final, states = run(*leaves[:5], initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                       chunk_size=chunk, state_offsets=offsets, state_ptr=ptr)
        num_saved.append(len(saved))
        weights = [torch.randn(x.shape, generator=torch.Generator().manual_seed(7 + i)) for i, x in
                   enumerate((o, final, states))]
        loss = sum((x * w).sum() for x, w in zip((o, final, states), weights))
        with counting_calls(fla_chunk, "recompute_w_u_fwd", "state_forward") as counts:
            results.append([o, final, states, *torch.autograd.grad(loss, leaves)])
        recomputed.append(sum(counts.values()))
    names = ["o", "final", "states", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
    for name, actual, expected in zip(names, results[1], results[0]):
        errors[name] = relative_error(actual, expected)
    # Keeping fla's intermediates (harts.ops.kda.keep): the same kernels' values, six more tensors kept.
    errors["kept_vs_recomputed"] = max((a - b).abs().max().item() for a, b in zip(results[2], results[1]))
    errors["kept_tensors"] = num_saved[2] - num_saved[1]
    # What the backward computes again: w/u/gated q/k and the states without them kept, nothing with them.
    errors["backward_recomputes"] = recomputed[1]
    errors["backward_recomputes_kept"] = recomputed[2]
    return errors


def case_compact() -> dict[str, float]:
    """compact_kda with the fla backend (replay, no replay, and replay with fla's L2 norm of q and k)
    against the per-trajectory torch reference."""
    import numpy as np
    import torch

    from harts.ops.kda.compact import compact_kda, l2norm

    from .helpers import per_trajectory, random_inputs, relative_error, segment_schedule, tree_from_shape

    tree = tree_from_shape([-1, 0, 0, 1, 1], [40, 30, 5, 20, 12])
    chunk = 32
    index = torch.from_numpy(tree.compact_map())
    errors = {}
    for tag, replay, normalise in (("replay", True, False), ("no_replay", False, False), ("l2norm", True, True)):
        leaves = random_inputs(tree.num_compact_tokens, 2, 16, 16, torch.float32, seed=42)
        reference = [l2norm(x) for x in leaves[:2]] + leaves[2:] if normalise else leaves
        expected = per_trajectory(reference, tree, chunk)
        weight = torch.randn(expected.shape, generator=torch.Generator().manual_seed(3))
        grads_expected = torch.autograd.grad((expected * weight).sum(), leaves)
        o = compact_kda(*leaves, segment_schedule(tree, chunk, replay), backend="fla", use_qk_l2norm=normalise)
        semantic = o.index_select(0, index)
        grads = torch.autograd.grad((semantic * weight).sum(), leaves)
        errors[f"{tag}.o"] = relative_error(semantic, expected)
        for name, actual, want in zip(["dq", "dk", "dv", "dg", "dbeta"], grads, grads_expected):
            errors[f"{tag}.{name}"] = relative_error(actual, want)
    assert np.isfinite(list(errors.values())).all()
    return errors


def case_linked(full: bool) -> dict[str, float]:
    """compact_kda on fla with its calls linked into one launch (`LinkedCalls`) against the per-trajectory torch
    reference: nested forks, three consumers of one chunk start, the one-segment-per-call schedule (three calls,
    hand-offs from hand-offs). `full` adds the planned schedule, fla's intermediates kept (the backward then
    starts from the kept states, not from the linked slots) and the calls run one by one."""
    import torch

    from harts.ops.kda import fla_chunk
    from harts.ops.kda.compact import compact_kda, prepare_schedule
    from harts.ops.kda.keep import keeping_kda_intermediates
    from harts.planning.kda_calls import plan_kda_calls

    from .helpers import per_trajectory, random_inputs, relative_error, segment_schedule, tree_from_shape

    tree = tree_from_shape([-1, 0, 0, 0, 1, 1, 4], [70, 40, 20, 9, 33, 12, 5])
    chunk = 32
    index = torch.from_numpy(tree.compact_map())
    leaves = random_inputs(tree.num_compact_tokens, 1, 16, 16, torch.float32, seed=42)
    expected = per_trajectory(leaves, tree, chunk)
    weight = torch.randn(expected.shape, generator=torch.Generator().manual_seed(3))
    grads_expected = torch.autograd.grad((expected * weight).sum(), leaves)
    errors: dict[str, float] = {}
    schedules = [("segments", segment_schedule(tree, chunk, True))]
    forms = [("linked", False, False)]
    if full:
        schedules.append(("planned", plan_kda_calls(tree, chunk)))
        forms += [("kept", False, True), ("separate", True, False)]
    for tag, schedule in schedules:
        results = {}
        for form, separate, keep in forms:
            prepared = prepare_schedule(schedule, "cpu", "fla", calls="separate" if separate else "linked")
            assert (prepared.linked is None) == separate, "fla links a replay schedule's calls when asked to"
            assert separate or not any(call.initial for call in prepared.calls), "linked: no per-call state gathers"
            with keeping_kda_intermediates() if keep else contextlib.nullcontext():
                o = compact_kda(*leaves, prepared)
            semantic = o.index_select(0, index)
            with counting_calls(fla_chunk, "state_forward") as counts:
                grads = torch.autograd.grad((semantic * weight).sum(), leaves)
            results[form] = (semantic, *grads)
            errors[f"{tag}.{form}.recomputed_states"] = counts["state_forward"]
        errors[f"{tag}.calls"] = schedule.num_calls
        errors[f"{tag}.slots"] = prepare_schedule(schedule, "cpu", "fla", calls="linked").linked.num_slots
        for name, actual, want in zip(["o", "dq", "dk", "dv", "dg", "dbeta"], results["linked"],
                                      (expected, *grads_expected)):
            errors[f"{tag}.{name}"] = relative_error(actual, want)
        if full:
            # The same kernels on the same rows: the outputs agree bit for bit, the gradients to rounding (a slot's
            # consumers' gradients are added in another order).
            errors[f"{tag}.o_vs_separate"] = (results["linked"][0] - results["separate"][0]).abs().max().item()
            errors[f"{tag}.grads_vs_separate"] = max(relative_error(a, b) for a, b in zip(results["linked"][1:],
                                                                                          results["separate"][1:]))
            errors[f"{tag}.kept_vs_linked"] = max((a - b).abs().max().item() for a, b in zip(results["kept"],
                                                                                           results["linked"]))
    return errors


def case_gate(lower_bound: float | None = None) -> dict[str, float]:
    """fla's fused gate (`kda_gate`'s CUDA path, the bounded branch with `lower_bound`) against `naive_kda_gate`
    in fp64: g and the gradients of the input, A_log and dt_bias; rows not a multiple of its tile."""
    from functools import partial

    import torch
    from fla.ops.kda.gate import fused_kda_gate

    from harts.ops.kda.gate import naive_kda_gate

    from .helpers import relative_error, value_and_grads

    gen = torch.Generator().manual_seed(42)
    rows, heads, head_dim = 37, 3, 16
    f = torch.randn(rows, heads, head_dim, generator=gen) * 4
    A_log = torch.rand(heads, generator=gen) * 2
    dt_bias = torch.randn(heads * head_dim, generator=gen)
    upstream = torch.randn(rows, heads, head_dim, generator=gen)
    results = []
    for run, dtype in ((partial(naive_kda_gate, lower_bound=lower_bound), torch.float64),
                       (partial(fused_kda_gate, lower_bound=lower_bound), torch.float32)):
        results.append(value_and_grads(run, [x.to(dtype).requires_grad_() for x in (f, A_log, dt_bias)], upstream))
    names = ("g", "df", "dA_log", "ddt_bias")
    return {name: relative_error(actual, expected) for name, actual, expected in zip(names, *results[::-1])}


def case_packed() -> dict[str, float]:
    """The baseline's packed call (`packed_chunk_kda`, the L2 norm in the kernel) against fla's `chunk_kda`: the
    largest absolute difference of o and of each gradient, and what each keeps for the backward (the number of
    its saved tensors that are g, the bytes of the others, each storage once)."""
    import torch
    from fla.ops.kda import chunk_bwd as fla_chunk_bwd
    from fla.ops.kda import chunk_kda

    from harts.ops.kda.fla_packed import packed_chunk_kda

    gen = torch.Generator().manual_seed(42)
    lengths = [70, 1, 64, 33]
    total, heads, key_dim, value_dim = sum(lengths), 2, 16, 16
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q, k = (torch.randn(1, total, heads, key_dim, generator=gen) for _ in range(2))
    v = torch.randn(1, total, heads, value_dim, generator=gen)
    leaves = (q, k, v, -torch.rand(1, total, heads, key_dim, generator=gen) * 0.5,
              torch.rand(1, total, heads, generator=gen))
    upstream = torch.randn(1, total, heads, value_dim, generator=gen)

    def fla(q, k, v, g, beta):
        return chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)[0]

    def lean(q, k, v, g, beta):
        return packed_chunk_kda(q, k, v, g, beta, cu_seqlens, use_qk_l2norm=True)

    def keeping(q, k, v, g, beta):
        return packed_chunk_kda(q, k, v, g, beta, cu_seqlens, use_qk_l2norm=True, keep_intermediates=True)

    runs, recomputed = {}, {}
    for name, run in (("fla", fla), ("lean", lean), ("keep", keeping)):
        inputs = [x.clone().requires_grad_() for x in leaves]
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            o = run(*inputs)
        with counting_calls(fla_chunk_bwd, "recompute_w_u_fwd", "chunk_gated_delta_rule_fwd_h") as counts:
            grads = torch.autograd.grad(o, inputs, upstream)
        recomputed[name] = sum(counts.values())
        g = inputs[3]
        is_g = [t.data_ptr() == g.data_ptr() and t.shape == g.shape for t in saved]
        others = {(t.data_ptr(), t.shape): t.numel() * t.element_size() for t, gate in zip(saved, is_g) if not gate}
        runs[name] = (o, grads, sum(is_g), sum(others.values()))
    (o_fla, grads_fla, g_fla, bytes_fla), (o_lean, grads_lean, g_lean, bytes_lean) = runs["fla"], runs["lean"]
    results = {"o": (o_lean - o_fla).abs().max().item()}
    for grad_name, got, want in zip(("dq", "dk", "dv", "dg", "dbeta"), grads_lean, grads_fla):
        results[grad_name] = (got - want).abs().max().item()
    results.update({"g_kept_fla": g_fla, "g_kept_lean": g_lean, "other_bytes_fla": bytes_fla,
                    "other_bytes_lean": bytes_lean})
    # Keeping fla's intermediates: the same values from the same kernels, with fla's six intermediates kept.
    o_keep, grads_keep, _, bytes_keep = runs["keep"]
    results["kept_vs_recomputed"] = max((a - b).abs().max().item()
                                        for a, b in zip((o_keep, *grads_keep), (o_lean, *grads_lean)))
    results["kept_extra_bytes"] = bytes_keep - bytes_lean
    results["backward_recomputes"] = recomputed["lean"]
    results["backward_recomputes_kept"] = recomputed["keep"]
    return results


if __name__ == "__main__":
    patch_interpreter()
    case = {"states": case_states, "compact": case_compact, "linked": lambda: case_linked(full=False),
            "linked-full": lambda: case_linked(full=True), "gate": case_gate, "packed": case_packed,
            "gate-lower-bound": lambda: case_gate(lower_bound=-5.0)}[sys.argv[1]]
    print(json.dumps(case()))
