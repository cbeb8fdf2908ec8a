"""`harts bench attention`: the MLA attention backends on real microbatch layouts.

For a step (generated from a trees config or read), plans the compact microbatches (HARTS) and
the baseline's (per-trajectory packing) at capacity T, builds their layouts, and times forward +
backward of the group attention with each backend (`varlen`: ancestor-KV views through
`varlen_attn`; `flex`: the DFS tree mask over the rows in place; `cudnn`: dense pieces merged by
log-sum-exp; `flash4`: FlashAttention-4's varlen call; `triton_tree`: Triton kernels over the rows in
place, walking each query tile's list of the key tiles it sees; `sdpa`: the CPU loop) on random
bf16 (CUDA) or fp32 inputs of the model's MLA shapes. Each backend is first checked against the
fp64 dense-mask reference, output and gradients, on the tiny synthetic tree (a backend that
disagrees is not timed). One record
per (execution, backend) with median seconds, rows, KV rows and the tree mask's density, and the
first call's seconds: with plan-building kernels (cuDNN builds one per new shape; triton_tree compiles its
kernels once per head dims and dtype and builds its tile lists once per layout) the cost of a step's new shapes.
triton_tree's records also hold its tile lists' size: `tile_pairs` (the (query, key) tiles computed) and
`full_tile_share` (those needing no mask); `triton_tree@BQxBK` times it with other tiles (`tile_rows`,
`key_tile_rows` in the record). `--warm-seed N` first runs every backend on the trees of seed N, so that the
first call measures a new step after another one (shapes seen before are not rebuilt).
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import time
from pathlib import Path

from harts.args import non_negative_int, positive_int, records_file
from harts.tracking import wandb_log

logger = logging.getLogger(__name__)


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("attention", help="time the MLA attention backends on real layouts")
    parser.add_argument("--model", default="h200")
    parser.add_argument("--trees", required=True, help="trees config NAME or YAML path, or a step path")
    parser.add_argument("--step", type=non_negative_int, default=0)
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--warm-seed", type=non_negative_int, default=None,
                        help="first run every backend on the trees of this seed (a step before the measured one)")
    parser.add_argument("--capacity", type=positive_int, default=65536)
    parser.add_argument("--microbatches", type=positive_int, default=2, help="microbatches of each execution to time")
    parser.add_argument("--backends", default="varlen,flex,triton_tree",
                        help="comma-separated (flash4 needs the optional flash-attn-4 package); triton_tree@BQxBK: "
                             "triton_tree with query tiles of BQ rows and key tiles of BK (powers of two >= 16; "
                             "default: its own, tile_rows)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--out", type=records_file, default="reports/raw/attention/backends.json")
    wandb_log.add_arguments(parser)
    parser.set_defaults(run=run, files=lambda a: ([a.out], [a.trees]))


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from harts.model.config import load_model_config
    from harts.tracking.records import error_message, make_record, write_records
    from harts.tracking.wandb_log import log_records, options
    from harts.trees.sources import iter_steps

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_model_config(args.model)
    if model.mla is not None:
        mla = model.mla
        heads, qk_dim, v_dim = mla.num_heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.v_head_dim
    else:
        # Gated GQA attends with its KV heads repeated to every query head (harts.model.gdn).
        heads, qk_dim = model.gated_attention.num_heads, model.gated_attention.head_dim
        v_dim = qk_dim
    backends = [b for b in args.backends.split(",") if b]
    for backend in backends:
        attention_call(backend)  # refuses an unknown name or tile shape before any work
    (_, step, meta), = iter_steps(args.trees, args.seed, [args.step])
    layouts = _layouts(step, args.capacity, args.microbatches)
    warm_layouts = None
    if args.warm_seed is not None:
        (_, warm_step, _), = iter_steps(args.trees, args.warm_seed, [args.step])
        warm_layouts = _layouts(warm_step, args.capacity, args.microbatches)

    generator = torch.Generator(device=device).manual_seed(0)

    def inputs(rows):
        shapes = ((rows, heads, qk_dim), (rows, heads, qk_dim), (rows, heads, v_dim))
        return [torch.randn(*s, generator=generator, device=device).to(dtype).requires_grad_() for s in shapes]

    def forward_backward(layout, backend: str):
        """Forward + backward of the layout's group attention on fresh random inputs, as a call."""
        groups = layout.groups.to(device)
        q, k, v = inputs(layout.num_rows)
        grad = torch.randn_like(v)

        attend = attention_call(backend)

        def once():
            o = attend(q, k, v, groups, scale)
            torch.autograd.grad(o, (q, k, v), grad)

        return once

    def timed(fn) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    records = []
    scale = qk_dim ** -0.5
    for execution, items in layouts.items():
        for backend in backends:
            config = {"model": args.model, **meta, "capacity": args.capacity, "execution": execution,
                      "backend": backend, "dtype": str(dtype), "repeats": args.repeats, "warm_seed": args.warm_seed}
            try:
                error, worst = check_backend(backend, device, dtype, heads, qk_dim, v_dim)
                if not error <= 2e-2:
                    raise RuntimeError(f"{backend} disagrees with the dense reference: relative error {error:.3g} "
                                       f"in {worst}")
                for layout in warm_layouts[execution] if warm_layouts else []:
                    forward_backward(layout, backend)()
                times, first, kv_rows, rows, density = [], [], 0, 0, []
                for layout in items:
                    once = forward_backward(layout, backend)
                    first.append(timed(once))
                    times.append(statistics.median(timed(once) for _ in range(args.repeats)))
                    kv_rows += layout.groups.num_kv_rows
                    rows += layout.num_rows
                    ends = layout.groups.row_subtree_end.numpy()
                    pairs = int((ends - np.arange(layout.num_rows)).sum())
                    density.append(pairs / layout.num_rows ** 2)
                results = {"check_relative_error": error, "seconds": sum(times), "per_microbatch_seconds": times,
                           "first_call_seconds": sum(first), "per_microbatch_first_call_seconds": first,
                           "rows": rows, "kv_rows": kv_rows, "tree_mask_density": float(np.mean(density))}
                if backend.startswith("triton_tree"):
                    from harts.ops.attention.tree_triton import tile_rows

                    tiles = tree_tiles(backend) or (tile_rows(dtype, qk_dim, v_dim),) * 2
                    results.update(_tile_counts(items, tiles))
                records.append(make_record("attention", config, results))
                logger.info(f"{execution:8} {backend:7} {sum(times) * 1e3:9.1f} ms "
                            f"(first call {sum(first) * 1e3:.1f} ms)  rows {rows:,}  kv rows {kv_rows:,}")
            except (RuntimeError, ValueError, torch.OutOfMemoryError) as error:
                message = error_message(error)
                records.append(make_record("attention", config, error=message))
                logger.info(f"{execution:8} {backend:7} failed: {message}")
            write_records(records, Path(args.out))
    log_records(records, options(args))
    return 0 if all("error" not in r for r in records) else 1


