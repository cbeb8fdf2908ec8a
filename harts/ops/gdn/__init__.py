"""Gated DeltaNet (the gated delta rule with a per-head scalar decay and grouped values): token recurrence,
chunked form, compact execution, the baseline's packed call.

- `naive_recurrent_gdn`: the token-by-token reference, written from the GDN paper (naive.py).
- `kda_form`, `chunk_gdn_torch`: GDN as KDA with the gate broadcast over the key channels and q/k repeated over
  the value groups — the same function — through `chunk_kda_torch` (chunk.py).
- `compact_gdn`, `run_gdn_calls`: the compact execution of a `KDASchedule` (anchors, replay, boundary states
  with gradients, minimum-call schedule) on the KDA machinery (compact.py).
- `packed_gdn`: the per-trajectory baseline's single call; on CUDA fla's `chunk_gated_delta_rule` or its KDA
  kernels on the KDA form; `check_gdn_kernel`: the kernel the installed fla refuses, refused first (packed.py).

README.md has the math and what runs on which device.
"""

from harts.ops.gdn.chunk import chunk_gdn_torch, kda_form
from harts.ops.gdn.compact import compact_gdn, run_gdn_calls
from harts.ops.gdn.naive import naive_recurrent_gdn
from harts.ops.gdn.packed import check_gdn_kernel, packed_gdn

__all__ = ["check_gdn_kernel", "chunk_gdn_torch", "compact_gdn", "kda_form", "naive_recurrent_gdn", "packed_gdn",
           "run_gdn_calls"]
