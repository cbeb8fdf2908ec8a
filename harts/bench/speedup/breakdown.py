"""The op-level breakdown of the compact time beyond the ideal (C / S) × baseline (`breakdown`): op times
(`op_times`: KDA as planned, as one call with and without the replay rows, MLA, the LM head — for a Gated
DeltaNet model its GDN and gated GQA under the same keys ("kda", "mla"); forward + backward
on real microbatch layouts with random inputs of the model's shapes) on up to `BREAKDOWN_MICROBATCHES` evenly
spaced microbatches of each execution (their layouts from `harts.engine.Engine.layout`), each op scaled to the step
by its own work (`OP_WORK`), then split into terms (`breakdown_terms`: replay, boundary handoff and call launches,
other KDA, ancestor KV, LM head, the remaining per-row work) that sum to the excess. Single-process only: under
`--parallel` the measured F + B also holds communication. Tested in tests/bench/speedup/test_breakdown.py (the
terms from known op times, the sample scaled to the whole step, the one-call rows).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from harts.bench.speedup.executions import EXECUTIONS
from harts.engine_memory import sync

BREAKDOWN_MICROBATCHES = 4


def _time_op(fn, device, repeats: int = 2) -> float:
    """Median seconds of fn() (forward + backward of one op)."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def op_times(model, layout, device, dtype, grad_precision: str = "fp32") -> dict[str, float]:
    """Per-microbatch op times (fwd + bwd) on `layout` with random inputs of the model's shapes (the LM head
    with the step's `grad_precision`)."""
    import numpy as np
    import torch

    from harts.objective.logprobs import compact_logprobs
    from harts.ops.gdn.packed import packed_gdn
    from harts.ops.kda.packed import packed_kda

    config = model.config
    rows = layout.num_rows
    generator = torch.Generator(device=device).manual_seed(0)
    act_dtype = dtype or torch.float32

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator, device=device) * scale).to(act_dtype).requires_grad_()

    # KDA (or GDN) runs on the layout's KDA rows (the compact execution's calls' rows, replay rows included).
    kda_rows = layout.num_kda_rows
    if config.kda is not None:
        heads = value_heads = config.kda.num_heads
        key_dim = value_dim = config.kda.head_dim
        gate_shape, mix, packed = (kda_rows, heads, key_dim), layout.linear_attention, packed_kda
        kernel = {}
    else:
        gdn = config.gdn
        heads, value_heads, key_dim, value_dim = (gdn.num_key_heads, gdn.num_value_heads, gdn.key_head_dim,
                                                  gdn.value_head_dim)
        gate_shape, mix, packed = (kda_rows, value_heads), layout.gated_delta_rule, packed_gdn
        kernel = {"kernel": layout.gdn_kernel}  # the one call on the baseline's kernel
    q, k = (rand(kda_rows, heads, key_dim) for _ in range(2))
    v = rand(kda_rows, value_heads, value_dim)
    g = (-torch.rand(*gate_shape, generator=generator, device=device) * 0.1).requires_grad_()
    beta = torch.rand(kda_rows, value_heads, generator=generator, device=device).requires_grad_()

    def backward(out):
        out.float().square().mean().backward()

    times = {"kda": _time_op(lambda: backward(mix(q, k, v, g, beta)), device)}
    schedule = layout.kda_schedule
    if schedule is not None:
        # The same rows as one call: with the replay rows, and without them (computed rows only,
        # their own leaf tensors, so that no gather is timed).
        sequence_lengths = np.concatenate([np.diff(call.cu_seqlens) for call in schedule.calls])
        computed = ~np.concatenate([call.is_replay for call in schedule.calls])
        starts = np.concatenate([[0], np.cumsum(sequence_lengths)])
        computed_lengths = np.add.reduceat(computed.astype(np.int64), starts[:-1])
        keep = torch.from_numpy(np.flatnonzero(computed)).to(device)
        without_replay = [x.detach().index_select(0, keep).requires_grad_() for x in (q, k, v, g, beta)]
        for name, inputs, lengths in (("kda_one_call", (q, k, v, g, beta), sequence_lengths),
                                      ("kda_one_call_no_replay", without_replay, computed_lengths)):
            cu_cpu = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]))
            cu = cu_cpu.to(device)

            def one_call(inputs=inputs, cu=cu, cu_cpu=cu_cpu):
                out = packed(*inputs, cu, chunk_size=layout.chunk_size, use_qk_l2norm=True,
                             backend=layout.kda_backend, cu_seqlens_cpu=cu_cpu, **kernel)
                backward(out)

            times[name] = _time_op(one_call, device)
    if config.mla is not None:
        mla = config.mla
        attention_heads, qk_dim, v_dim = mla.num_heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.v_head_dim
    else:
        # Gated GQA attends with its KV heads repeated to every query head (as `GatedAttentionLayer`).
        attention_heads, qk_dim = config.gated_attention.num_heads, config.gated_attention.head_dim
        v_dim = qk_dim
    qa, ka = rand(rows, attention_heads, qk_dim), rand(rows, attention_heads, qk_dim)
    va = rand(rows, attention_heads, v_dim)
    times["mla"] = _time_op(lambda: backward(layout.attention(qa, ka, va, qk_dim ** -0.5)), device)
    hidden = rand(rows, config.hidden_size)
    weight = rand(config.vocab_size, config.hidden_size, scale=0.02)
    semantic = len(layout.semantic_rows)
    targets = torch.randint(0, config.vocab_size, (semantic,), generator=generator, device=device)
    times["lm_head"] = _time_op(
        lambda: compact_logprobs(hidden, weight, layout.semantic_rows, targets,
                                 grad_precision=grad_precision).sum().backward(), device
    )
    return times


