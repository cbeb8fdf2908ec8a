"""The GDN operators' CUDA paths on CPU under the Triton interpreter (tests.ops.kda.interpreter's patches),
against their torch references.

Run as `TRITON_INTERPRET=1 python -m tests.ops.gdn.interpreter CASE` (test_packed.py does, in a subprocess).
Prints one JSON object: the relative error of every compared tensor.
- "packed": `packed_gdn(backend="fla")` (fla's `chunk_gated_delta_rule`, grouped values, the L2 norm in its
  kernel) against `packed_gdn(backend="torch")`;
- "packed_kda": `packed_gdn(backend="fla", kernel="kda")` (fla's KDA kernels on the KDA form: q and k repeated over
  the value groups, the gate broadcast over the key channels) against the paper's recurrence `naive_recurrent_gdn`
  (written without the KDA form) and against `packed_gdn(backend="torch")`; a baseline layout's
  `gated_delta_rule` on it, twice, with one device plan of the call;
- "compact": `compact_gdn(backend="fla")` (fla's KDA kernels with HARTS's boundary-state kernels on the broadcast
  gate), replay and no-replay, against the torch backend's per-trajectory reference and recurrence.
"""

from __future__ import annotations

import json
import sys

from tests.ops.kda.interpreter import patch_interpreter


def _grads(run, leaves, upstream_seed):
    import torch

    out = run(*leaves)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(upstream_seed))
    return [out, *torch.autograd.grad(out, leaves, upstream)]


def _packed_inputs(value_dim: int):
    """(lengths, cu_seqlens, (q, k, v, g, beta)) of four packed sequences (70, 1, 64 and 33 rows): 2 query/key heads
    of 16, 4 value heads of `value_dim`."""
    import numpy as np
    import torch

    gen = torch.Generator().manual_seed(42)
    lengths = [70, 1, 64, 33]
    total = sum(lengths)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]))
    q, k = (torch.randn(total, 2, 16, generator=gen) for _ in range(2))
    v = torch.randn(total, 4, value_dim, generator=gen)
    return lengths, cu, (q, k, v, -torch.rand(total, 4, generator=gen) * 0.5, torch.rand(total, 4, generator=gen))


def case_packed() -> dict[str, float]:
    from harts.ops.gdn.packed import packed_gdn
    from tests.ops.kda.helpers import relative_error

    lengths, cu, leaves = _packed_inputs(value_dim=16)
    results = []
    for backend in ("torch", "fla"):
        inputs = [x.clone().requires_grad_() for x in leaves]
        results.append(_grads(lambda *x: packed_gdn(*x, cu, chunk_size=64, use_qk_l2norm=True, backend=backend),
                              inputs, 3))
    names = ["o", "dq", "dk", "dv", "dg", "dbeta"]
    return {name: relative_error(actual, expected) for name, expected, actual in zip(names, *results)}


def case_packed_kda() -> dict[str, float]:
    import numpy as np
    import torch

    from harts.ops.gdn.naive import naive_recurrent_gdn
    from harts.ops.gdn.packed import packed_gdn
    from harts.runtime.layout import packed_layout
    from tests.ops.kda.helpers import relative_error

    # 4 value heads over 2 query/key heads, K = 16 != V = 8: a gate broadcast or a head repeat over the wrong axis
    # fails on shapes or values.
    lengths, cu, leaves = _packed_inputs(value_dim=8)

    def recurrence(q, k, v, g, beta):
        q, k = (x / (x.square().sum(-1, keepdim=True) + 1e-6).sqrt() for x in (q, k))  # fla's L2 norm
        return naive_recurrent_gdn(*(x.unsqueeze(0) for x in (q, k, v, g, beta)), cu_seqlens=cu)[0][0]

    runs = {
        "kda": lambda *x: packed_gdn(*x, cu, chunk_size=64, use_qk_l2norm=True, backend="fla", kernel="kda"),
        "torch": lambda *x: packed_gdn(*x, cu, chunk_size=64, use_qk_l2norm=True, backend="torch"),
        "recurrence": recurrence,
    }
    results = {name: _grads(run, [x.clone().requires_grad_() for x in leaves], 3) for name, run in runs.items()}
    names = ["o", "dq", "dk", "dv", "dg", "dbeta"]
    errors = {f"{reference}.{name}": relative_error(actual, expected)
              for reference in ("torch", "recurrence")
              for name, expected, actual in zip(names, results[reference], results["kda"])}
    # A baseline layout's GDN layers share one device plan of the call (built by the first). On the first two
    # sequences only (70 rows over a chunk boundary and 1): the interpreter's time grows with the rows, and the layout
    # ran two thirds of this case's on all four.
    lengths, rows = lengths[:2], sum(lengths[:2])
    prefix = [x[:rows] for x in leaves]
    layout = packed_layout(np.zeros(rows, dtype=np.int64), np.array(lengths), np.arange(len(lengths)), conv_size=4,
                           chunk_size=64, kda_backend="fla", gdn_kernel="kda")
    with torch.no_grad():
        first = layout.gated_delta_rule(*prefix)
        call = layout._packed_kda_call
        again = layout.gated_delta_rule(*prefix)
    assert call is not None and layout._packed_kda_call is call
    errors["layout.o"] = relative_error(first, results["kda"][0][:rows])
    errors["layout.again.o"] = relative_error(again, first)
    assert np.isfinite(list(errors.values())).all()
    return errors


def case_compact() -> dict[str, float]:
    import numpy as np
    import torch

    from harts.ops.gdn.compact import compact_gdn
    from harts.ops.gdn.naive import naive_recurrent_gdn
    from tests.ops.kda.helpers import relative_error, segment_schedule, tree_from_shape

    from .helpers import gdn_inputs, per_trajectory_gdn

    tree = tree_from_shape([-1, 0, 0, 1, 1], [40, 30, 5, 20, 12])
    chunk = 32
    index = torch.from_numpy(tree.compact_map())
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(tree.member_lengths)]))
    errors = {}
    for tag, replay in (("replay", True), ("no_replay", False)):
        leaves = gdn_inputs((tree.num_compact_tokens,), 2, 4, 16, 16, torch.float32, seed=42)
        if replay:
            expected = per_trajectory_gdn(leaves, tree, chunk)
        else:
            semantic = [x.index_select(0, index).unsqueeze(0) for x in leaves]
            expected = naive_recurrent_gdn(*semantic, cu_seqlens=cu)[0][0]
        weight = torch.randn(expected.shape, generator=torch.Generator().manual_seed(3))
        grads_expected = torch.autograd.grad((expected * weight).sum(), leaves)
        o = compact_gdn(*leaves, segment_schedule(tree, chunk, replay), backend="fla")
        semantic_o = o.index_select(0, index)
        grads = torch.autograd.grad((semantic_o * weight).sum(), leaves)
        errors[f"{tag}.o"] = relative_error(semantic_o, expected)
        for name, actual, want in zip(["dq", "dk", "dv", "dg", "dbeta"], grads, grads_expected):
            errors[f"{tag}.{name}"] = relative_error(actual, want)
    assert np.isfinite(list(errors.values())).all()
    return errors


if __name__ == "__main__":
    patch_interpreter()
    case = {"packed": case_packed, "packed_kda": case_packed_kda, "compact": case_compact}[sys.argv[1]]
    print(json.dumps(case()))
