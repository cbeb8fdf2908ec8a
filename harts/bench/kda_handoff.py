"""`harts bench kda-handoff`: cost and correctness of KDA boundary-state hand-off on the GPU.

The compact KDA operator needs, inside one packed call, the fp32 states at interior chunk
boundaries where side branches fork off, with gradients flowing back into that call. Three ways
to run one call over the same rows are timed (forward + backward, bf16, CUDA events, median):

- `unsplit`: fla's `chunk_kda` over the packed sequences, no interior states (the lower bound);
- `ours`: `chunk_kda_fla` returning M interior boundary states (our state kernels write them in
  the forward and inject their gradients in the backward: still one call);
- `split`: each sequence cut at its boundaries and run with fla's `chunk_kda` as one call per
  piece index, each piece starting from the previous piece's final state (the alternative that
  needs no new kernel but adds calls; skipped beyond `--max-split-calls`).

Before timing, a correctness check compares `chunk_kda_fla` (bf16) with the fp32 PyTorch
reference (`chunk_kda_torch`) on outputs, final and boundary states and every gradient, and
`compact_kda(backend="fla")` on a small tree with per-trajectory execution; timing is refused
(an `error` record) when a check fails. With `--trees`, one microbatch of a synthetic step is also
timed end to end (of HARTS's plan of the step's first tree, the one of most KDA calls): `compact_kda`
over its C compact rows (its calls as one linked launch, and one after another) against fla's
`chunk_kda` over its S semantic rows (the per-trajectory baseline).
Writes one JSON record per case and prints a table; the records are rewritten after every case,
so a run cut short keeps what it measured (SIGTERM adds an error row naming the case it stopped,
or after how many records it came).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from pathlib import Path

from harts.args import non_negative_int, positive_int, records_file

logger = logging.getLogger(__name__)

# ‖a − e‖/‖e‖ allowed for bf16 fla kernels against the fp32 reference, here and in tests/ops/kda (fla's
# own tests allow 0.005-0.02 in fp16; bf16 keeps 3 fewer mantissa bits).
BF16_TOLERANCE = {"o": 0.01, "final": 0.01, "states": 0.01, "dq": 0.015, "dk": 0.02, "dv": 0.02,
                  "dg": 0.04, "dbeta": 0.04, "dh0": 0.015}


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("kda-handoff", help="GPU: boundary-state hand-off cost and correctness of the KDA op")
    parser.add_argument("--rows", type=positive_int, default=65536, help="packed rows of one call")
    parser.add_argument("--heads", type=positive_int, default=16)
    parser.add_argument("--dim", type=positive_int, default=128, help="K = V")
    parser.add_argument("--chunk", type=positive_int, default=64, choices=(32, 64))
    parser.add_argument("--sequences", default="1,8,64", help="packed sequences per call (comma list)")
    parser.add_argument("--boundaries", default="0,8,64,512", help="interior boundary states per call (comma list)")
    parser.add_argument("--repeats", type=positive_int, default=10)
    parser.add_argument("--warmup", type=non_negative_int, default=3)
    parser.add_argument("--max-split-calls", type=positive_int, default=65)
    parser.add_argument("--trees", help="trees config NAME or YAML path: also time the microbatch of most KDA calls "
                                        "in HARTS's plan of the first tree of its step 0")
    parser.add_argument("--tasks", type=positive_int,
                        help="tasks of the generated step (with --trees; default: the config's own, whose compression "
                             "it is calibrated to)")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--device", default="cuda", help="a CUDA device (cuda, cuda:N)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--out", type=records_file, default="reports/raw/kda/handoff.json")
    parser.set_defaults(run=run, files=lambda a: ([a.out], [a.trees]))


def _dtype(args):
    import torch

    return getattr(torch, args.dtype)


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise ValueError(f"expected a comma-separated list of integers, got {text!r}") from None


def random_kda_leaves(num_rows, num_seqs, heads, dim, seed, device, dtype):
    """Seeded KDA inputs [1, rows, heads, dim]: q, k (L2-normalised) and v in `dtype`, the log-space
    gate g and β in fp32 (as the model's KDA layer makes them: other dtypes would make Triton compile
    and autotune every fla kernel again), initial states [num_seqs, heads, dim, dim] in fp32, all
    requiring grad."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, num_rows, heads, dim, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(1, num_rows, heads, dim, generator=gen), dim=-1)
    v = torch.randn(1, num_rows, heads, dim, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(1, num_rows, heads, dim, generator=gen))
    beta = torch.rand(1, num_rows, heads, generator=gen)
    h0 = torch.randn(num_seqs, heads, dim, dim, generator=gen)
    low = [x.to(device, dtype) for x in (q, k, v)] + [g.to(device), beta.to(device), h0.to(device)]
    return [x.requires_grad_() for x in low]