OP_WORK = {"kda": "kda_rows", "kda_one_call": "kda_rows", "kda_one_call_no_replay": "rows",
           "mla": "attention_pairs", "lm_head": "logprob_rows"}
"""The work each of `op_times`' ops scales with (`op_work`), to scale a sample of microbatches to the step."""


def op_work(layout) -> dict[str, int]:
    """A layout's work measures of `OP_WORK`: its rows, the rows of its KDA calls (replay included), its attention's
    (query, key) pairs and the LM head's rows (one per semantic row)."""
    return {"rows": layout.num_rows, "kda_rows": layout.num_kda_rows, "attention_pairs": layout.groups.num_pairs,
            "logprob_rows": len(layout.semantic_rows)}


def execution_op_seconds(model, step, microbatches, config, index, device, dtype) -> tuple[dict[str, float], float]:
    """One execution's op seconds over the step (`op_times` on a sample of its `microbatches`, each op scaled by
    its work) and the fraction of its microbatches sampled."""
    from harts.engine import Engine

    engine = Engine(model, config)
    sums: dict[str, float] = {}
    nonempty = [m for m in microbatches if len(m)]
    # Op times are measured on evenly spaced microbatches and scaled to the whole step by each op's own
    # work (`op_work`): attention by (query, key) pairs, which grow as the square of a trajectory's length,
    # so a sample's rows say little about them.
    picks = set(range(0, len(nonempty), max(1, -(-len(nonempty) // BREAKDOWN_MICROBATCHES))))
    work_all: dict[str, int] = {}
    work_picked: dict[str, int] = {}
    for k, members in enumerate(nonempty):
        layout = engine.layout(step, members, index)
        for key, value in op_work(layout).items():
            work_all[key] = work_all.get(key, 0) + value
            if k in picks:
                work_picked[key] = work_picked.get(key, 0) + value
        if k in picks:
            times = op_times(model, layout.to(device), device, dtype, config.logprob_grad_precision)
            for key, value in times.items():
                sums[key] = sums.get(key, 0.0) + value
    totals = {key: value * work_all[OP_WORK[key]] / work_picked[OP_WORK[key]] for key, value in sums.items()}
    return totals, len(picks) / len(nonempty)


def breakdown(model, step, microbatches, configs, index, device, dtype, base, comp, compression, *,
              baseline_ops: tuple[dict[str, float], float] | None = None) -> dict[str, Any]:
    """Where the compact time goes beyond (C/S) × baseline, from op-level times on the real layouts
    (`execution_op_seconds`; the baseline's given as `baseline_ops` where its measurement is an earlier case's)."""
    config = model.config
    num_kda = sum(kind == config.linear_kind for kind in config.layer_kinds())
    num_mla = config.num_layers - num_kda
    ops = {} if baseline_ops is None else {"baseline": baseline_ops}
    for name in EXECUTIONS:
        if name not in ops:
            ops[name] = execution_op_seconds(model, step, microbatches[name], configs[name], index, device, dtype)
    totals = {name: dict(ops[name][0]) for name in EXECUTIONS}
    return {
        **breakdown_terms(totals["baseline"], totals["compact"], num_kda, num_mla, base, comp, compression),
        "sampled_microbatch_fraction": {name: ops[name][1] for name in EXECUTIONS},
    }


def breakdown_terms(b: dict[str, float], c: dict[str, float], num_kda: int, num_mla: int, base: dict[str, float],
                    comp: dict[str, float], compression: float) -> dict[str, Any]:
    """The breakdown's arithmetic: per-layer op seconds of the step (`b` baseline, `c` compact: kda,
    kda_one_call, kda_one_call_no_replay on compact, mla, lm_head) and the executions' fbg_s and layout_s
    into terms that sum to the compact time beyond (1 / compression) × the baseline's."""
    ratio = 1.0 / compression
    base_ops = {"kda": num_kda * b["kda"], "mla": num_mla * b["mla"], "lm_head": b["lm_head"]}
    comp_ops = {"kda": num_kda * c["kda"], "mla": num_mla * c["mla"], "lm_head": c["lm_head"]}
    base_rest = base["fbg_s"] - sum(base_ops.values())
    comp_rest = comp["fbg_s"] - sum(comp_ops.values())
    terms = {
        "replay": num_kda * (c["kda_one_call"] - c["kda_one_call_no_replay"]),
        "boundary_handoff_and_calls": num_kda * (c["kda"] - c["kda_one_call"]),
        "kda_other": num_kda * c["kda_one_call_no_replay"] - ratio * base_ops["kda"],
        "ancestor_kv_attention": comp_ops["mla"] - ratio * base_ops["mla"],
        "lm_head": comp_ops["lm_head"] - ratio * base_ops["lm_head"],
        "per_row_other": comp_rest - ratio * base_rest,
    }
    ideal = ratio * base["fbg_s"]
    pairs = (comp.get("attention_pairs"), base.get("attention_pairs"))
    # Of ancestor_kv_attention: the compact's extra (query, key) pairs at the baseline's attention speed.
    pair_part = (pairs[0] / pairs[1] - ratio) * base_ops["mla"] if pairs[0] is not None and pairs[1] else None
    return {
        "ideal_compact_fbg_s": ideal,
        "excess_s": comp["fbg_s"] - ideal,
        "terms_s": terms,
        "ancestor_kv_attention_pairs_s": pair_part,
        "layout_materialisation_s": comp["layout_s"] - base["layout_s"],
        "op_seconds": {"baseline": b, "compact": c},
        "method": "op-level fwd+bwd on real microbatch layouts (evenly spaced sample, each op scaled by its work: "
                  "attention pairs, KDA rows, LM-head rows) with random inputs; per_row_other = measured F+B minus "
                  "the measured ops; terms sum to excess_s",
    }
