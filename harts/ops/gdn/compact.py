"""The gated delta rule over the compact rows of a segment tree: the KDA compact execution of its KDA form.

`compact_gdn(q, k, v, g, beta, schedule)` executes a `KDASchedule` (harts.planning.kda_schedule; the schedule
depends only on the tree and the chunk size, not on the operator) exactly as `compact_kda` does — one packed
chunked call per planned call, replay rows from the nearest chunk-boundary anchor, boundary states handed from
earlier calls to later ones with their gradients — on `kda_form` of the inputs (harts.ops.gdn.chunk: q and k
repeated over the value groups, the per-head gate broadcast over the key channels). `run_gdn_calls` is the middle
stage for callers that gather their own rows (the model's GDN layer, through `Layout.gated_delta_rule`).

What runs where: the "torch" backend runs `chunk_kda_torch` (any device; the CPU path); the "fla" backend
(CUDA) runs `chunk_kda_fla`, fla's KDA kernels with HARTS's boundary-state kernels (harts.ops.kda.fla_chunk,
tested on an H200), on the broadcast gate. fla's own `chunk_gated_delta_rule` has no intermediate-state output
and no gradient for one, so the compact calls do not use it; the per-trajectory baseline does by default
(harts.ops.gdn.packed; with `kernel="kda"` it runs these kernels too). The broadcast gate costs the KDA kernels' per-channel gate work and an fp32 [R, HV, K]
gate per call; a GDN state kernel with boundary outputs would avoid both.

Invariant (tests/ops/gdn/test_compact.py): with a replay schedule, outputs and every gradient equal
per-trajectory execution gathered through the compact map (fp64 1e-12, fp32 1e-5); with a no-replay schedule
they equal the token recurrence `naive_recurrent_gdn` along every path.
Legend: C compact rows, H query/key heads, HV value heads, K key dim, V value dim.
"""

from __future__ import annotations

from typing import Literal

import torch

from harts.ops.gdn.chunk import kda_form
from harts.ops.kda.compact import (
    PreparedSchedule, computed_rows, gather_call_rows, normalise_qk, prepare_schedule, run_calls,
)
from harts.planning.kda_schedule import KDASchedule


def run_gdn_calls(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    prepared: PreparedSchedule, *, scale: float | None = None,
) -> torch.Tensor:
    """o ``[Σ R, HV, V]`` of the planned calls over their rows (q, k ``[Σ R, H, K]`` already normalised,
    v ``[Σ R, HV, V]``, g and beta ``[Σ R, HV]``), replay rows included (`run_calls` of the KDA form)."""
    return run_calls(*kda_form(q, k, v, g, beta), prepared, scale=scale)


def compact_gdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    schedule: KDASchedule | PreparedSchedule,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    backend: Literal["torch", "fla"] = "torch",
) -> torch.Tensor:
    r"""The gated delta rule over compact rows, executing `schedule`'s calls in order.

    Args:
        q, k: ``[C, H, K]``. v: ``[C, HV, V]`` (HV a multiple of H). g: ``[C, HV]`` log decay. beta: ``[C, HV]``.
        schedule: the call plan of these C rows (`plan_kda_calls(tree, B, replay=...)`) or its
            `prepare_schedule` form.
        scale: defaults to ``K ** -0.5``. use_qk_l2norm: L2-normalise q and k per row first.
        backend: ``"torch"`` or ``"fla"`` (CUDA, B ∈ {32, 64}, K ≤ 256).

    Returns:
        o ``[C, HV, V]``.

    Example::

        >>> tree = PrefixIndex.from_step(step).segment_tree()  # doctest: +SKIP
        >>> o = compact_gdn(q, k, v, g, beta, plan_kda_calls(tree, 64), use_qk_l2norm=True)  # doctest: +SKIP
    """
    prepared = schedule if isinstance(schedule, PreparedSchedule) else prepare_schedule(schedule, q.device, backend)
    num_rows = prepared.schedule.num_compact_tokens
    if q.dim() != 3 or q.shape[0] != num_rows or k.shape != q.shape:
        raise ValueError(f"compact_gdn: q, k must be [C={num_rows}, H, K], got {tuple(q.shape)}, {tuple(k.shape)}")
    if v.dim() != 3 or v.shape[0] != num_rows or v.shape[1] % q.shape[1]:
        raise ValueError(f"compact_gdn: v must be [C, HV, V] with HV a multiple of H = {q.shape[1]}, got "
                         f"{tuple(v.shape)}")
    if g.shape != v.shape[:2] or beta.shape != v.shape[:2]:
        raise ValueError(f"compact_gdn: g and beta must be [C, HV] = {list(v.shape[:2])}, got {tuple(g.shape)}, "
                         f"{tuple(beta.shape)}")
    if q.device != prepared.device:
        raise ValueError(f"compact_gdn: inputs on {q.device}, schedule prepared for {prepared.device}")
    if not prepared.calls:
        return v.new_zeros(0, *v.shape[1:])
    if use_qk_l2norm:
        q, k = normalise_qk(q, k, prepared.backend)
    inputs = (gather_call_rows(x, prepared) for x in (q, k, v, g, beta))
    return computed_rows(run_gdn_calls(*inputs, prepared, scale=scale), prepared)
