"""Whether a KDA call runs inside a recomputed block whose fla kernels keep their intermediates for the backward.

fla's chunked KDA computes, besides its output, the WY factors (w, u), the gated q and k, the chunk states h and
the corrected values v_new; by default its backward computes them again (two kernels, one of them the sequential
pass over the chunks), so that the call keeps only its inputs. Inside a recomputed block (an activation
checkpoint) keeping them costs only a transient: the checkpoint drops what the forward saves, and what the
recomputation saves lives until the KDA layer's backward has read it. `HybridModel.run_blocks` runs such a block's
function inside `keeping_kda_intermediates()` when its layout asks for it (`Layout.keep_kda_intermediates`); the
fla calls (`harts.ops.kda.fla_packed`, `harts.ops.kda.fla_chunk`) read `kda_intermediates_kept()` and then keep
them (fla's `disable_recompute`) instead of computing them again. The function runs inside the context in the
forward and in the recomputation alike, on whichever thread the recomputation runs.
Tested in tests/ops/kda/test_packed.py and test_fla_chunk.py (the calls, under the interpreter) and
tests/model/test_recompute.py (which blocks run inside the context).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_STATE = threading.local()


@contextmanager
def keeping_kda_intermediates() -> Iterator[None]:
    previous = kda_intermediates_kept()
    _STATE.kept = True
    try:
        yield
    finally:
        _STATE.kept = previous


def kda_intermediates_kept() -> bool:
    return getattr(_STATE, "kept", False)
