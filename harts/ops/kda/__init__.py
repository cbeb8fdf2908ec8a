"""KDA (Kimi Delta Attention) linear attention: token recurrence, chunked form, compact execution.

- `naive_recurrent_kda`: the token-by-token reference (naive.py).
- `chunk_kda_torch`: chunked WY form in PyTorch over packed sequences, with differentiable states
  after requested offsets (chunk.py) — the CPU path and the oracle.
- `chunk_kda_fla`: the same function on fla's Triton kernels with our state kernels (CUDA;
  fla_chunk.py, imported lazily since importing fla takes seconds).
- `compact_kda`: one packed call per planned call of a `KDASchedule`, boundary states handed
  from earlier calls to later ones with gradients (compact.py).

README.md has the math, the hand-off design and the measured figures.
"""

from harts.ops.kda.chunk import chunk_kda_torch
from harts.ops.kda.compact import compact_kda, l2norm
from harts.ops.kda.naive import naive_recurrent_kda

__all__ = ["chunk_kda_fla", "chunk_kda_torch", "compact_kda", "l2norm", "naive_recurrent_kda"]


def __getattr__(name: str):
    if name == "chunk_kda_fla":
        from harts.ops.kda.fla_chunk import chunk_kda_fla

        return chunk_kda_fla
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