def tree_tiles(backend: str) -> tuple[int, int] | None:
    """(query rows, key rows) of a `triton_tree@BQxBK` backend name; None for another name; ValueError for a bad
    shape."""
    name, _, tiles = backend.partition("@")
    if name != "triton_tree" or not tiles:
        return None
    parts = tiles.split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) >= 16 and int(p) & (int(p) - 1) == 0 for p in parts):
        raise ValueError(f"--backends: {backend!r}: tiles are BQxBK, powers of two >= 16 (e.g. triton_tree@64x64)")
    return int(parts[0]), int(parts[1])


def attention_call(backend: str):
    """The group attention of a `--backends` name as f(q, k, v, groups, scale): a backend of
    harts.ops.attention.groups, or triton_tree over tiles of another shape (`tree_tiles`)."""
    from harts.ops.attention import groups as attention

    tiles = tree_tiles(backend)
    if tiles is not None:
        return lambda q, k, v, groups, scale: attention.triton_tree_group_attention(q, k, v, groups, scale, tiles)
    if backend not in attention.BACKENDS:
        raise ValueError(f"--backends: unknown attention backend {backend!r} (choose from "
                         f"{', '.join(attention.BACKENDS)}, or triton_tree@BQxBK)")
    return lambda q, k, v, groups, scale: attention.group_attention(q, k, v, groups, scale, backend)