def cuda_timed(fn, warmup: int, repeats: int, device: str) -> dict:
    """Time of `fn` in ms (CUDA events), median over `repeats` after `warmup` runs, and its peak extra memory."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end))
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "times_ms": times,
            "peak_extra_mib": (torch.cuda.max_memory_allocated(device) - base) / 2**20}


def _relative(actual, expected) -> float:
    diff = (actual.double() - expected.double()).norm().item()
    norm = expected.double().norm().item()
    return diff / norm if norm else diff


def _boundary_requests(lengths, count, chunk, rng):
    """`count` distinct interior chunk-multiple offsets spread over the sequences (CSR)."""
    import numpy as np

    candidates = [(i, o) for i, length in enumerate(lengths) for o in range(chunk, length, chunk)]
    picked = sorted(candidates[j] for j in rng.choice(len(candidates), size=min(count, len(candidates)), replace=False))
    offsets = np.array([o for _, o in picked], dtype=np.int64)
    ptr = np.searchsorted(np.array([i for i, _ in picked], dtype=np.int64), np.arange(len(lengths) + 1))
    return offsets, ptr.astype(np.int64)


def _split_call(leaves, lengths, offsets, ptr, chunk):
    """fla's chunk_kda over pieces cut at the boundaries, one call per piece index: (o, final, states)."""
    import numpy as np
    import torch
    from fla.ops.kda import chunk_kda

    q, k, v, g, beta, h0 = leaves
    starts = np.concatenate([[0], np.cumsum(lengths)])
    cuts = [[0, *offsets[ptr[i] : ptr[i + 1]].tolist(), int(lengths[i])] for i in range(len(lengths))]
    states = [h0[i] for i in range(len(lengths))]
    pieces_o = {}
    boundary = {}
    for piece in range(max(len(c) for c in cuts) - 1):
        seqs = [i for i, c in enumerate(cuts) if len(c) > piece + 1]
        rows = np.concatenate([np.arange(starts[i] + cuts[i][piece], starts[i] + cuts[i][piece + 1]) for i in seqs])
        index = torch.from_numpy(rows).to(q.device)
        cu = torch.from_numpy(np.concatenate([[0], np.cumsum([cuts[i][piece + 1] - cuts[i][piece] for i in seqs])]))
        cu = cu.to(q.device)
        o, final = chunk_kda(*[x.index_select(1, index) for x in (q, k, v, g, beta)],
                             initial_state=torch.stack([states[i] for i in seqs]), output_final_state=True,
                             cu_seqlens=cu, chunk_size=chunk)
        pieces_o[piece] = (index, o)
        for j, i in enumerate(seqs):
            states[i] = final[j]
            if piece + 1 < len(cuts[i]) - 1:
                boundary[(i, cuts[i][piece + 1])] = final[j]
    order = torch.argsort(torch.cat([index for index, _ in pieces_o.values()]))
    o = torch.cat([o[0] for _, o in pieces_o.values()]).index_select(0, order)[None]
    requested = [boundary[(i, int(o_))] for i in range(len(lengths)) for o_ in offsets[ptr[i] : ptr[i + 1]]]
    empty = h0.new_zeros(0, *h0.shape[1:])
    return o, torch.stack(states), torch.stack(requested) if requested else empty


