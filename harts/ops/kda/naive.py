"""The KDA recurrence token by token: the readable reference of every other implementation.

`naive_recurrent_kda` computes, per sequence and head, with a state S ∈ R^{K×V} kept in fp32
(fp64 when the inputs are fp64):

    S ← diag(exp(g_t)) · S
    S ← S + β_t · k_t ⊗ (v_t − Sᵀ k_t)
    o_t = Sᵀ (scale · q_t)

It is the same function as fla's `naive_recurrent_kda` (tested against it), with variable-length
sequences through `cu_seqlens` and without fla's fixed fp32 upcast, so fp64 tests stay fp64.
Legend: B batch, T time, H heads, K key dim, V value dim, N sequences.
"""

from __future__ import annotations

import torch


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp64 if any input is fp64, else fp32: the precision of states and accumulations."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Token-by-token KDA.

    Args:
        q, k: ``[B, T, H, K]``. v: ``[B, T, H, V]``. g: ``[B, T, H, K]`` log-space decay (≤ 0).
        beta: ``[B, T, H]``. scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` (N = B, or the number of sequences with ``cu_seqlens``).
        output_final_state: also return the final states ``[N, H, K, V]``.
        cu_seqlens: ``[N + 1]`` cumulative lengths; then B must be 1.

    Returns:
        ``(o [B, T, H, V] in v's dtype, final states or None)``.

    Example::

        >>> q, k = torch.randn(2, 1, 10, 2, 8).unbind(0)
        >>> v, g, beta = torch.randn(1, 10, 2, 4), -torch.rand(1, 10, 2, 8), torch.rand(1, 10, 2)
        >>> o, s = naive_recurrent_kda(q, k, v, g, beta, output_final_state=True,
        ...                            cu_seqlens=torch.tensor([0, 3, 10]))
        >>> o.shape, s.shape
        (torch.Size([1, 10, 2, 4]), torch.Size([2, 2, 8, 4]))
    """
    batch, length, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    if scale is None:
        scale = key_dim**-0.5
    dtype = compute_dtype(q, k, v, g, beta)
    out_dtype = v.dtype
    if cu_seqlens is None:
        bounds = [(b, 0, length) for b in range(batch)]
    else:
        if batch != 1:
            raise ValueError(f"naive_recurrent_kda: batch must be 1 with cu_seqlens, got {batch}")
        cu = [int(x) for x in cu_seqlens]
        bounds = [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    outputs = []
    finals = []
    for i, (b, lo, hi) in enumerate(bounds):
        state = q.new_zeros(heads, key_dim, value_dim)
        if initial_state is not None:
            state = state + initial_state[i].to(dtype)
        for t in range(lo, hi):
            state = state * g[b, t].exp()[..., None]
            error = v[b, t] - (k[b, t][..., None] * state).sum(-2)
            state = state + (beta[b, t][:, None] * k[b, t])[..., None] * error[:, None, :]
            outputs.append(((q[b, t] * scale)[..., None] * state).sum(-2))
        finals.append(state)
    if outputs:
        o = torch.stack(outputs).reshape(batch, length, heads, value_dim)
    else:
        o = v.new_zeros(batch, length, heads, value_dim)
    final_state = torch.stack(finals) if output_final_state else None
    return o.to(out_dtype), final_state
