"""Full attention over rows that form paths of a tree: query groups with ancestor KV views.

The groups (`AttentionGroups`, harts.ops.attention.query_groups) say which rows each query row sees: causal
within its path, aligned bottom-right over its ancestors.

Backends (all compute the same function, tested against `naive_group_attention`):
- `naive_group_attention`: one dense R x R boolean mask, SDPA (the oracle; O(R^2) memory).
- `sdpa_group_attention`: a loop over groups with gathered KV and a bottom-right mask (CPU path), each
  call batched [1, H, L, E], so SDPA may pick a fused kernel (on the CPU at equal q/v head dims; from
  c4ff385, before which 3-D calls always took its math path).
- `varlen_group_attention`: all groups packed into one `torch.nn.attention.varlen.varlen_attn`
  call with `window_size=(-1, 0)` (causal, bottom-right aligned) over gathered KV (GPU).
- `flex_tree_attention`: FlexAttention (its Triton kernels) over the rows in place with the DFS tree mask (GPU; no
  ancestor KV copies; the block mask from the tile lists, `tree_blocks.tree_block_mask`).
- `cudnn`: cuDNN's fused attention, one dense call per group (two for a group with ancestors,
  merged by log-sum-exp; `harts.ops.attention.split`), bf16/fp16 on CUDA.
- `flash4`: FlashAttention-4's CuTe kernels (the optional `flash-attn-4` package; Hopper and
  Blackwell) through the operator `harts.ops.attention.flash4.flash4_varlen`, the varlen backend's single
  packed call without padding v and without per-shape plans.
- `triton_tree`: Triton kernels over the rows in place with the DFS tree mask, walking precomputed lists of the
  key tiles each query tile sees (harts.ops.attention.tree_triton, .tree_blocks; CUDA; no ancestor KV copies,
  no per-call mask build).
- `flash4_tree`: FlashAttention-4's CuTe kernels over the rows in place with the DFS tree mask as their block
  sparsity and mask_mod, from the same tile lists (harts.ops.attention.flash4_tree; CUDA, the optional
  flash-attn-4 package; no ancestor KV copies).
Legend: R rows, H heads, E query/key head dim, F value head dim.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from harts.config.execution import ATTENTION_BACKENDS, KEEPABLE_ATTENTION_BACKENDS
from harts.ops.attention.query_groups import AttentionGroups, permute_rows


def visibility_mask(groups: AttentionGroups, num_rows: int) -> torch.Tensor:
    """bool [R, R]: mask[r, c] = query row r sees key row c."""
    mask = torch.zeros(num_rows, num_rows, dtype=torch.bool)
    q_ptr, kv_ptr = groups.q_ptr.tolist(), groups.kv_ptr.tolist()
    for g in range(groups.num_groups):
        queries = groups.q_index[q_ptr[g] : q_ptr[g + 1]].cpu()
        keys = groups.kv_index[kv_ptr[g] : kv_ptr[g + 1]].cpu()
        ancestors = len(keys) - len(queries)
        mask[queries.unsqueeze(1), keys.unsqueeze(0)] = _bottom_right(len(queries), len(keys), ancestors)
    return mask


def _bottom_right(num_q: int, num_k: int, ancestors: int, device=None) -> torch.Tensor:
    """bool [l, h + l]: query i sees key j iff j <= h + i."""
    rows = torch.arange(num_q, device=device).unsqueeze(1)
    cols = torch.arange(num_k, device=device).unsqueeze(0)
    return cols <= rows + ancestors


def naive_group_attention(q_RHE, k_RHE, v_RHF, groups: AttentionGroups, scale: float) -> torch.Tensor:
    mask = visibility_mask(groups, q_RHE.shape[0]).to(q_RHE.device)
    out = F.scaled_dot_product_attention(
        *(x.transpose(0, 1).unsqueeze(0) for x in (q_RHE, k_RHE, v_RHF)), attn_mask=mask, scale=scale
    )
    return out.squeeze(0).transpose(0, 1)


def sdpa_group_attention(q_RHE, k_RHE, v_RHF, groups: AttentionGroups, scale: float) -> torch.Tensor:
    out_RHF = q_RHE.new_empty(q_RHE.shape[0], q_RHE.shape[1], v_RHF.shape[2])
    q_ptr, kv_ptr = groups.q_ptr.tolist(), groups.kv_ptr.tolist()
    pieces, rows = [], []
    for g in range(groups.num_groups):
        queries = groups.q_index[q_ptr[g] : q_ptr[g + 1]]
        keys = groups.kv_index[kv_ptr[g] : kv_ptr[g + 1]]
        mask = _bottom_right(len(queries), len(keys), len(keys) - len(queries), q_RHE.device)
        # Batched [1, H, L, E]: SDPA's fused CPU kernel takes only 4-D input (and equal q/v head dims).
        o = F.scaled_dot_product_attention(
            *(x.transpose(0, 1).unsqueeze(0) for x in (q_RHE[queries], k_RHE[keys], v_RHF[keys])),
            attn_mask=mask, scale=scale,
        )
        pieces.append(o.squeeze(0).transpose(0, 1))
        rows.append(queries)
    out_RHF = out_RHF.index_copy(0, torch.cat(rows), torch.cat(pieces))
    return out_RHF


def _packed_attention(q_RHE, k_RHE, v_RHF, groups: AttentionGroups, attend) -> torch.Tensor:
    """All groups in one packed varlen call: the queries in group order, each group's keys (ancestors, then
    its own rows) gathered, `attend(q, k, v, cu_seqlens_q, cu_seqlens_k)` the kernel (int32 offsets; causal
    aligned bottom-right, so a group's queries see all of its ancestors), the output back in row order."""
    if not groups.q_in_order:
        inverse = groups.query_inverse()
        q_RHE = permute_rows(q_RHE, groups.q_index, inverse)
    k, v = (k_RHE, v_RHF) if groups.kv_in_order else (k_RHE[groups.kv_index], v_RHF[groups.kv_index])
    out = attend(q_RHE, k, v, groups.q_ptr.to(torch.int32), groups.kv_ptr.to(torch.int32))
    if not groups.q_in_order:
        out = permute_rows(out, inverse, groups.q_index)
    return out


def varlen_group_attention(q_RHE, k_RHE, v_RHF, groups: AttentionGroups, scale: float) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    value_dim = v_RHF.shape[-1]
    if value_dim != q_RHE.shape[-1]:
        # Flash attention wants one head dim for q, k and v: pad v, slice the output.
        v_RHF = F.pad(v_RHF, (0, q_RHE.shape[-1] - value_dim))
    out = _packed_attention(
        q_RHE, k_RHE, v_RHF, groups,
        lambda q, k, v, cu_q, cu_k: varlen_attn(q, k, v, cu_q, cu_k, groups.max_q, groups.max_k, scale=scale,
                                                window_size=(-1, 0)),
    )
    return out[..., :value_dim]


_FLASH4_FAILURES: dict[tuple, str | None] = {}
FLASH4_VERSION = "flash-attn-4 4.0.0b36"
"""The FA4 release whose module functions `harts.ops.attention.flash4` calls (and .ci/fa4-site packs)."""


def _flash4_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"flash-attn-4 {version('flash-attn-4')}"
    except PackageNotFoundError:
        return "flash-attn-4 of unknown version"


def _flash4_failure(num_heads: int, qk_dim: int, v_dim: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why FlashAttention-4 cannot run this attention here (None: it can), from a tiny causal varlen forward
    and backward, once per process and shape: FA4 compiles its kernels per head dims, dtype and mask, not per
    length or head count (read in flash-attn-4 4.0.0b36's compile keys), so the probe builds the kernels the
    real calls then use. FA4 refuses input it does not support by assertions, and its CuTe compiler fails
    with its own multi-line exceptions (v head dim 32 on Hopper, for one): any failure of the probe means
    these shapes do not run on this GPU. The probe runs on a thread of its own: the caller's autograd state is
    thread-local (no_grad, inference mode, autocast, and the saved-tensor hooks of an activation checkpoint,
    whose recomputation the probe's backward would otherwise enter and stop). Its backward runs on that
    thread too, not on the device's autograd worker, which may be the caller blocked in `join` (a first
    call from inside a backward)."""
    key = (num_heads, qk_dim, v_dim, dtype, device.index, torch.are_deterministic_algorithms_enabled())
    if key not in _FLASH4_FAILURES:
        outcome: list[str | None] = []

        def probe() -> None:
            try:
                from harts.ops.attention.flash4 import flash4_varlen

                if device.type == "cuda":
                    torch.cuda.set_device(device)
                with torch.autograd.set_multithreading_enabled(False):
                    q, k, v = (torch.ones(32, num_heads, dim, device=device, dtype=dtype, requires_grad=True)
                               for dim in (qk_dim, qk_dim, v_dim))
                    bounds = torch.tensor([0, 16, 32], dtype=torch.int32, device=device)
                    out, _ = flash4_varlen(q, k, v, bounds, bounds, 16, 16, qk_dim ** -0.5, key[-1])
                    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                outcome.append(None)
            except BaseException as error:  # noqa: BLE001 (assertions, CuTe DSL and MLIR errors alike; see above)
                outcome.append(" ".join(str(error).split())[:300] or type(error).__name__)

        thread = threading.Thread(target=probe, name="harts-flash4-probe")
        thread.start()
        thread.join()
        _FLASH4_FAILURES[key] = outcome[0]
    return _FLASH4_FAILURES[key]


def flash4_group_attention(q_RHE, k_RHE, v_RHF, groups: AttentionGroups, scale: float) -> torch.Tensor:
    dtypes = {q_RHE.dtype, k_RHE.dtype, v_RHF.dtype}
    if q_RHE.device.type != "cuda" or len(dtypes) > 1 or q_RHE.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"attention backend 'flash4' needs q, k and v in one of bf16 or fp16 on CUDA "
                         f"(got {', '.join(sorted(str(d) for d in dtypes))} on {q_RHE.device.type})")
    try:
        from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd  # noqa: F401 (flash4_varlen's kernels)
    except ImportError as error:
        raise ValueError(
            "attention backend 'flash4' needs the optional flash-attn-4 package (FlashAttention-4's CuTe kernels, "
            f"Hopper or Blackwell GPUs): pip install 'flash-attn-4[cu13]', or flash-attn-4 with a CUDA 12 torch "
            f"({error})"
        ) from None
    num_heads, qk_dim, v_dim = q_RHE.shape[1], q_RHE.shape[2], v_RHF.shape[2]
    failure = _flash4_failure(num_heads, qk_dim, v_dim, q_RHE.dtype, q_RHE.device)
    if failure is not None:
        capability = "".join(map(str, torch.cuda.get_device_capability(q_RHE.device)))
        raise ValueError(f"attention backend 'flash4': FlashAttention-4 ({_flash4_version()}; harts calls the kernels "
                         f"of {FLASH4_VERSION}) does not run {num_heads} heads of head dims {qk_dim}/{v_dim} in "
                         f"{q_RHE.dtype} on sm_{capability}: {failure}")
    from harts.ops.attention.flash4 import flash4_attention

    deterministic = torch.are_deterministic_algorithms_enabled()
    # FA's causal mask is aligned bottom-right when a group has more keys than queries: the ancestors.
    return _packed_attention(
        q_RHE, k_RHE, v_RHF, groups,
        lambda q, k, v, cu_q, cu_k: flash4_attention(q, k, v, cu_q, cu_k, groups.max_q, groups.max_k, scale,
                                                     deterministic),
    )


_compiled_flex = None


def flex_tree_attention(q_RHE, k_RHE, v_RHF, groups: AttentionGroups, scale: float) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    from harts.ops.attention.tree_blocks import tree_block_mask

    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    block_mask = tree_block_mask(groups, 128, 128, q_RHE.device)
    # The rows as one sequence of a batch of one, heads first.
    out = _compiled_flex(q_RHE.transpose(0, 1).unsqueeze(0), k_RHE.transpose(0, 1).unsqueeze(0),
                         v_RHF.transpose(0, 1).unsqueeze(0), block_mask=block_mask, scale=scale)
    return out.squeeze(0).transpose(0, 1)


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _check_cuda_inputs(backend: str, runs: str, dtypes: tuple[torch.dtype, ...], q_RHE, k_RHE, v_RHF) -> None:
    """ValueError unless q, k and v are on CUDA in one dtype of `dtypes` (`runs`: what the backend runs)."""
    given = {q_RHE.dtype, k_RHE.dtype, v_RHF.dtype}
    if q_RHE.device.type != "cuda" or len(given) > 1 or q_RHE.dtype not in dtypes:
        names = [_DTYPE_NAMES[d] for d in dtypes]
        raise ValueError(f"attention backend '{backend}' runs {runs} on CUDA over q, k and v of one dtype of "
                         f"{', '.join(names[:-1])} or {names[-1]} (got {', '.join(sorted(str(d) for d in given))} on "
                         f"{q_RHE.device.type}); on the CPU use sdpa")


def flash4_tree_blocks(qk_dim: int, v_dim: int, device: torch.device) -> tuple[int, int]:
    """The tiles of `flash4_tree`'s block mask: query tiles of 128 rows, key tiles as wide as FlashAttention-4's
    backward key tile on Hopper (its block sparsity takes no other width: 96 at MLA's head dims 192/128), else 128
    (Blackwell's tiles; not yet run there)."""
    if torch.cuda.get_device_capability(device)[0] == 9:
        from flash_attn.cute.interface import _tile_size_bwd_sm90

        return 128, _tile_size_bwd_sm90(qk_dim, v_dim, False, False, sparse_block_size_q=128).n_block_size
    return 128, 128


def flash4_tree_group_attention(q_RHE, k_RHE, v_RHF, groups: AttentionGroups, scale: float) -> torch.Tensor:
    """The `flash4_tree` backend: FlashAttention-4's kernels called with the tree mask as their block sparsity and
    mask_mod (harts.ops.attention.flash4_tree), with the groups' tiles (`flash4_tree_blocks`, once per layout)."""
    _check_cuda_inputs("flash4_tree", "FlashAttention-4's kernels", (torch.bfloat16, torch.float16), q_RHE, k_RHE,
                       v_RHF)
    try:
        from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd  # noqa: F401 (flash4_tree's kernels)
    except ImportError as error:
        raise ValueError(f"attention backend 'flash4_tree' needs the optional flash-attn-4 package: {error}") from None
    from harts.ops.attention.flash4_tree import flash4_tree_attention, flash4_tree_plan

    blocks = flash4_tree_blocks(q_RHE.shape[-1], v_RHF.shape[-1], q_RHE.device)
    return flash4_tree_attention(q_RHE, k_RHE, v_RHF, flash4_tree_plan(groups, *blocks, q_RHE.device), scale)


def triton_tree_group_attention(q_RHE, k_RHE, v_RHF, groups: AttentionGroups, scale: float,
                                tiles: tuple[int, int] | None = None) -> torch.Tensor:
    """The `triton_tree` backend (harts.ops.attention.tree_triton); `tiles` (query rows, key rows) other than its
    own (`tile_rows`), for benchmarks."""
    _check_cuda_inputs("triton_tree", "Triton kernels", (torch.bfloat16, torch.float16, torch.float32), q_RHE,
                       k_RHE, v_RHF)
    try:
        from harts.ops.attention.tree_triton import triton_tree_attention
    except ImportError as error:
        raise ValueError(f"attention backend 'triton_tree' needs Triton (installed with torch's CUDA wheels): "
                         f"{error}") from None
    return triton_tree_attention(q_RHE, k_RHE, v_RHF, groups, scale, tiles)


def cudnn_group_attention(q_RHE, k_RHE, v_RHF, groups: AttentionGroups, scale: float) -> torch.Tensor:
    from harts.ops.attention.split import cudnn_group_attention

    return cudnn_group_attention(q_RHE, k_RHE, v_RHF, groups, scale)


BACKENDS = {
    "naive": naive_group_attention,
    "sdpa": sdpa_group_attention,
    "varlen": varlen_group_attention,
    "flex": flex_tree_attention,
    "cudnn": cudnn_group_attention,
    "flash4": flash4_group_attention,
    "triton_tree": triton_tree_group_attention,
    "flash4_tree": flash4_tree_group_attention,
}


assert tuple(BACKENDS) == ATTENTION_BACKENDS
KEEPABLE_BACKENDS = KEEPABLE_ATTENTION_BACKENDS
"""The backends whose kernels are dispatcher ops (`attention_kernel_ops`) with about the attention's output and
log-sum-exp as outputs: an activation recomputation can keep those instead of running the kernels again
(`HybridModel.run_blocks(keep_attention=True)`; varlen's output has v padded to the q/k head dim). Not cudnn: its
pieces' outputs are padded to bucketed shapes and chunked over ancestors, several times the attention's output,
and its backward reads only the merged one. Not flex: a compiled higher-order op, not seen by the policy. flash4,
triton_tree and flash4_tree keep their outputs through their own keeper instead of the policy
(harts.ops.attention.keep)."""


def attention_kernel_ops() -> frozenset:
    """The dispatcher ops that compute the attention of `KEEPABLE_BACKENDS`: torch's SDPA kernels (those SDPA
    dispatches sdpa's and naive's calls to, cuDNN's among them on CUDA), torch's varlen operator and
    FlashAttention-4's (`flash4_varlen`). The math fallback of SDPA (an attention mask that no fused kernel takes)
    is a composite of small ops and not among them: its recomputation stays."""
    import torch.nn.attention.varlen  # noqa: F401 (registers torch_attn::_varlen_attn)

    import harts.ops.attention.flash4  # noqa: F401 (registers harts::flash4_varlen)

    aten = torch.ops.aten
    return frozenset({
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        torch.ops.torch_attn._varlen_attn.default,
        torch.ops.harts.flash4_varlen.default,
    })


def group_attention(q_RHE, k_RHE, v_RHF, groups: AttentionGroups, scale: float, backend: str) -> torch.Tensor:
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r} (choose from {', '.join(BACKENDS)})")
    return BACKENDS[backend](q_RHE, k_RHE, v_RHF, groups, scale)