def _check(args) -> dict:
    """Errors of the fla path (bf16) against the fp32 reference, for a packed call and a tree."""
    import numpy as np
    import torch

    from harts.ops.kda.chunk import chunk_kda_torch
    from harts.ops.kda.compact import compact_kda
    from harts.ops.kda.fla_chunk import chunk_kda_fla
    from harts.planning.kda_calls import plan_kda_calls

    lengths = np.array([1000, 64, 2500, 77, 33, 2048])
    # The timed cases' head count: fla's kernels specialise on it (another count compiles them all again).
    heads = args.heads
    leaves = random_kda_leaves(int(lengths.sum()), len(lengths), heads, args.dim, args.seed, args.device, _dtype(args))
    reference = [x.detach().float().requires_grad_() for x in leaves]
    rng = np.random.default_rng(args.seed)
    offsets, ptr = [], [0]
    for length in lengths:
        offsets += sorted({int(length), *range(args.chunk, int(length), args.chunk), int(rng.integers(0, length + 1))})
        ptr.append(len(offsets))
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)])).to(args.device)
    kwargs = dict(cu_seqlens=cu, chunk_size=args.chunk, state_offsets=np.array(offsets), state_ptr=np.array(ptr))
    outputs = {}
    for name, run, inputs in (("fla", chunk_kda_fla, leaves), ("ref", chunk_kda_torch, reference)):
        o, final, states = run(*inputs[:5], initial_state=inputs[5], output_final_state=True, **kwargs)
        gen = torch.Generator(device=args.device).manual_seed(0)
        loss = sum((x.float() * torch.randn(x.shape, generator=gen, device=args.device)).sum()
                   for x in (o, final, states))
        outputs[name] = [o, final, states, *torch.autograd.grad(loss, inputs)]
    names = ["o", "final", "states", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
    packed = {n: _relative(a, e) for n, a, e in zip(names, outputs["fla"], outputs["ref"])}

    from harts.trees.step import TOKEN_DTYPE, Step
    from harts.trees.trie import PrefixIndex

    # Root 3000 rows; children 700 (two leaves 900, 333), 1500 (leaf 2048), 64: forks on and off chunk multiples.
    spans = [[(1, 3000), (2, 700), (5, 900)], [(1, 3000), (2, 700), (6, 333)], [(1, 3000), (3, 1500), (7, 2048)],
             [(1, 3000), (4, 64)]]
    paths = [np.concatenate([np.full(n, token) for token, n in spans_]) for spans_ in spans]
    tokens = np.concatenate(paths).astype(TOKEN_DTYPE)
    step_offsets = np.concatenate([[0], np.cumsum([len(p) for p in paths])]).astype(np.int64)
    loss_mask = np.ones(len(tokens), dtype=np.uint8)
    loss_mask[step_offsets[:-1]] = 0
    step = Step(ids=tuple(f"t{i}" for i in range(len(paths))), trees=("t",) * len(paths), offsets=step_offsets,
                tokens=tokens, loss_mask=loss_mask, rewards=np.zeros(len(paths), dtype=np.float32),
                advantage_per_trajectory=np.zeros(len(paths), dtype=np.float32))
    tree = PrefixIndex.from_step(step).segment_tree()
    low = random_kda_leaves(tree.num_compact_tokens, 1, heads, args.dim, args.seed, args.device, _dtype(args))
    compact = [x.detach()[0].requires_grad_() for x in low[:5]]
    fp32 = [x.detach().float().requires_grad_() for x in compact]
    index = torch.from_numpy(tree.compact_map()).to(args.device)
    gen = torch.Generator(device=args.device).manual_seed(1)
    weight = torch.randn(len(index), heads, args.dim, generator=gen, device=args.device)
    o = compact_kda(*compact, plan_kda_calls(tree, args.chunk), backend="fla").index_select(0, index)
    grads = torch.autograd.grad((o.float() * weight).sum(), compact)
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(tree.member_lengths)])).to(args.device)
    semantic = [x.index_select(0, index)[None] for x in fp32]
    expected = chunk_kda_torch(*semantic, cu_seqlens=cu, chunk_size=args.chunk)[0][0]
    grads_expected = torch.autograd.grad((expected * weight).sum(), fp32)
    tree_errors = {n: _relative(a, e) for n, a, e in zip(["o", "dq", "dk", "dv", "dg", "dbeta"], [o, *grads],
                                                           [expected, *grads_expected])}
    ok = all(v < BF16_TOLERANCE[n] for errors in (packed, tree_errors) for n, v in errors.items())
    return {"ok": ok, "packed_call": packed, "compact_tree": tree_errors, "tolerance": BF16_TOLERANCE}