def _tile_counts(layouts, tiles: tuple[int, int]) -> dict:
    """triton_tree's tiles over the layouts: the (query, key) tile pairs its kernels compute and the share of them
    that needs no mask."""
    from harts.ops.attention.tree_blocks import tile_lists

    lists = [tile_lists(layout.groups.row_subtree_end.numpy(), *tiles) for layout in layouts]
    pairs = sum(x.num_pairs for x in lists)
    return {"tile_rows": tiles[0], "key_tile_rows": tiles[1], "tile_pairs": pairs,
            "full_tile_share": sum(x.num_full for x in lists) / pairs}


def _layouts(step, capacity: int, num_microbatches: int) -> dict:
    """The first microbatches' layouts of each execution (HARTS plan for compact, per-trajectory packing)."""
    from harts.planning.microbatch import plan
    from harts.runtime.layout import baseline_layout, compact_layout
    from harts.trees.trie import PrefixIndex

    index = PrefixIndex.from_step(step)
    layouts = {}
    for execution, planner in (("baseline", "per-trajectory"), ("compact", "harts")):
        members = [m for m in plan(step, capacity, 1, planner=planner, index=index).members(step) if len(m)]
        members = members[:num_microbatches]
        build = (lambda m: compact_layout(step, index, m, conv_size=4, chunk_size=64)) if execution == "compact" \
            else (lambda m: baseline_layout(step, m, conv_size=4, chunk_size=64))
        layouts[execution] = [build(m) for m in members]
    return layouts


def check_backend(backend: str, device, dtype, heads: int, qk_dim: int, v_dim: int) -> tuple[float, str]:
    """Largest relative error of `backend`'s output and q, k, v gradients against the fp64 dense-mask
    reference on the tiny synthetic tree (inf where a result is not finite), and which of the four it is."""
    import numpy as np
    import torch

    from harts.config import load_config, shipped_config_path
    from harts.ops.attention.groups import naive_group_attention
    from harts.runtime.layout import compact_layout
    from harts.trees.synth import SynthConfig, generate_step
    from harts.trees.trie import PrefixIndex

    step = generate_step(load_config(shipped_config_path("tiny", "trees"), SynthConfig), 0, 0)
    layout = compact_layout(step, PrefixIndex.from_step(step), np.arange(step.num_trajectories), conv_size=4, chunk_size=64)
    groups = layout.groups.to(device)
    generator = torch.Generator(device=device).manual_seed(1)
    q, k = (torch.randn(layout.num_rows, heads, qk_dim, generator=generator, device=device) for _ in range(2))
    v = torch.randn(layout.num_rows, heads, v_dim, generator=generator, device=device)
    grad = torch.randn(layout.num_rows, heads, v_dim, generator=generator, device=device).to(dtype)
    inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = attention_call(backend)(*inputs, groups, qk_dim ** -0.5)
    got = (out, *torch.autograd.grad(out, inputs, grad))
    # The reference starts from the same rounded inputs: only the backend's own error is measured.
    reference = [t.detach().double().requires_grad_() for t in inputs]
    want = naive_group_attention(*reference, groups, qk_dim ** -0.5)
    want = (want, *torch.autograd.grad(want, reference, grad.double()))
    errors = {}
    for name, a, b in zip(("output", "dq", "dk", "dv"), got, want):
        error = float((a.detach().double() - b.detach()).norm() / b.detach().norm())
        errors[name] = error if math.isfinite(error) else math.inf
    return max(errors.values()), max(errors, key=errors.get)
