"""The gated delta rule token by token, as the Gated DeltaNet paper writes it: the reference of the GDN operators.

`naive_recurrent_gdn` computes, per sequence and value head, with a state S ∈ R^{V×K} (the paper's
orientation: S maps keys to values) kept in fp32 (fp64 for fp64 inputs), α_t = exp(g_t) a scalar per head:

    S_t = α_t · S_{t−1} · (I − β_t k_t k_tᵀ) + β_t · v_t k_tᵀ
    o_t = S_t · (scale · q_t)

(Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule", ICLR 2025, eq. 10.)
Grouped values (Qwen3-Next, Qwen3.5): HV value heads over H query/key heads, HV a multiple of H, value head j
reading query/key head j // (HV / H), as fla's `chunk_gated_delta_rule` and transformers' Qwen3-Next do. States
go in and out in fla's layout [N, HV, K, V] (Sᵀ). Written from the paper, not from the KDA code; tested against
fla's `naive_recurrent_gated_delta_rule` (tests/ops/gdn/test_naive.py).
Legend: B batch, T time, H query/key heads, HV value heads, K key dim, V value dim, N sequences.
"""

from __future__ import annotations

import torch


def check_gdn_shapes(name: str, q, k, v, g, beta) -> int:
    """ValueError naming `name` unless the shapes are a gated-delta-rule call's; returns HV / H."""
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"{name}: q and k must share a [B, T, H, K] shape, got {tuple(q.shape)}, {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:2] != q.shape[:2] or v.shape[2] % q.shape[2]:
        raise ValueError(f"{name}: v must be [B, T, HV, V] with HV a multiple of H = {q.shape[2]}, got "
                         f"{tuple(v.shape)}")
    if g.shape != v.shape[:3] or beta.shape != v.shape[:3]:
        raise ValueError(f"{name}: g and beta must be [B, T, HV] = {list(v.shape[:3])}, got {tuple(g.shape)}, "
                         f"{tuple(beta.shape)}")
    return v.shape[2] // q.shape[2]


def naive_recurrent_gdn(
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
    r"""Token-by-token gated delta rule.

    Args:
        q, k: ``[B, T, H, K]``. v: ``[B, T, HV, V]`` (HV a multiple of H). g: ``[B, T, HV]`` log decay (≤ 0).
        beta: ``[B, T, HV]``. scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (N = B, or the number of sequences with ``cu_seqlens``).
        output_final_state: also return the final states ``[N, HV, K, V]``.
        cu_seqlens: ``[N + 1]`` cumulative lengths; then B must be 1.

    Returns:
        ``(o [B, T, HV, V] in v's dtype, final states or None)``.

    Example::

        >>> q, k = torch.randn(2, 1, 10, 2, 8).unbind(0)
        >>> v, g, beta = torch.randn(1, 10, 4, 6), -torch.rand(1, 10, 4), torch.rand(1, 10, 4)
        >>> o, s = naive_recurrent_gdn(q, k, v, g, beta, output_final_state=True, cu_seqlens=torch.tensor([0, 3, 10]))
        >>> o.shape, s.shape
        (torch.Size([1, 10, 4, 6]), torch.Size([2, 4, 8, 6]))
    """
    group = check_gdn_shapes("naive_recurrent_gdn", q, k, v, g, beta)
    batch, length, _, key_dim = q.shape
    value_heads, value_dim = v.shape[2:]
    if scale is None:
        scale = key_dim**-0.5
    dtype = torch.float64 if any(x.dtype == torch.float64 for x in (q, k, v, g, beta)) else torch.float32
    if cu_seqlens is None:
        bounds = [(b, 0, length) for b in range(batch)]
    else:
        if batch != 1:
            raise ValueError(f"naive_recurrent_gdn: batch must be 1 with cu_seqlens, got {batch}")
        cu = [int(x) for x in cu_seqlens]
        bounds = [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]
    out_dtype = v.dtype
    # Value head j reads query/key head j // group.
    q, k = (x.to(dtype).repeat_interleave(group, dim=2) for x in (q, k))
    v, g, beta = (x.to(dtype) for x in (v, g, beta))
    eye = torch.eye(key_dim, dtype=dtype, device=q.device)
    outputs, finals = [], []
    for i, (b, lo, hi) in enumerate(bounds):
        state = q.new_zeros(value_heads, value_dim, key_dim)
        if initial_state is not None:
            state = state + initial_state[i].to(dtype).transpose(-1, -2)
        for t in range(lo, hi):
            key, alpha, rate = k[b, t], g[b, t].exp()[:, None, None], beta[b, t][:, None, None]
            forget = eye - rate * key[:, :, None] * key[:, None, :]
            state = alpha * state @ forget + rate * v[b, t][:, :, None] * key[:, None, :]
            outputs.append((state @ (scale * q[b, t])[:, :, None]).squeeze(-1))
        finals.append(state.transpose(-1, -2))
    if outputs:
        o = torch.stack(outputs).reshape(batch, length, value_heads, value_dim)
    else:
        o = v.new_zeros(batch, length, value_heads, value_dim)
    final_state = torch.stack(finals) if output_final_state else None
    return o.to(out_dtype), final_state
