"""chunk_gdn_torch (GDN as KDA with a broadcast gate) against the paper's recurrence `naive_recurrent_gdn`,
fp64: outputs, final states, states after requested offsets (chunk multiples, 0, the end, mid-chunk) and
the gradients of q, k, v, g, β and the initial states."""

import numpy as np
import pytest
import torch

from harts.ops.gdn.chunk import chunk_gdn_torch, kda_form
from harts.ops.gdn.naive import naive_recurrent_gdn
from tests.ops.kda.helpers import relative_error

from .helpers import gdn_inputs

LENGTHS = [1, 63, 64, 130, 33]
NAMES = ["o", "final", "states", "dq", "dk", "dv", "dg", "dbeta", "dh0"]


def _requests(lengths, chunk, rng):
    offsets, ptr = [], [0]
    for n in lengths:
        mine = sorted({0, n, *range(chunk, n, chunk), int(rng.integers(0, n + 1))})
        offsets += mine
        ptr.append(len(offsets))
    return np.asarray(offsets), np.asarray(ptr)


def _reference(leaves, h0, cu, offsets, ptr):
    """The recurrence: o and final states of the whole sequences, and each requested state as the final state of
    the sequence's first `offset` rows."""
    o, final = naive_recurrent_gdn(*leaves, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    states = []
    for i in range(len(cu) - 1):
        for offset in offsets[ptr[i]:ptr[i + 1]]:
            lo = int(cu[i])
            part = [x[:, lo:lo + int(offset)] for x in leaves]
            states.append(naive_recurrent_gdn(*part, initial_state=h0[i:i + 1], output_final_state=True)[1][0])
    return o, final, torch.stack(states)


@pytest.mark.parametrize("gate_scale", [1.0, 5.0], ids=["gate1", "gate5"])
@pytest.mark.parametrize("group", [1, 2], ids=["HV1xH", "HV2xH"])
@pytest.mark.parametrize("chunk", [4, 16, 64], ids=lambda b: f"B{b}")
def test_matches_recurrence_fp64(chunk, group, gate_scale):
    rng = np.random.default_rng([42, chunk, group])
    leaves = gdn_inputs((1, sum(LENGTHS)), 2, 2 * group, 8, 6, torch.float64, seed=42, gate_scale=gate_scale)
    h0 = torch.randn(len(LENGTHS), 2 * group, 8, 6, dtype=torch.float64,
                     generator=torch.Generator().manual_seed(1)).requires_grad_()
    cu = torch.tensor(np.concatenate([[0], np.cumsum(LENGTHS)]))
    offsets, ptr = _requests(LENGTHS, chunk, rng)
    results = []
    for run in (lambda: chunk_gdn_torch(*leaves, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                        chunk_size=chunk, state_offsets=offsets, state_ptr=ptr),
                lambda: _reference(leaves, h0, cu, offsets, ptr)):
        outputs = run()
        weights = [torch.randn(x.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(7 + i))
                   for i, x in enumerate(outputs)]
        loss = sum((x * w).sum() for x, w in zip(outputs, weights))
        results.append([*outputs, *torch.autograd.grad(loss, [*leaves, h0])])
    for name, actual, expected in zip(NAMES, *results):
        assert relative_error(actual, expected) < 1e-12, name


def test_kda_form_is_the_broadcast():
    q, k, v, g, beta = (x.detach() for x in gdn_inputs((5,), 2, 4, 3, 2, torch.float32, seed=0))
    q4, k4, v4, g4, beta4 = kda_form(q, k, v, g, beta)
    assert q4.shape == (5, 4, 3) and torch.equal(q4[:, 2], q[:, 1]) and torch.equal(k4[:, 1], k[:, 0])
    assert g4.shape == (5, 4, 3) and torch.equal(g4, g[..., None].expand(5, 4, 3))
    assert v4 is v and beta4 is beta