def _handoff_case(args, num_seqs: int, num_boundaries: int) -> dict:
    import numpy as np
    import torch
    from fla.ops.kda import chunk_kda

    from harts.ops.kda.fla_chunk import chunk_kda_fla

    lengths = np.full(num_seqs, args.rows // num_seqs, dtype=np.int64)
    lengths[: args.rows % num_seqs] += 1
    leaves = random_kda_leaves(int(lengths.sum()), num_seqs, args.heads, args.dim, args.seed, args.device, _dtype(args))
    offsets, ptr = _boundary_requests(lengths, num_boundaries, args.chunk, np.random.default_rng(args.seed))
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)])).to(args.device)
    q, k, v, g, beta, h0 = leaves
    gen = torch.Generator(device=args.device).manual_seed(0)
    w_o = torch.randn(q.shape[:3] + (args.dim,), generator=gen, device=args.device, dtype=_dtype(args))
    w_final = torch.randn(h0.shape, generator=gen, device=args.device)
    w_states = torch.randn((len(offsets),) + h0.shape[1:], generator=gen, device=args.device)

    def backward(o, final, states=None):
        loss = (o * w_o).float().sum() + (final * w_final).sum()
        if states is not None and len(states):
            loss = loss + (states * w_states).sum()
        torch.autograd.grad(loss, leaves)

    def unsplit():
        backward(*chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                            chunk_size=args.chunk))

    def ours():
        backward(*chunk_kda_fla(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                chunk_size=args.chunk, state_offsets=offsets, state_ptr=ptr))

    def split():
        backward(*_split_call(leaves, lengths, offsets, ptr, args.chunk))

    split_calls = int(np.diff(ptr).max()) + 1 if len(offsets) else 1
    results = {"boundary_states": len(offsets), "split_calls": split_calls,
               "unsplit": cuda_timed(unsplit, args.warmup, args.repeats, args.device),
               "ours": cuda_timed(ours, args.warmup, args.repeats, args.device)}
    if split_calls <= args.max_split_calls:
        results["split"] = cuda_timed(split, args.warmup, args.repeats, args.device)
    with torch.no_grad():
        mine = chunk_kda_fla(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                             chunk_size=args.chunk, state_offsets=offsets, state_ptr=ptr)
        other = _split_call(leaves, lengths, offsets, ptr, args.chunk) if split_calls <= args.max_split_calls else None
    if other is not None:
        results["ours_vs_split"] = {n: _relative(a, e) for n, a, e in zip(["o", "final", "states"], mine, other)
                                    if e.numel()}
    results["ours_over_unsplit"] = results["ours"]["median_ms"] / results["unsplit"]["median_ms"]
    return results


