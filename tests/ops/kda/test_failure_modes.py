"""Linear-attention failure modes reported in 2026 (fla issues and PRs; other trainers' packed-sequence state
leaks for Qwen3.5/Nemotron), as regression tests of HARTS's KDA operators, on the PyTorch path (CPU, fp64: to
rounding) and on fla's kernels (CUDA, `-m gpu`, bf16 against the fp32 reference):

- several packed sequences per call never share state: `packed_kda` over sequences of 1, 2, B − 1, B, B + 1 and
  more rows equals each sequence run alone, forward and every gradient;
- a non-contiguous output gradient (a permuted or broadcast view, as a caller's loss can produce) gives the same
  input gradients as its contiguous copy, through `packed_kda` and `compact_kda` (fla's initial-state gradient was
  wrong for one);
- rows past `cu_seqlens[-1]` (slack rows, which fla computes as NaN) are refused by name, not computed.

The tree paths (short segments after forks, siblings in one call) are in tests/model/test_fork_failure_modes.py and
tests/ops/kda/test_compact.py.
"""

import numpy as np
import pytest
import torch

from harts.ops.kda.compact import compact_kda
from harts.ops.kda.packed import packed_kda
from harts.planning.kda_calls import plan_kda_calls

from .helpers import random_inputs, relative_error, tree_from_shape

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# backend: (device, chunk, dtype, heads, key dim, tolerance against the fp64/fp32 reference)
BACKENDS = {
    "torch": ("cpu", 16, torch.float64, 2, 8, 1e-10),
    "fla": ("cuda", 64, torch.bfloat16, 4, 64, 2e-2),
}
PARAMS = [pytest.param("torch", id="torch"),
          pytest.param("fla", id="fla", marks=[pytest.mark.gpu, requires_cuda])]


def _lengths(chunk: int) -> list[int]:
    return [1, 2, chunk - 1, chunk, chunk + 1, 3 * chunk + 5]


def _packed(leaves, cu, chunk, backend):
    return packed_kda(*leaves, torch.as_tensor(cu, device=leaves[0].device), chunk_size=chunk, use_qk_l2norm=True,
                      backend=backend, cu_seqlens_cpu=torch.as_tensor(cu))


@pytest.mark.parametrize("backend", PARAMS)
def test_packed_sequences_never_share_state(backend):
    device, chunk, dtype, heads, dim, tolerance = BACKENDS[backend]
    lengths = _lengths(chunk)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    leaves = random_inputs(int(cu[-1]), heads, dim, dim, dtype, seed=3, device=device, gate_scale=0.2)
    upstream = torch.randn(int(cu[-1]), heads, dim, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    upstream = upstream.to(device)
    packed = _packed(leaves, cu, chunk, backend)
    grads = torch.autograd.grad(packed, leaves, upstream.to(packed.dtype))
    # Each sequence alone, on the fp64 (CPU) reference path: the oracle of both backends.
    for b, (lo, hi) in enumerate(zip(cu[:-1], cu[1:])):
        alone = [x.detach()[lo:hi].double().cpu().requires_grad_() for x in leaves]
        out = _packed(alone, [0, hi - lo], chunk, "torch")
        expected = torch.autograd.grad(out, alone, upstream[lo:hi].cpu())
        assert relative_error(packed[lo:hi].cpu(), out) <= tolerance, (b, hi - lo)
        for name, got, want in zip(("dq", "dk", "dv", "dg", "dbeta"), grads, expected):
            assert relative_error(got[lo:hi].cpu(), want) <= tolerance, (b, hi - lo, name)


def _noncontiguous(shape, device, dtype):
    """Views with the values of a [*shape] tensor: permuted (strides reversed) and broadcast (stride 0). Made in
    the final dtype: a dtype conversion of a broadcast view is a contiguous copy."""
    gen = torch.Generator().manual_seed(5)
    permuted = torch.randn(*reversed(shape), generator=gen, dtype=torch.float64).to(device, dtype).permute(2, 1, 0)
    broadcast = torch.randn(1, shape[1], shape[2], generator=gen, dtype=torch.float64).to(device, dtype)
    return {"permuted": permuted, "broadcast": broadcast.expand(*shape)}


@pytest.mark.parametrize("view", ["permuted", "broadcast"])
@pytest.mark.parametrize("operator", ["packed", "compact"])
@pytest.mark.parametrize("backend", PARAMS)
def test_a_noncontiguous_output_gradient_is_read_by_value(backend, operator, view):
    device, chunk, dtype, heads, dim, tolerance = BACKENDS[backend]
    if operator == "packed":
        cu = np.concatenate([[0], np.cumsum(_lengths(chunk))])
        num_rows = int(cu[-1])

        def run(leaves):
            return _packed(leaves, cu, chunk, backend)
    else:
        # A root chunk and a half, forks inside and at its chunk boundary, 1-token branches: handed-off states.
        tree = tree_from_shape([-1, 0, 0, 0, 1, 3], [chunk + chunk // 2, 1, chunk // 2, 2 * chunk, 1, 3])
        schedule = plan_kda_calls(tree, chunk, replay=True)
        num_rows = tree.num_compact_tokens

        def run(leaves):
            return compact_kda(*leaves, schedule, use_qk_l2norm=True, backend=backend)
    leaves = random_inputs(num_rows, heads, dim, dim, dtype, seed=6, device=device, gate_scale=0.2)
    out = run(leaves)
    upstream = _noncontiguous(tuple(out.shape), device, out.dtype)[view]
    assert not upstream.is_contiguous()
    got = torch.autograd.grad(out, leaves, upstream, retain_graph=True)
    want = torch.autograd.grad(out, leaves, upstream.contiguous())
    # Reading the view's storage as if contiguous gives an O(1) error; the fla backward's atomic sums round
    # differently from one run to the next (7.7e-4 for dk on an H100), within the backend's tolerance.
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want):
        assert relative_error(a, b) <= tolerance, name


@pytest.mark.parametrize("backend", PARAMS)
def test_rows_past_the_last_sequence_are_refused(backend):
    device, chunk, dtype, heads, dim, _ = BACKENDS[backend]
    leaves = random_inputs(2 * chunk + 3, heads, dim, dim, dtype, seed=7, device=device)
    with pytest.raises(ValueError, match=rf"packed_kda: cu_seqlens ends at row {2 * chunk} but there are "
                                         rf"{2 * chunk + 3} rows"):
        _packed(leaves, [0, chunk, 2 * chunk], chunk, backend)
