"""The gated delta rule over packed independent sequences (the per-trajectory baseline): one chunked call.

`packed_gdn(q, k, v, g, beta, cu_seqlens)` runs rows [R, ...] holding whole sequences back to back, each from
the zero state and chunked from its own first row — what a standard trainer of a Gated DeltaNet model does.
Backends: "torch" (`chunk_gdn_torch`, any device) and "fla" (CUDA), whose `kernel` is "gdn" (fla's own varlen
`chunk_gated_delta_rule`, grouped values and the L2 norm of q and k in its kernels — the strong baseline a
Qwen3-Next / Qwen3.5 trainer runs) or "kda" (fla's KDA kernels on the KDA form through `chunk_kda_fla`: the compact
calls' kernels and operations, one call with no boundary state, so that both executions run one kernel family).

fla 0.6 refuses the backward of its GDN kernel on Hopper with Triton >= 3.4.0 and < 3.7.1 (fla issue #640), in
the backward, after the forward ran; `check_gdn_kernel` refuses that kernel before (`fla_gdn_refusal`: fla's own
flags). Tested: the torch backend against `naive_recurrent_gdn` (tests/ops/gdn/test_packed.py); both fla kernels
against the torch backend (the KDA kernels against the recurrence too) under the Triton interpreter on CPU
(tests/ops/gdn/interpreter.py); the refusal with fla's flags faked (tests/ops/gdn/test_refusal.py); on a GPU in bf16,
each kernel against the fp32 torch backend and the two against each other (gpu tests, not yet run on a GPU).
Legend: R packed rows, N sequences, H query/key heads, HV value heads, K key dim, V value dim.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

import numpy as np
import torch

from harts.config.execution import GDN_KERNELS
from harts.ops.gdn.chunk import chunk_gdn_torch, kda_form
from harts.ops.kda.compact import check_kda_backend, l2norm, normalise_qk

if TYPE_CHECKING:
    from harts.ops.kda.fla_chunk import FlaCall

REFUSED_TRITON = ((3, 4, 0), (3, 7, 1))
"""The Triton versions (from, to exclusive) with which fla 0.6 refuses its gated `chunk_bwd_dqkwg` on Hopper."""


def packed_gdn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    cu_seqlens: torch.Tensor, *, chunk_size: int, scale: float | None = None, use_qk_l2norm: bool = False,
    backend: str = "torch", kernel: str = "gdn", cu_seqlens_cpu: torch.Tensor | None = None,
    kda_call: FlaCall | None = None,
) -> torch.Tensor:
    """o [R, HV, V] for q, k [R, H, K], v [R, HV, V], g and beta [R, HV] and cu_seqlens [N + 1]
    (`cu_seqlens_cpu`: their host copy, which spares fla a device-to-host read). `kernel` ("gdn" or "kda") picks
    the fla backend's kernels; `kda_call`: `packed_kda_call` of these sequences, built once by a caller that runs
    many layers over them (else built here)."""
    check_kda_backend(backend, chunk_size, packed=True)
    if kernel not in GDN_KERNELS:
        raise ValueError(f"packed_gdn: unknown kernel {kernel!r} (expected one of {', '.join(GDN_KERNELS)})")
    host = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
    last = int(host[-1])
    if last != q.shape[0]:
        raise ValueError(f"packed_gdn: cu_seqlens ends at row {last} but there are {q.shape[0]} rows (every row must "
                         "belong to a sequence)")
    if backend == "fla" and kernel == "kda":
        if use_qk_l2norm:
            q, k = normalise_qk(q, k, backend)
        call = kda_call if kda_call is not None else packed_kda_call(host, chunk_size, q.device)
        o, _, _ = call.run(*(x.unsqueeze(0) for x in kda_form(q, k, v, g, beta)), scale=scale)
        return o[0]
    if backend == "fla":
        check_gdn_kernel(kernel, backend, q.device)
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        o, _ = chunk_gated_delta_rule(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0).float(), beta.unsqueeze(0).float(),
            scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm, cu_seqlens=cu_seqlens.long(),
            cu_seqlens_cpu=None if cu_seqlens_cpu is None else cu_seqlens_cpu.long(),
        )
        return o[0]
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    o, _, _ = chunk_gdn_torch(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
                              scale=scale, cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    return o[0]


def packed_kda_call(cu_seqlens: torch.Tensor | np.ndarray, chunk_size: int, device: torch.device | str) -> FlaCall:
    """The device plan of one `chunk_kda_fla` call over the sequences of host `cu_seqlens` [N + 1], no state
    requested (it copies to the device: a row layout builds it once for all its layers)."""
    from harts.ops.kda.fla_chunk import FlaCall

    host = cu_seqlens.cpu().numpy() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens
    lengths = np.diff(np.asarray(host, dtype=np.int64))
    return FlaCall.build(lengths, None, chunk_size, torch.device(device))


def check_gdn_kernel(kernel: str, backend: str, device: torch.device | str, *, name: str = "gdn_kernel",
                     where: str = "") -> None:
    """ValueError in one line (starting with `where`), naming the knob `name` and the kernel that runs instead,
    when the packed GDN call of `kernel` on `backend` and `device` would run fla's GDN kernel whose backward the
    installed fla refuses (`fla_gdn_refusal`). Only fla's GDN kernel on CUDA is ever refused."""
    if kernel != "gdn" or backend != "fla" or torch.device(device).type != "cuda":
        return
    reason = fla_gdn_refusal()
    if reason is not None:
        raise ValueError(f"{where}{name} gdn: {reason}; {name} kda runs the baseline's GDN calls on fla's KDA kernels (the "
                         "compact calls' kernels), or install Triton >= 3.7.1 or tilelang")


def fla_gdn_refusal() -> str | None:
    """Why the installed fla refuses the backward of its GDN kernel (`chunk_gated_delta_rule`) on this process's
    GPU, in words, or None where it runs it. fla 0.6's gated `chunk_bwd_dqkwg` raises a RuntimeError on Hopper with
    Triton >= 3.4.0 and < 3.7.1 (wrong results, fla issue #640) unless its tilelang backend takes the call. The
    condition is fla's own flags (fla.utils: IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1), or where
    its fla has none of them, the same one computed from the CUDA device and Triton's version."""
    import fla
    import triton

    try:
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1

        hopper, refused_triton = IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1
    except ImportError:
        hopper = (torch.cuda.get_device_capability()[0] == 9 or "NVIDIA H" in torch.cuda.get_device_name())
        low, high = REFUSED_TRITON
        refused_triton = low <= _version(triton.__version__) < high
    if not (hopper and refused_triton) or _fla_tilelang_takes_it():
        return None
    low, high = (".".join(map(str, v)) for v in REFUSED_TRITON)
    return (f"fla {getattr(fla, '__version__', '?')} refuses the backward of its GDN kernel (chunk_gated_delta_rule) "
            f"on Hopper GPUs with Triton {triton.__version__} (>= {low} and < {high}: wrong gradients, fla issue #640)")


def _fla_tilelang_takes_it() -> bool:
    """Whether fla hands the gated `chunk_bwd_dqkwg` to its tilelang backend (tilelang and nvcc installed, the
    backend enabled, fla's dispatch on), the other way out of its refusal."""
    if os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1":
        return False
    try:
        from fla.ops.common.backends.tilelang import CommonTileLangBackend
    except ImportError:
        return False
    return CommonTileLangBackend.is_available() and CommonTileLangBackend().is_enabled()


def _version(text: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string ("3.6.0", "3.7.1+git...")."""
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])