def _tree_case(args, synth) -> dict:
    """The microbatch of most KDA calls in HARTS's plan (capacity --rows) of the first tree of step 0 of the
    synthetic dataset `synth`: the planned microbatches of a `bench speedup --max-trees 1` run."""
    import numpy as np
    import torch
    from fla.ops.kda import chunk_kda

    from harts.ops.kda.compact import compact_kda, prepare_schedule
    from harts.planning.kda_calls import plan_kda_calls
    from harts.planning.microbatch import plan
    from harts.trees.sources import first_trees
    from harts.trees.synth import generate_step
    from harts.trees.trie import PrefixIndex

    step = first_trees(generate_step(synth, args.seed, 0), 1)
    index = PrefixIndex.from_step(step)
    microbatches = [m for m in plan(step, args.rows, 1, index=index).members(step) if len(m)]
    trees = [index.segment_tree(m) for m in microbatches]
    schedules = [plan_kda_calls(tree, args.chunk) for tree in trees]
    chosen = max(range(len(trees)), key=lambda k: (schedules[k].num_calls, -k))
    members, tree, schedule = microbatches[chosen], trees[chosen], schedules[chosen]
    low = random_kda_leaves(tree.num_compact_tokens, 1, args.heads, args.dim, args.seed, args.device, _dtype(args))
    leaves = [x.detach()[0].requires_grad_() for x in low[:5]]
    m = torch.from_numpy(tree.compact_map()).to(args.device)
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(tree.member_lengths)])).to(args.device)
    gen = torch.Generator(device=args.device).manual_seed(0)
    w = torch.randn(len(m), args.heads, args.dim, generator=gen, device=args.device, dtype=_dtype(args))

    linked = prepare_schedule(schedule, args.device, "fla", calls="linked")
    separate = prepare_schedule(schedule, args.device, "fla")

    def compact_run(prepared=linked):
        o = compact_kda(*leaves, prepared)
        torch.autograd.grad((o.index_select(0, m) * w).float().sum(), leaves)

    def baseline_run():
        o = chunk_kda(*[x.index_select(0, m)[None] for x in leaves], cu_seqlens=cu, chunk_size=args.chunk)[0][0]
        torch.autograd.grad((o * w).float().sum(), leaves)

    with torch.no_grad():
        semantic = [x.index_select(0, m)[None] for x in leaves]
        o = compact_kda(*leaves, linked)
        drift = _relative(o.index_select(0, m), chunk_kda(*semantic, cu_seqlens=cu, chunk_size=args.chunk)[0][0])
        separate_drift = _relative(o, compact_kda(*leaves, separate))
    results = {"microbatch": chosen, "num_microbatches": len(trees), "calls_per_microbatch":
               [schedule.num_calls for schedule in schedules], "trajectories": len(members),
               "semantic_rows": tree.num_semantic_tokens,
               "compact_rows": tree.num_compact_tokens, "calls": schedule.num_calls,
               "sequences": schedule.num_sequences, "replay_rows": schedule.replay_tokens,
               "compact": cuda_timed(compact_run, args.warmup, args.repeats, args.device),
               "compact_separate_calls": cuda_timed(lambda: compact_run(separate), args.warmup, args.repeats,
                                                    args.device),
               "per_trajectory": cuda_timed(baseline_run, args.warmup, args.repeats, args.device),
               "output_drift_vs_per_trajectory": drift, "output_drift_linked_vs_separate_calls": separate_drift}
    results["speedup"] = results["per_trajectory"]["median_ms"] / results["compact"]["median_ms"]
    results["linked_over_separate_calls"] = (results["compact"]["median_ms"]
                                             / results["compact_separate_calls"]["median_ms"])
    return results


def run(args: argparse.Namespace) -> int:
    import signal

    import torch

    from harts.tracking.records import Terminated, error_message, make_record, sigterm_raises, write_records

    if not args.device.startswith("cuda") or not torch.cuda.is_available():
        raise ValueError("harts bench kda-handoff times fla's Triton kernels: it needs a CUDA GPU (--device cuda); "
                         "their CPU checks are tests/ops/kda/test_fla_chunk.py, under the Triton interpreter")
    base = {"rows": args.rows, "heads": args.heads, "dim": args.dim, "chunk": args.chunk, "dtype": args.dtype,
            "device": args.device,
            "repeats": args.repeats, "warmup": args.warmup, "seed": args.seed}
    records: list[dict] = []
    # The records are rewritten after every case, so a run cut short (a device slot's timeout) keeps
    # what it measured; SIGTERM adds an error row naming where it stopped.
    current = {"benchmark": "kda-handoff-check", "config": base, "phase": ""}
    with sigterm_raises():
        try:
            code = _measure(args, base, records, current)
        except Terminated as error:
            message = error_message(error)
            records.append(make_record(current["benchmark"], current["config"],
                                       error=f"{current['phase']}: {message}" if current["phase"] else message))
            write_records(records, Path(args.out))
            return 128 + signal.SIGTERM
    print(f"wrote {args.out} ({torch.cuda.get_device_name(args.device)})")
    return code


def _measure(args, base: dict, records: list[dict], current: dict) -> int:
    """The check, then each case and the tree (`run`): records appended and written as they come;
    `current` names what runs (the error row of a SIGTERM)."""
    from tqdm import tqdm

    from harts.config import config_to_dict, load_config, shipped_config_path
    from harts.tracking.records import Terminated, make_record, write_records
    from harts.trees.synth import SynthConfig

    out = Path(args.out)

    def finished(record: dict) -> None:
        records.append(record)
        current.update(benchmark="kda-handoff", config=base, phase=f"after {len(records)} record(s)")
        write_records(records, out)

    logger.info("checking the fla path against the fp32 reference ...")
    check = _check(args)
    finished(make_record("kda-handoff-check", base, check))
    print(f"check {'passed' if check['ok'] else 'FAILED'}: packed call {check['packed_call']}")
    print(f"  compact tree {check['compact_tree']}")
    if not check["ok"]:
        finished(make_record("kda-handoff", base, error="correctness check failed; timings refused"))
        return 1
    cases = [(n, m) for n in _ints(args.sequences) for m in _ints(args.boundaries)]
    header = ("seqs", 5), ("states", 6), ("unsplit ms", 10), ("ours ms", 9), ("ours/unsplit", 12), ("split ms", 9)
    print(" ".join(f"{name:>{width}}" for name, width in header), f"{'calls':>5}")
    for num_seqs, num_boundaries in tqdm(cases, desc="kda-handoff", file=sys.stderr):
        config = base | {"sequences": num_seqs, "boundaries_requested": num_boundaries}
        current.update(benchmark="kda-handoff", config=config, phase="")
        try:
            results = _handoff_case(args, num_seqs, num_boundaries)
        except Terminated:
            raise
        except Exception as error:  # a failed case is a record, not a gap
            finished(make_record("kda-handoff", config, error=f"{type(error).__name__}: {error}"))
            print(f"{num_seqs:>5} {num_boundaries:>6} failed: {error}")
            continue
        finished(make_record("kda-handoff", config, results))
        split = f"{results['split']['median_ms']:9.2f}" if "split" in results else f"{'-':>9}"
        print(f"{num_seqs:>5} {results['boundary_states']:>6} {results['unsplit']['median_ms']:10.2f} "
              f"{results['ours']['median_ms']:9.2f} {results['ours_over_unsplit']:12.3f} {split} "
              f"{results['split_calls']:>5}")
    if args.trees:
        overrides = {"num_tasks": args.tasks} if args.tasks else {}
        synth = load_config(shipped_config_path(args.trees, "trees"), SynthConfig, **overrides)
        config = base | {"trees": args.trees, "synth": config_to_dict(synth), "tasks": synth.num_tasks}
        current.update(benchmark="kda-compact-tree", config=config, phase="")
        results = _tree_case(args, synth)
        finished(make_record("kda-compact-tree", config, results))
        print(f"tree: S = {results['semantic_rows']:,}, C = {results['compact_rows']:,}, {results['calls']} calls: "
              f"compact {results['compact']['median_ms']:.2f} ms (its calls one by one "
              f"{results['compact_separate_calls']['median_ms']:.2f} ms) vs per-trajectory "
              f"{results['per_trajectory']['median_ms']:.2f} ms ({results['speedup']:.2f}x), "
              f"output drift {results['output_drift_vs_per_trajectory']:.2e}")
    return 0
