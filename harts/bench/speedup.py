"""`harts bench speedup`: compact execution vs the per-trajectory baseline, per step (DESIGN §6).

For each step: plan the baseline's microbatches (`per-trajectory`: each trajectory its own
sequence, first-fit-decreasing to capacity T in semantic tokens) and the compact execution's
(`--planner`, default HARTS, capacity T in compact tokens); run both on the same weights with the
same kernels and recomputation setting (`--compact-attention-backend` may give the compact execution
its own MLA backend), `--repeats` times each (interleaved, after a warm-up: on
CUDA a whole untimed step of each execution, since Triton autotunes per sequence length),
and take medians. One record per step (config, environment, hardware) with:
- sizes: S, the plan's compact rows C, the trie lower bound, replay rows, attention KV rows of
  each execution (ancestor KV views of the compact groups), KDA calls per microbatch;
- per execution: forward, backward, gradient reduction (0 in one process), planning (the
  microbatch planner plus layout building, which includes the KDA call planning), peak memory;
- fbg_speedup = baseline (F + B + G) / compact (F + B + G); core_speedup = the same with planning
  added to both sides; compression = S / C; efficiency = fbg_speedup / compression
  (`speedup_metrics`); compression and efficiency counted in model FLOPs (`flops_metrics`: the compact's attention pairs
  shrink less than its rows, so its FLOPs compression is usually below S / C);
- breakdown of the compact time beyond the ideal (C / S) × baseline into terms (`breakdown_terms`), from op-level
  measurements on real microbatch layouts with random inputs of the model's shapes (up to BREAKDOWN_MICROBATCHES
  evenly spaced microbatches of each execution, each op scaled to the step by its own work, `OP_WORK`):
  replay (one call over the calls' rows with vs without the replay rows), boundary-state handoff
  and call launches (the planned calls vs one call over the same rows), other KDA (shorter
  sequences, chunk padding), ancestor KV / masked blocks (MLA), LM head, the remaining per-row
  work (projections, MoE, norms), and layout materialisation (reported beside, since it is
  planning);
- with `--profile`, the top ops by self device time (CPU: self CPU time) of the largest microbatch
  of each execution (torch.profiler) and the rows each ran, to compare their time per row op by op;
- on CUDA, the baseline's model-FLOPs utilisation (estimated model FLOPs, no recomputation,
  over the measured time and the bf16 dense peak), both ways: `baseline_mfu` with attention
  (MLA over each trajectory's causal pairs, the KDA chunk kernel's FLOPs) as the field counts it,
  `baseline_mfu_matmul` over the per-token weight products alone (`estimate_model_flops`);
- `timing_flags`: why the timings should not be trusted, if they should not (efficiency above
  1.05, or an execution's F+B+G varying by more than 10% over the repeats, each repeat's in
  `fbg_repeats_s`); the printed table and the report mark such records.
`--variant FLAG[=VALUE],...` (repeatable) measures every step again, after the run's own settings, with some of
the run flags changed (`VARIANT_FLAGS`: recomputation, kept attention and KDA intermediates, attention/KDA/experts
backends, LM-head gradient precision and chunk rows, planner, capacity, repeats), in this process on the same
weights and compiled kernels: one record per step for the run's settings (`variant` null) and one per step and
variant, its `config` holding the variant's settings and its text under `variant` (a trade study, e.g. how many
blocks to recompute, costs one model build and one compilation instead of one per setting).
`--recompute-blocks auto` (and `--compact-recompute-blocks auto`; one process on CUDA) finds, per execution, the
fewest recomputed blocks with which a whole step of it runs in the GPU's memory (`fewest_recomputed_blocks`):
a first untimed step recomputing every block (it also compiles and autotunes), then a bisection over fewer, each
probe a whole untimed step that either finishes or runs out of memory (`step_fits`). With `--recompute-by-rows`
the smaller microbatches keep more, as always. The record's config holds the blocks found (the report labels
them like given ones), `recompute_blocks_auto` names the executions searched, and `results.recompute_search` every
probe (blocks, fits, peak memory, seconds). The compact execution follows `--recompute-blocks` unless given its
own, so `auto` there searches both executions, each for itself. `--compact-recompute-blocks within-baseline`
searches the compact execution with a stricter answer: a probe counts only if it also peaks no higher than a
step of the baseline at its own blocks (given, or found by `auto`: its probe at the blocks found; otherwise one
more untimed baseline step), so that the speedup is measured at equal or lower memory
(`results.recompute_search.compact.within_peak_memory_bytes`; the timed steps' peaks may differ from the probes'
by the allocator's rounding).
A case that fails (an error, out of memory, SIGTERM from `timeout`) is a record with an `error`
field naming the phase it reached (and, single-process, the seconds of every step it finished),
never a gap.

`--parallel NAME` (configs/parallel/NAME.yaml) runs both executions on the ranks of a parallel
configuration (harts.parallel.launch: gloo on CPU, NCCL on CUDA), each planned for dp = the
config's DP degree (K mod D = 0), with `run_parallel_step` on every rank (warm-up on the plan's
first slot, then `--repeats` interleaved steps). Per execution and repeat, each rank's own
seconds are kept (`samples`, one entry per rank); the record's figures are medians over repeats of:
- forward_s, backward_s, layout_s: the maximum over ranks of each phase;
- grad_reduction_s: the gradient reduction alone (TP partial sums, DP and expert-DP all-reduces,
  once per step), timed again after a barrier so that no rank's wait for a slower one is counted,
  maximum over ranks;
- fbg_s: the step's critical path, the maximum over ranks of the rank's forward + backward +
  in-step gradient reduction (which, on a rank that finished early, includes its wait for the
  slowest replica or stage: imbalance is part of the step's time);
- planning_s: the planner's time plus layout_s (each rank builds its own microbatches' layouts);
- peak_memory_bytes: the maximum over ranks.
The op-level breakdown is single-process only (it subtracts single-device op times from the
measured F + B; under --parallel the remainder would mix in communication and pipeline waits):
the record says so in `breakdown_skipped`. The baseline's MFU (on CUDA) divides by world size ×
peak. Started by torchrun (one node or several), every rank runs the command: rank 0 measures,
prints and writes the records, the others run their part of each step quietly; the first failed
step ends the run (its error record on rank 0), since the ranks are out of step after it.

W&B (harts.tracking.wandb_log, `--wandb-*`): each record is one run, opened before its step is
measured; in one process every warm-up and timed repeat of each execution is a history row as soon
as it finishes (`repeat`, `baseline/forward_s`, ..., `compact/fbg_s`); under --parallel the ranks'
repeats come back together at the end of the step and are logged then.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from harts.args import (
    EXPERT_BACKENDS, EXPERTS_BACKEND_HELP, KEEP_ATTENTION_HELP, index_list, non_negative_int, positive_int,
    print_error,
)
from harts.tracking import wandb_log

logger = logging.getLogger(__name__)

BREAKDOWN_MICROBATCHES = 4
# The default capacity T, and the LM head's default chunk (harts.objective.logprobs.DEFAULT_CHUNK_ROWS; not
# imported here: torch loads lazily). The speedup report labels other values.
DEFAULT_CAPACITY = 65536
DEFAULT_CHUNK_ROWS = 4096
PAPER = {"compression": 5.62, "speedup": 4.81, "efficiency": 4.81 / 5.62}
# Timings are flagged (`timing_flags`) above this efficiency or this relative F+B+G range over repeats.
EFFICIENCY_LIMIT = 1.05
SPREAD_LIMIT = 0.10
# NVIDIA's datasheet: H100/H200 SXM dense bf16 (the measured ceiling on KINDS.md is lower).
H200_BF16_PEAK_FLOPS = 989.5e12


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("speedup", help="compact vs per-trajectory execution: speedup records")
    parser.add_argument("--model", required=True, help="configs/models NAME or a YAML path")
    parser.add_argument("--trees", required=True, help="trees config NAME or YAML path (generate), or a step path")
    parser.add_argument("--steps", type=index_list, default=None, help="step indices of a trees config (default 0)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="trees seed")
    parser.add_argument("--max-trees", type=positive_int, default=None,
                        help="use the first N task trees of each step (a slice of the same shape)")
    parser.add_argument("--model-seed", type=non_negative_int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--params", choices=("fp32", "bf16"), default=None,
                        help="parameter dtype: bf16 = bf16 parameters with every microbatch's gradients added "
                             "into fp32 buffers (megatron's main_grad), no per-use casts; fp32 = fp32 parameters "
                             "cast by autocast at every use. Default: bf16 with --dtype bf16 in one process, else fp32")
    _add_run_flags(parser)
    parser.add_argument("--variant", action="append", type=parse_variant, default=None, metavar="FLAG[=VALUE],...",
                        help="after the run's own settings, measure each step again with these run flags changed "
                             "(repeatable; one record per step and variant, all in this process on the same weights "
                             "and compiled kernels), e.g. --variant recompute-blocks=14 "
                             "--variant recompute-blocks=14,keep-attention. Flags: "
                             + ", ".join(VARIANT_FLAGS) + " (booleans take =yes or =no; recompute-blocks=all or =auto; "
                             "compact-recompute-blocks=same follows recompute-blocks)")
    parser.add_argument("--no-breakdown", action="store_true", help="skip the op-level breakdown")
    parser.add_argument("--profile", action="store_true",
                        help="also profile the largest microbatch of each execution (torch.profiler): the top "
                             "kernels by self device time (CPU: self CPU time) go into the record")
    parser.add_argument("--parallel", default=None, metavar="NAME",
                        help="configs/parallel NAME or a YAML path: run both executions on its ranks (spawned here, "
                             "or started by torchrun: rank 0 writes the records)")
    parser.add_argument("--out", default=None, help="records file (default reports/raw/speedup/MODEL.json)")
    parser.add_argument("--json", action="store_true", help="also print the records' headline figures as JSON")
    wandb_log.add_arguments(parser)
    parser.set_defaults(run=run, files=lambda a: ([a.out], [a.trees]))


# The flags a `--variant` may change: how a step runs, not the weights (the model's shape, seed and parameter
# dtype), the device or the trees, so that one process measures every variant on the same weights and compiled
# kernels. The experts backend is one: its three backends hold the same parameters.
VARIANT_FLAGS = ("planner", "capacity", "recompute", "recompute-blocks", "compact-recompute-blocks",
                 "recompute-by-rows", "keep-attention", "keep-kda-intermediates",
                 "attention-backend", "compact-attention-backend", "kda-backend", "experts-backend",
                 "logprob-grad-precision", "logprob-chunk-rows", "repeats")


def _add_run_flags(parser: argparse.ArgumentParser, variant: bool = False) -> None:
    """The `VARIANT_FLAGS` with their defaults; for a variant's parser (`variant`), without defaults (only the
    flags it names are set) and with the booleans taking an optional yes/no."""

    def add(name: str, *, boolean: bool = False, **kwargs) -> None:
        if variant:
            kwargs.pop("default", None)
            if boolean:
                kwargs.update(nargs="?", const=True, type=yes_no)
        elif boolean:
            kwargs["action"] = "store_true"
        parser.add_argument(name, **kwargs)

    add("--planner", default="harts")
    add("--capacity", type=positive_int, default=DEFAULT_CAPACITY)
    add("--recompute", boolean=True, help="full per-layer activation recomputation")
    add("--recompute-blocks", type=all_auto_or_positive_int if variant else auto_or_positive_int, default=None,
        metavar="N", help="with --recompute: recompute only blocks 0..N-1, the others keep their activations "
                          "(Megatron's block method; default: every block); auto: the fewest with which a whole "
                          "step of each execution runs in the GPU's memory (searched by untimed steps; one process "
                          "on CUDA)")
    add("--compact-recompute-blocks", type=same_or_compact_blocks if variant else compact_blocks,
        default=None, metavar="N", help="with --recompute: the compact execution's --recompute-blocks (default: the "
                                        "same), so that each execution recomputes what its own memory needs (the "
                                        "compact one has fewer rows); auto as there; within-baseline: the fewest "
                                        "with which a compact step also peaks no higher than a baseline step")
    add("--recompute-by-rows", boolean=True,
        help="with --recompute-blocks: a microbatch smaller than another of the step keeps more blocks, in "
             "proportion to its rows (KDA and ancestor-KV rows too), within that one's activation memory")
    add("--keep-attention", boolean=True, help=KEEP_ATTENTION_HELP)
    add("--keep-kda-intermediates", boolean=True,
        help="with --recompute and the fla KDA (the CUDA default): the recomputed blocks' KDA calls keep fla's "
             "intermediates (WY factors, gated q/k, chunk states) from the recomputation for the backward instead "
             "of computing them again (a transient of one block's intermediates)")
    add("--attention-backend", default=None,
        help="MLA backend, naive|sdpa|varlen|flex|cudnn|flash4 (default: sdpa on CPU, varlen on CUDA)")
    add("--compact-attention-backend", default=None,
        help="MLA backend of the compact execution only (default: --attention-backend), e.g. flex: "
             "the DFS tree mask over the compact rows, without the ancestor-KV copies of varlen")
    add("--kda-backend", default=None)
    add("--experts-backend", default=None, choices=EXPERT_BACKENDS, help=EXPERTS_BACKEND_HELP)
    add("--logprob-grad-precision", choices=("fp32", "input"), default="fp32",
        help="the LM head's logit gradients: fp32 (TF32 gradient matmuls for bf16 on CUDA) or input "
             "(rounded once to bf16, bf16 tensor-core matmuls)")
    add("--logprob-chunk-rows", type=positive_int, default=DEFAULT_CHUNK_ROWS, metavar="N",
        help="rows of the LM head's logits formed at a time (its transient memory: N x vocabulary fp32; default "
             f"{DEFAULT_CHUNK_ROWS:,})")
    add("--repeats", type=positive_int, default=3)


def yes_no(text: str) -> bool:
    if text in ("yes", "no"):
        return text == "yes"
    raise argparse.ArgumentTypeError(f"expected yes or no, got {text!r}")


AUTO = "auto"
WITHIN_BASELINE = "within-baseline"
SEARCHED = (AUTO, WITHIN_BASELINE)
# `--recompute-blocks auto` probes for an out-of-memory error, which only a GPU's allocator raises (on the CPU the
# system would kill the process); the tests add the CPU to run the search against a simulated memory.
AUTO_DEVICES = ("cuda",)


def positive_int_or(text: str, words: tuple[str, ...]) -> int | str:
    """A positive int or one of `words` (kept as the text), the error naming both."""
    if text in words:
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError as error:
        listed = f" or {words[0]}" if len(words) == 1 else f", {', '.join(words[:-1])} or {words[-1]}"
        raise argparse.ArgumentTypeError(str(error).replace(", got", f"{listed}, got", 1)) from None


def auto_or_positive_int(text: str) -> int | str:
    return positive_int_or(text, (AUTO,))


def all_auto_or_positive_int(text: str) -> int | str | None:
    return None if text == "all" else auto_or_positive_int(text)


def compact_blocks(text: str) -> int | str:
    """--compact-recompute-blocks: a positive int, auto or within-baseline."""
    return positive_int_or(text, SEARCHED)


def same_or_compact_blocks(text: str) -> int | str | None:
    """A variant's compact-recompute-blocks: `same` follows recompute-blocks again (the flag's default)."""
    return None if text == "same" else compact_blocks(text)


class _VariantParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise argparse.ArgumentTypeError(message)


def parse_variant(text: str) -> dict[str, Any]:
    """argparse type of `--variant`: `FLAG[=VALUE]` items joined by commas, each one of `VARIANT_FLAGS`; the
    run flags they set (dest → value), in a dict with the text itself under "variant"."""
    argv = []
    for item in text.split(","):
        name, sep, value = item.strip().partition("=")
        if name not in VARIANT_FLAGS:
            raise argparse.ArgumentTypeError(f"{text!r}: {name!r} is not one of {', '.join(VARIANT_FLAGS)}")
        argv += [f"--{name}", value] if sep else [f"--{name}"]
    parser = _VariantParser(prog="--variant", add_help=False, argument_default=argparse.SUPPRESS)
    _add_run_flags(parser, variant=True)
    try:
        overrides = vars(parser.parse_args(argv))
    except argparse.ArgumentTypeError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None
    return {**overrides, "variant": text}


class PeakMemory:
    """Peak memory of a region: CUDA allocator peak, or the process RSS sampled every 5 ms on CPU."""

    def __init__(self, device) -> None:
        self.device = device
        self.peak = 0

    def __enter__(self) -> PeakMemory:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.base = _rss()
            self.peak = self.base
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, _rss())


def _rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as handle:
        pages = int(handle.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_op(fn, device, repeats: int = 2) -> float:
    """Median seconds of fn() (forward + backward of one op)."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def op_times(model, layout, device, dtype, grad_precision: str = "fp32") -> dict[str, float]:
    """Per-microbatch op times (fwd + bwd) on `layout` with random inputs of the model's shapes (the LM head
    with the step's `grad_precision`)."""
    import numpy as np
    import torch

    from harts.objective.logprobs import compact_logprobs
    from harts.ops.kda.packed import packed_kda

    config = model.config
    rows = layout.num_rows
    generator = torch.Generator(device=device).manual_seed(0)
    act_dtype = dtype or torch.float32

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator, device=device) * scale).to(act_dtype).requires_grad_()

    # KDA runs on the layout's KDA rows (the compact execution's calls' rows, replay rows included).
    heads, head_dim, kda_rows = config.kda.num_heads, config.kda.head_dim, layout.num_kda_rows
    q, k, v = (rand(kda_rows, heads, head_dim) for _ in range(3))
    g = (-torch.rand(kda_rows, heads, head_dim, generator=generator, device=device) * 0.1).requires_grad_()
    beta = torch.rand(kda_rows, heads, generator=generator, device=device).requires_grad_()

    def backward(out):
        out.float().square().mean().backward()

    times = {"kda": _time_op(lambda: backward(layout.linear_attention(q, k, v, g, beta)), device)}
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
                out = packed_kda(*inputs, cu, chunk_size=layout.chunk_size, use_qk_l2norm=True,
                                 backend=layout.kda_backend, cu_seqlens_cpu=cu_cpu)
                backward(out)

            times[name] = _time_op(one_call, device)
    mla = config.mla
    qk_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    qa, ka = rand(rows, mla.num_heads, qk_dim), rand(rows, mla.num_heads, qk_dim)
    va = rand(rows, mla.num_heads, mla.v_head_dim)
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


def estimate_model_flops(model_config, semantic_tokens: int, causal_pairs: int) -> dict[str, float]:
    """Training FLOPs (forward + backward = 3 × forward, no recomputation) of the baseline, in two parts:
    - "matmul": the products with the per-token weights (projections, the MLP or the k routed experts
      + shared expert + router, the LM head), 2 × in × out per token each: the model-FLOPs count of
      the parameters alone;
    - "attention": what the field adds for sequence mixing: MLA's scores and values over the causal
      pairs of each trajectory (2 × heads × (qk + v) per pair), and KDA's chunked form (the
      intra-chunk key/query products and the per-token state update).
    MFU is reported both ways (`_mfu`): over "matmul" alone, and over the sum."""
    c = model_config
    matmul = 2 * c.hidden_size * c.vocab_size  # LM head
    kda, mla, moe = c.kda, c.mla, c.moe
    kda_width = kda.num_heads * kda.head_dim
    rank = kda.gate_rank or kda.head_dim
    kda_params = 4 * c.hidden_size * kda_width + 2 * (c.hidden_size * rank + rank * kda_width) + c.hidden_size * kda.num_heads
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    q_params = (c.hidden_size * mla.q_lora_rank + mla.q_lora_rank * mla.num_heads * qk) if mla.q_lora_rank else c.hidden_size * mla.num_heads * qk
    mla_params = (q_params + c.hidden_size * (mla.kv_lora_rank + mla.qk_rope_head_dim)
                  + mla.kv_lora_rank * mla.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim)
                  + mla.num_heads * mla.v_head_dim * c.hidden_size)
    moe_params = (c.hidden_size * moe.num_experts + moe.top_k * 3 * c.hidden_size * moe.expert_hidden_size
                  + 3 * c.hidden_size * moe.shared_expert_hidden_size)
    dense_params = 3 * c.hidden_size * c.dense_hidden_size
    attention_per_token = 0
    attention_pairs = 0
    kda_per_token = 2 * kda.num_heads * (kda.chunk_size * (2 * kda.head_dim + kda.head_dim) + 4 * kda.head_dim * kda.head_dim)
    for i, kind in enumerate(c.layer_kinds()):
        matmul += 2 * (kda_params if kind == "kda" else mla_params)
        matmul += 2 * (dense_params if i < c.num_dense_layers else moe_params)
        if kind == "kda":
            attention_per_token += kda_per_token
        else:
            attention_pairs += 2 * mla.num_heads * (qk + mla.v_head_dim)
    return {"matmul": 3.0 * matmul * semantic_tokens,
            "attention": 3.0 * (attention_per_token * semantic_tokens + attention_pairs * causal_pairs)}


EXECUTIONS = ("baseline", "compact")
PARALLEL_BREAKDOWN_SKIPPED = (
    "--parallel: the op-level breakdown is single-process only (it subtracts single-device op times from the "
    "measured F+B, which under --parallel also holds communication and pipeline waits)"
)


def _microbatches(step, plan) -> list:
    import numpy as np

    position = {trajectory_id: k for k, trajectory_id in enumerate(step.ids)}
    return [np.asarray([position[t] for t in mb.trajectory_ids], dtype=np.int64) for mb in plan.microbatches]


def _step_configs(args, dtype_name: str, blocks: dict[str, int | None] | None = None) -> dict:
    """Each execution's StepConfig; `blocks`: its recompute_blocks (default: the flags')."""
    from harts.objective.step import StepConfig
    from harts.ops.attention.groups import default_attention_backend
    from harts.ops.kda.compact import default_kda_backend

    cuda = args.device == "cuda"
    attention = args.attention_backend or default_attention_backend(cuda)
    backends = {"baseline": attention, "compact": args.compact_attention_backend or attention}
    blocks = blocks or requested_blocks(args)
    return {
        name: StepConfig(
            execution=name, recompute=args.recompute, recompute_blocks=blocks[name],
            recompute_by_rows=args.recompute_by_rows,
            keep_attention=args.keep_attention, keep_kda_intermediates=args.keep_kda_intermediates,
            dtype=dtype_name, attention_backend=backends[name],
            kda_backend=args.kda_backend or default_kda_backend(cuda),
            logprob_grad_precision=args.logprob_grad_precision, logprob_chunk_rows=args.logprob_chunk_rows,
        )
        for name in EXECUTIONS
    }


def compact_recompute_blocks(args) -> int | str | None:
    """The compact execution's recompute_blocks: --compact-recompute-blocks where given, else --recompute-blocks."""
    return args.recompute_blocks if args.compact_recompute_blocks is None else args.compact_recompute_blocks


def requested_blocks(args) -> dict[str, int | str | None]:
    """Each execution's recompute_blocks as the flags give them (an int, None: every block, or AUTO)."""
    return {"baseline": args.recompute_blocks, "compact": compact_recompute_blocks(args)}


def fewest_recomputed_blocks(fits, num_blocks: int, where: str = "in memory") -> int:
    """The fewest recomputed blocks n in 1..num_blocks with `fits(n)` true, fits being monotone (more recomputed
    blocks, less memory), by bisection. The first try is every block (on the GPU it also compiles and autotunes,
    with the most memory to spare); if that does not fit (`where`: the limit, for the message), ValueError."""
    if not fits(num_blocks):
        raise ValueError(f"the step does not fit {where} even with every block ({num_blocks}) recomputed")
    too_few, enough = 0, num_blocks
    while enough - too_few > 1:
        middle = (too_few + enough) // 2
        if fits(middle):
            enough = middle
        else:
            too_few = middle
    return enough


def step_fits(model, step, microbatches, config, index, device) -> dict[str, Any]:
    """One untimed step of `config`'s execution: whether it ran in the device's memory (a CUDA out-of-memory
    error is the answer no), its peak memory and seconds; what it left is freed either way."""
    import torch

    from harts.objective.step import run_step

    start = time.perf_counter()
    fits = True
    with PeakMemory(device) as memory:
        try:
            run_step(model, step, microbatches, config, index=index)
        except torch.OutOfMemoryError:
            fits = False
    release_memory(device, model)
    return {"recompute_blocks": config.recompute_blocks, "fits": fits, "peak_memory_bytes": memory.peak,
            "seconds": time.perf_counter() - start}


def search_recompute_blocks(model, step, microbatches, configs, index, device, requested, progress) -> tuple:
    """Each execution's recompute_blocks, those `requested` as AUTO or WITHIN_BASELINE found by
    `fewest_recomputed_blocks` (probes by `step_fits`); and, per execution searched, {"recompute_blocks": found,
    "probes": [step_fits' answers]}, with WITHIN_BASELINE also "within_peak_memory_bytes" (the baseline's peak) and
    "baseline_probe" (the untimed baseline step that measured it, or None: the baseline's own search did)."""
    from dataclasses import replace

    blocks, search = dict(requested), {}
    for name, value in requested.items():  # the baseline first: within-baseline needs its blocks
        if value not in SEARCHED:
            continue
        limit, baseline_probe = None, None
        if value == WITHIN_BASELINE:
            limit, baseline_probe = _baseline_peak(model, step, microbatches, configs, index, device, search, progress)
        probes = []

        def fits(n: int) -> bool:
            progress["phase"] = f"{name} memory search ({n} blocks recomputed)"
            probes.append(step_fits(model, step, microbatches[name], replace(configs[name], recompute_blocks=n),
                                    index, device))
            return probes[-1]["fits"] and (limit is None or probes[-1]["peak_memory_bytes"] <= limit)

        where = "in memory" if limit is None else f"within the baseline's peak ({limit / 1e9:.2f} GB)"
        try:
            blocks[name] = fewest_recomputed_blocks(fits, model.config.num_layers, where)
        except ValueError as error:
            flag = "--compact-recompute-blocks" if value == WITHIN_BASELINE else "--recompute-blocks"
            raise ValueError(f"{flag} {value}: the {name} execution: {error}") from None
        search[name] = {"recompute_blocks": blocks[name], "probes": probes}
        if limit is not None:
            search[name].update(within_peak_memory_bytes=limit, baseline_probe=baseline_probe)
    return blocks, search


def _baseline_peak(model, step, microbatches, configs, index, device, search, progress) -> tuple:
    """The peak memory of a baseline step at its blocks and the probe that measured it: its search's probe at the
    blocks found (probe None), else one untimed step (`step_fits`) of `configs["baseline"]`, whose blocks were
    given."""
    if "baseline" in search:
        found = search["baseline"]["recompute_blocks"]
        return next(p["peak_memory_bytes"] for p in search["baseline"]["probes"]
                    if p["recompute_blocks"] == found and p["fits"]), None
    progress["phase"] = "baseline peak memory"
    probe = step_fits(model, step, microbatches["baseline"], configs["baseline"], index, device)
    if not probe["fits"]:
        raise ValueError("--compact-recompute-blocks within-baseline: the baseline execution does not fit in memory "
                         "at its own blocks, so it has no peak to stay within")
    return probe["peak_memory_bytes"], probe


def speedup_metrics(base: dict[str, float], comp: dict[str, float], semantic_tokens: int,
                    compact_tokens: int) -> dict[str, float]:
    """compression S / C, F/B/Grad and Core speedups and efficiency from the executions' fbg_s and planning_s."""
    compression = semantic_tokens / compact_tokens
    fbg_speedup = base["fbg_s"] / comp["fbg_s"]
    core_speedup = (base["fbg_s"] + base["planning_s"]) / (comp["fbg_s"] + comp["planning_s"])
    return {"compression": compression, "fbg_speedup": fbg_speedup, "core_speedup": core_speedup,
            "efficiency": fbg_speedup / compression}


def timing_flags(results: dict[str, Any]) -> list[str]:
    """Reasons to distrust a record's timings (empty when there are none): an efficiency above
    EFFICIENCY_LIMIT (the compact rows run the same per-row work as the baseline's, so beyond noise it
    cannot beat its compression; seen as 2.86 when another job loaded the machine during the baseline),
    or an execution whose F+B+G varies by more than SPREAD_LIMIT of its median over the repeats."""
    flags = []
    if results["efficiency"] > EFFICIENCY_LIMIT:
        flags.append(f"efficiency {results['efficiency']:.2f} > {EFFICIENCY_LIMIT}: faster than the compression "
                     "allows; the timings were disturbed (a loaded machine?)")
    for name in EXECUTIONS:
        repeats = results[name]["fbg_repeats_s"]
        spread = (max(repeats) - min(repeats)) / statistics.median(repeats)
        if spread > SPREAD_LIMIT:
            flags.append(f"{name} F+B+G varies by {spread:.0%} over {len(repeats)} repeats (> {SPREAD_LIMIT:.0%}): "
                         "timing noise")
    return flags


def execution_times(samples: list[list[dict[str, float]]]) -> dict[str, float]:
    """Medians over repeats of one execution's phases; `samples[repeat][rank]` holds the rank's own seconds
    (layout, forward, backward, grad_reduce in the step, grad_reduction_alone after a barrier)."""
    per_repeat = [
        {
            "forward_s": max(r["forward"] for r in ranks),
            "backward_s": max(r["backward"] for r in ranks),
            "grad_reduction_s": max(r["grad_reduction_alone"] for r in ranks),
            "layout_s": max(r["layout"] for r in ranks),
            "fbg_s": max(r["forward"] + r["backward"] + r["grad_reduce"] for r in ranks),
        }
        for ranks in samples
    ]
    medians = {key: statistics.median(p[key] for p in per_repeat) for key in per_repeat[0]}
    return {**medians, "fbg_repeats_s": [p["fbg_s"] for p in per_repeat]}


def _execution(samples, plan_seconds: float, peak: int, infos: list[dict], microbatches) -> dict[str, Any]:
    times = execution_times(samples)
    return {
        **times, "planning_s": plan_seconds + times["layout_s"], "peak_memory_bytes": int(peak),
        "microbatches": len([m for m in microbatches if len(m)]),
        "rows": int(sum(i["rows"] for i in infos)),
        "attention_kv_rows": int(sum(i["attention_kv_rows"] for i in infos)),
        "attention_pairs": int(sum(i["attention_pairs"] for i in infos)),
        "kda_calls": [i["kda_calls"] for i in infos],
        "samples": samples,
    }


def flops_metrics(model_config, base: dict[str, Any], comp: dict[str, Any]) -> dict[str, float]:
    """Compression and efficiency counted in model FLOPs instead of rows (`estimate_model_flops` with attention, each
    execution's own rows and (query, key) pairs): `flops_compression` = baseline FLOPs / compact FLOPs, below S / C
    when the compact's attention pairs shrink less than its rows (`attention_pair_ratio` above C / S), and
    `flops_efficiency` = F/B/Grad speedup / flops_compression, the compact's speed per FLOP relative to the
    baseline's. Replay rows and recomputation are overheads, not model FLOPs, on both sides."""
    def total(rows: int, pairs: int) -> float:
        flops = estimate_model_flops(model_config, rows, pairs)
        return flops["matmul"] + flops["attention"]

    flops_compression = total(base["rows"], base["attention_pairs"]) / total(comp["rows"], comp["attention_pairs"])
    return {"flops_compression": flops_compression,
            "flops_efficiency": base["fbg_s"] / comp["fbg_s"] / flops_compression}


def _results(model_config, step, index, executions, compact_infos) -> dict[str, Any]:
    base, comp = executions["baseline"], executions["compact"]
    results = {
        "semantic_tokens": step.num_semantic_tokens,
        "compact_tokens": comp["rows"],
        "lower_bound_compact_tokens": index.segment_tree().num_compact_tokens,
        "replay_rows": int(sum(i["replay_rows"] for i in compact_infos)),
        **speedup_metrics(base, comp, step.num_semantic_tokens, comp["rows"]),
        # The compact attention's share of the baseline's (query, key) pairs: usually above C/S, since the rows
        # compaction removes most of (shared prefixes) are those with the fewest keys, while every compact query
        # still attends to all of its ancestors; attention work that no kernel removes.
        "attention_pair_ratio": comp["attention_pairs"] / base["attention_pairs"] if base["attention_pairs"] else None,
        **flops_metrics(model_config, base, comp),
        "baseline": base,
        "compact": comp,
    }
    return {**results, "timing_flags": timing_flags(results)}


def _mfu(model_config, step, base, num_devices: int) -> dict[str, float]:
    """The baseline's model-FLOPs utilisation of the bf16 dense peak, both ways (`estimate_model_flops`):
    `baseline_mfu` with attention (MLA and KDA sequence mixing) as the field counts it,
    `baseline_mfu_matmul` over the per-token weight products alone."""
    pairs = int(sum(int(n) * (int(n) + 1) // 2 for n in step.lengths))
    flops = estimate_model_flops(model_config, step.num_semantic_tokens, pairs)
    peak = base["fbg_s"] * num_devices * H200_BF16_PEAK_FLOPS
    total = flops["matmul"] + flops["attention"]
    return {"baseline_model_flops": total, "baseline_matmul_flops": flops["matmul"],
            "baseline_mfu": total / peak, "baseline_mfu_matmul": flops["matmul"] / peak}


def measure_step(args, model, step, device, dtype_name, progress: dict[str, Any]) -> dict[str, Any]:
    """The single-process record of one step; `progress` holds the current phase and the seconds of
    every finished step (kept in the error row if the run fails or is terminated)."""
    from harts.objective.step import DTYPES, run_step
    from harts.planning.microbatch import plan
    from harts.trees.io import check_vocabulary
    from harts.trees.trie import PrefixIndex

    check_vocabulary(step, model.config.vocab_size)
    plans = {
        "baseline": plan(step, args.capacity, 1, planner="per-trajectory"),
        "compact": plan(step, args.capacity, 1, planner=args.planner),
    }
    microbatches = {name: _microbatches(step, p) for name, p in plans.items()}
    index = PrefixIndex.from_step(step)
    requested = requested_blocks(args)
    num_blocks = model.config.num_layers
    configs = _step_configs(args, dtype_name, {k: num_blocks if v in SEARCHED else v for k, v in requested.items()})
    blocks, search = search_recompute_blocks(model, step, microbatches, configs, index, device, requested, progress)
    configs = _step_configs(args, dtype_name, blocks)
    for name in configs:
        progress["phase"] = f"{name} warm-up"
        _warm(model, step, microbatches[name], configs[name], index, progress)

    samples: dict[str, list] = {"baseline": [], "compact": []}
    peaks = {"baseline": 0, "compact": 0}
    infos: dict[str, list] = {}
    for repeat in range(args.repeats):
        for name in EXECUTIONS:
            progress["phase"] = f"{name} {repeat + 1}/{args.repeats}"
            with PeakMemory(device) as memory:
                result = run_step(model, step, microbatches[name], configs[name], index=index,
                                  progress=progress["phase"])
            _phase_done(progress, name, repeat + 1, result.seconds)
            model.zero_grad(set_to_none=True)
            # One process: one rank, and no gradient reduction.
            samples[name].append([{**result.seconds, "grad_reduce": 0.0, "grad_reduction_alone": 0.0}])
            peaks[name] = max(peaks[name], memory.peak)
            infos[name] = result.layout_info

    executions = {
        name: _execution(samples[name], plans[name].plan_seconds, peaks[name], infos[name], microbatches[name])
        for name in EXECUTIONS
    }
    results = _results(model.config, step, index, executions, infos["compact"])
    if search:
        results["recompute_search"] = search
    if device.type == "cuda":
        results.update(_mfu(model.config, step, executions["baseline"], 1))
    if args.no_breakdown:
        results["breakdown_skipped"] = "--no-breakdown"
    else:
        progress["phase"] = "breakdown"
        results["breakdown"] = breakdown(model, step, microbatches, configs, index, device, DTYPES[dtype_name],
                                         executions["baseline"], executions["compact"], results["compression"])
    if args.profile:
        progress["phase"] = "profile"
        results["profile"] = {
            name: profile_microbatch(model, step, max(microbatches[name], key=lambda m: int(step.lengths[m].sum())),
                                     configs[name])
            for name in EXECUTIONS
        }
    return results


# Enough ops that the compact microbatch's extra kernels (gathers, scatter-adds, per-call work) show
# beside the baseline's, not only the GEMMs and attention both share.
PROFILE_TOP = 60


def profile_microbatch(model, step, members, config) -> dict[str, Any]:
    """Forward + backward of one microbatch under torch.profiler: its size (trajectories, semantic
    tokens, the rows the execution ran) and the top `PROFILE_TOP` ops by self device time on CUDA
    (self CPU time on CPU), with their calls."""
    import numpy as np
    from torch.profiler import ProfilerActivity, profile

    from harts.objective.step import run_step

    cuda = next(model.parameters()).device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    subset = step.subset(np.asarray(members))
    with profile(activities=activities) as prof:
        result = run_step(model, subset, [np.arange(len(members))], config)
    model.zero_grad(set_to_none=True)
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:PROFILE_TOP]
    total = sum(getattr(e, key) for e in events)
    return {
        "trajectories": len(members), "semantic_tokens": subset.num_semantic_tokens, "rows": result.num_rows,
        "sorted_by": key, "total_self_ms": total / 1e3,
        "top": [{"name": e.key[:160], "calls": e.count, "self_ms": getattr(e, key) / 1e3} for e in top],
    }


def first_slot(step, microbatches: list, dp: int) -> tuple[Any, list]:
    """The step restricted to the plan's first slot (its first dp microbatches), and those microbatches in it."""
    import numpy as np

    members = microbatches[:dp]
    sizes = np.cumsum([0] + [len(m) for m in members])
    sub = step.subset(np.concatenate(members))
    return sub, [np.arange(sizes[i], sizes[i + 1], dtype=np.int64) for i in range(len(members))]


def speedup_on_rank(groups, model_config, model_seed: int, step, microbatches: dict, configs: dict,
                    repeats: int) -> dict[str, Any] | None:
    """Rank program of `--parallel`: warm-up (a whole step on CUDA, the first slot on CPU), then `repeats` interleaved timed steps of
    both executions. On global rank 0: per execution the per-repeat, per-rank seconds (`samples`), the
    peak memory (maximum over ranks) and the layouts' info of every microbatch; None on other ranks."""
    import torch
    import torch.distributed as dist

    from harts.model.model import HybridModel
    from harts.objective.step import build_layout
    from harts.parallel.model import parallelize
    from harts.parallel.step import run_parallel_step
    from harts.trees.trie import PrefixIndex

    device = groups.device
    with device:
        model = HybridModel(model_config)
    model.init_weights(model_seed)
    pmodel = parallelize(model, groups)
    index = PrefixIndex.from_step(step)
    dp = groups.config.dp
    for name in EXECUTIONS:
        # On CUDA a whole step (Triton autotunes per sequence length); on CPU the first slot.
        if device.type == "cuda":
            run_parallel_step(pmodel, step, microbatches[name], configs[name], index=index)
        else:
            run_parallel_step(pmodel, *first_slot(step, microbatches[name], dp), configs[name])
        model.zero_grad(set_to_none=True)
    samples: dict[str, list] = {name: [] for name in EXECUTIONS}
    peaks = dict.fromkeys(EXECUTIONS, 0)
    for _ in range(repeats):
        for name in EXECUTIONS:
            dist.barrier()
            with PeakMemory(device) as memory:
                result = run_parallel_step(pmodel, step, microbatches[name], configs[name], index=index)
            seconds = dict(result.rank_seconds)
            # The reduction again, alone: the same collectives on gradients of the same sizes.
            dist.barrier()
            _sync(device)
            start = time.perf_counter()
            pmodel.reduce_gradients()
            _sync(device)
            seconds["grad_reduction_alone"] = time.perf_counter() - start
            model.zero_grad(set_to_none=True)
            gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
            dist.gather_object(seconds, gathered, dst=0)
            samples[name].append(gathered)
            peaks[name] = max(peaks[name], memory.peak)
    peak = torch.tensor([peaks[name] for name in EXECUTIONS], dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if dist.get_rank() != 0:
        return None
    infos = {
        name: [build_layout(step, m, model, configs[name], index).info for m in microbatches[name]]
        for name in EXECUTIONS
    }
    return {"samples": samples, "peak_memory_bytes": dict(zip(EXECUTIONS, peak.tolist())), "layout_info": infos}


def measure_parallel_step(args, parallel, model_config, step, dtype_name) -> dict[str, Any] | None:
    """The `--parallel` record's results of one step (None on a torchrun rank other than 0)."""
    from harts.parallel.launch import launch
    from harts.parallel.step import check_microbatches
    from harts.planning.microbatch import plan
    from harts.trees.io import check_vocabulary
    from harts.trees.trie import PrefixIndex

    check_vocabulary(step, model_config.vocab_size)
    parallel.check_model(model_config)
    plans = {
        "baseline": plan(step, args.capacity, parallel.dp, planner="per-trajectory"),
        "compact": plan(step, args.capacity, parallel.dp, planner=args.planner),
    }
    microbatches = {name: _microbatches(step, p) for name, p in plans.items()}
    for name in EXECUTIONS:
        check_microbatches(step, microbatches[name], parallel.dp)
    measured = launch(speedup_on_rank, parallel, model_config, args.model_seed, step, microbatches,
                      _step_configs(args, dtype_name), args.repeats, device=args.device)
    if measured is None:  # a torchrun rank other than 0
        return None
    executions = {
        name: _execution(measured["samples"][name], plans[name].plan_seconds, measured["peak_memory_bytes"][name],
                         measured["layout_info"][name], microbatches[name])
        for name in EXECUTIONS
    }
    index = PrefixIndex.from_step(step)
    results = _results(model_config, step, index, executions, measured["layout_info"]["compact"])
    results["world_size"] = parallel.world_size
    if args.device == "cuda":
        results.update(_mfu(model_config, step, executions["baseline"], parallel.world_size))
    results["breakdown_skipped"] = PARALLEL_BREAKDOWN_SKIPPED
    return results


def _warm(model, step, microbatches, config, index, progress: dict[str, Any]) -> None:
    """Run the microbatches once so kernels compile and autotune outside the timings: every one on
    CUDA (Triton autotune keys include sequence lengths, so a new length tunes again inside a timed
    step), the first one (as a step of its own) on CPU."""
    import numpy as np

    from harts.objective.step import run_step

    if next(model.parameters()).device.type == "cuda":
        result = run_step(model, step, microbatches, config, index=index, progress=progress["phase"])
    else:
        first = next(m for m in microbatches if len(m))
        result = run_step(model, step.subset(first), [np.arange(len(first))], config)
    _phase_done(progress, config.execution, 0, result.seconds)
    model.zero_grad(set_to_none=True)


def _phase_done(progress: dict[str, Any], execution: str, repeat: int, seconds: dict[str, float]) -> None:
    """Keep a finished step's seconds for an error row, and log them live (`progress["log"]`, W&B history:
    repeat 0 is the warm-up; in one process F+B+G is F+B)."""
    progress["finished"].append({"phase": progress["phase"], **seconds})
    if "log" in progress:
        progress["log"]({"repeat": repeat, execution: {**{f"{k}_s": v for k, v in seconds.items()},
                                                       "fbg_s": seconds["forward"] + seconds["backward"]}})


OP_WORK = {"kda": "kda_rows", "kda_one_call": "kda_rows", "kda_one_call_no_replay": "rows",
           "mla": "attention_pairs", "lm_head": "logprob_rows"}
"""The work each of `op_times`' ops scales with (`op_work`), to scale a sample of microbatches to the step."""


def op_work(layout) -> dict[str, int]:
    """A layout's work measures of `OP_WORK`: its rows, the rows of its KDA calls (replay included), its attention's
    (query, key) pairs and the LM head's rows (one per semantic row)."""
    return {"rows": layout.num_rows, "kda_rows": layout.num_kda_rows, "attention_pairs": layout.groups.num_pairs,
            "logprob_rows": len(layout.semantic_rows)}


def breakdown(model, step, microbatches, configs, index, device, dtype, base, comp, compression) -> dict[str, Any]:
    """Where the compact time goes beyond (C/S) × baseline, from op-level times on the real layouts."""
    from harts.objective.step import build_layout

    config = model.config
    num_kda = sum(kind == "kda" for kind in config.layer_kinds())
    num_mla = config.num_layers - num_kda
    totals: dict[str, dict[str, float]] = {}
    sampled: dict[str, float] = {}
    for name in EXECUTIONS:
        sums: dict[str, float] = {}
        nonempty = [m for m in microbatches[name] if len(m)]
        # Op times are measured on evenly spaced microbatches and scaled to the whole step by each op's own
        # work (`op_work`): attention by (query, key) pairs, which grow as the square of a trajectory's length,
        # so a sample's rows say little about them.
        picks = set(range(0, len(nonempty), max(1, -(-len(nonempty) // BREAKDOWN_MICROBATCHES))))
        work_all: dict[str, int] = {}
        work_picked: dict[str, int] = {}
        for k, members in enumerate(nonempty):
            layout = build_layout(step, members, model, configs[name], index)
            for key, value in op_work(layout).items():
                work_all[key] = work_all.get(key, 0) + value
                if k in picks:
                    work_picked[key] = work_picked.get(key, 0) + value
            if k in picks:
                times = op_times(model, layout.to(device), device, dtype, configs[name].logprob_grad_precision)
                for key, value in times.items():
                    sums[key] = sums.get(key, 0.0) + value
        sampled[name] = len(picks) / len(nonempty)
        totals[name] = {key: value * work_all[OP_WORK[key]] / work_picked[OP_WORK[key]] for key, value in sums.items()}
    return {
        **breakdown_terms(totals["baseline"], totals["compact"], num_kda, num_mla, base, comp, compression),
        "sampled_microbatch_fraction": sampled,
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


def run(args: argparse.Namespace) -> int:
    import torch

    from harts.config import config_to_dict
    from harts.model.config import load_model_config_with
    from harts.model.model import HybridModel
    from harts.optim.adamw import Fp32Gradients
    from harts.parallel.config import load_parallel_config
    from harts.parallel.launch import check_torchrun, is_reporting_rank, launched_by_torchrun
    from harts.tracking.records import Terminated, make_record, sigterm_raises, write_records

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    variants = run_variants(args)
    device = torch.device(args.device)
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    params_name = parameter_dtype(args.params, dtype_name, args.parallel)
    model_config = load_model_config_with(args.model, args.experts_backend)
    parallel = load_parallel_config(args.parallel) if args.parallel else None
    check_torchrun(parallel)
    if not is_reporting_rank():
        return _follow_rank_zero(variants, parallel, dtype_name)
    if parallel is None:
        with device:
            model = HybridModel(model_config)
        model.init_weights(args.model_seed)
        if params_name == "bf16":
            model.to(torch.bfloat16)
            Fp32Gradients(model.named_parameters())  # its hooks stay on the parameters for the run
    suffix = f"-{parallel.name}" if parallel else ""
    out = Path(args.out or f"reports/raw/speedup/{model_config.name}{suffix}.json")
    records = []
    # One W&B run per record, opened before the step is measured and logged to while it runs.
    tracker = wandb_log.BenchLogger(wandb_log.options(args))

    def keep(record: dict[str, Any]) -> None:
        records.append(record)
        tracker.finish(record)

    # `timeout` and schedulers stop a long run with SIGTERM: end it as an error row that keeps the
    # phase it reached and the seconds of every step it finished, and write every record.
    terminated = False
    current = None  # (config, progress) of the step being measured, until its row is written
    with sigterm_raises():
        try:
            for index, step, step_meta, run_args in _cases(args, variants):
                case_config = load_model_config_with(args.model, run_args.experts_backend)
                if parallel is None:
                    model.set_experts_backend(case_config.moe.experts_backend)
                config = {
                    "model": model_config.name, "model_config": config_to_dict(case_config), **step_meta,
                    "planner": run_args.planner, "capacity": run_args.capacity, "device": args.device,
                    "dtype": dtype_name, "params": params_name, "recompute": run_args.recompute,
                    "recompute_blocks": run_args.recompute_blocks,
                    "compact_recompute_blocks": compact_recompute_blocks(run_args),
                    "recompute_by_rows": run_args.recompute_by_rows, "keep_attention": run_args.keep_attention,
                    "keep_kda_intermediates": run_args.keep_kda_intermediates,
                    "repeats": run_args.repeats,
                    "parallel": parallel.name if parallel else "single",
                    "world_size": parallel.world_size if parallel else 1,
                    "parallel_config": config_to_dict(parallel) if parallel else None,
                    "attention_backend": run_args.attention_backend,
                    "compact_attention_backend": run_args.compact_attention_backend,
                    "kda_backend": run_args.kda_backend,
                    "logprob_grad_precision": run_args.logprob_grad_precision,
                    "logprob_chunk_rows": run_args.logprob_chunk_rows, "variant": run_args.variant,
                }
                variant = f" (--variant {run_args.variant})" if run_args.variant else ""
                logger.info(f"step {index}{variant}: {step.num_trajectories} trajectories, "
                            f"{step.num_semantic_tokens:,} tokens ...")
                tracker.start("speedup", config)
                progress: dict[str, Any] = {"phase": "planning", "finished": [], "log": tracker.log}
                current = (config, progress)
                try:
                    if parallel is None:
                        results = measure_step(run_args, model, step, device, dtype_name, progress)
                        config.update(found_blocks(results))
                    else:
                        progress["phase"] = f"--parallel {parallel.name}"
                        results = measure_parallel_step(run_args, parallel, case_config, step, dtype_name)
                        # The ranks' timings come back at the end: each repeat's history row then.
                        for repeat, pair in enumerate(zip(*(results[name]["fbg_repeats_s"] for name in EXECUTIONS))):
                            tracker.log({"repeat": repeat + 1, **{name: {"fbg_s": value}
                                                                  for name, value in zip(EXECUTIONS, pair)}})
                    keep(make_record("speedup", config, results))
                    current = None
                except (RuntimeError, ValueError, torch.OutOfMemoryError, Terminated) as error:
                    if current is not None:
                        keep(_error_row(config, progress, error, device))
                        current = None
                    if isinstance(error, Terminated):
                        raise
                    if parallel is not None and launched_by_torchrun():
                        break  # this process is one rank of torchrun's: after a failure the ranks are out of step
                finally:
                    release_memory(device, model if parallel is None else None)
                write_records(records, out)
        except Terminated as error:
            terminated = True
            if current is not None:  # stopped while writing another error's row
                keep(_error_row(*current, error, device))
        write_records(records, out)
    print(format_table(records))
    logger.info(f"wrote {len(records)} record(s) to {out}")
    if args.json:
        print(json.dumps([headline(r) for r in records]))
    tracker.close()
    if terminated:
        return 128 + signal.SIGTERM
    return 0 if all("error" not in r for r in records) else 1


def found_blocks(results: dict[str, Any]) -> dict[str, Any]:
    """The config keys of the blocks `--recompute-blocks auto` found, with `recompute_blocks_auto` naming the
    executions searched; empty without a search."""
    search = results.get("recompute_search")
    if not search:
        return {}
    keys = {"baseline": "recompute_blocks", "compact": "compact_recompute_blocks"}
    return {**{keys[name]: found["recompute_blocks"] for name, found in search.items()},
            "recompute_blocks_auto": sorted(search)}


def run_variants(args: argparse.Namespace) -> list[argparse.Namespace]:
    """The run's settings: `args` itself (variant None), then `args` with each `--variant`'s flags over them,
    each checked before any model is built (ValueError naming the variant)."""
    from harts.objective.step import check_backends, check_keep_attention, check_keep_kda_intermediates
    from harts.ops.kda.compact import default_kda_backend

    overrides = [{"variant": None}, *(args.variant or [])]
    variants = [argparse.Namespace(**{**vars(args), **override}) for override in overrides]
    measured: dict[tuple, str] = {}
    for run_args in variants:
        where = f"--variant {run_args.variant}: " if run_args.variant else ""
        # The same settings measured again would be two records of one configuration (and one step counted
        # twice in the report); more repeats belong in --repeats.
        resolved = {**vars(run_args), "compact_recompute_blocks": compact_recompute_blocks(run_args)}
        settings = tuple(sorted((k, repr(v)) for k, v in resolved.items() if k not in ("variant", "repeats")))
        if settings in measured:
            raise ValueError(f"{where}the same run settings as {measured[settings]} (only repeats differ)")
        measured[settings] = f"--variant {run_args.variant}" if run_args.variant else "the run's own"
        for flag in ("recompute_blocks", "compact_recompute_blocks"):
            value, name = getattr(run_args, flag), f"--{flag.replace('_', '-')}"
            if value is not None and not run_args.recompute:
                raise ValueError(f"{where}{name} needs --recompute")
            if value in SEARCHED and (run_args.device not in AUTO_DEVICES or run_args.parallel):
                raise ValueError(f"{where}{name} {value} searches one GPU's memory: it needs --device cuda and no "
                                 "--parallel")
        if run_args.recompute_by_rows and run_args.recompute_blocks is None:
            raise ValueError(f"{where}--recompute-by-rows scales the kept blocks: it needs --recompute-blocks")
        if run_args.keep_attention and not run_args.recompute:
            raise ValueError(f"{where}--keep-attention needs --recompute")
        try:
            for backend in (run_args.attention_backend, run_args.compact_attention_backend):
                check_backends(backend, run_args.kda_backend)
                check_keep_attention(run_args.recompute, run_args.keep_attention, backend)
            check_keep_kda_intermediates(run_args.recompute, run_args.keep_kda_intermediates,
                                         run_args.kda_backend or default_kda_backend(run_args.device == "cuda"))
        except ValueError as error:
            raise ValueError(f"{where}{error}") from None
    return variants


def _cases(args: argparse.Namespace, variants: list[argparse.Namespace]):
    """(index, step, step meta, settings) of every step of the trees, each with every variant in turn."""
    from harts.trees.sources import iter_steps

    for index, step, step_meta in iter_steps(args.trees, args.seed, args.steps, args.max_trees):
        for run_args in variants:
            yield index, step, step_meta, run_args


def release_memory(device, model=None) -> None:
    """Free what a measured case left (gradients of a case that failed in its backward, a failed case's graph,
    cycles through its traceback, the allocator's cached blocks) so that the next case starts from the weights
    alone."""
    import gc

    import torch

    if model is not None:
        model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def parameter_dtype(requested: str | None, dtype_name: str, parallel: str | None) -> str:
    """The parameters' dtype of a run: `--params`, or bf16 for a bf16 run in one process, else fp32."""
    if requested is None:
        return "bf16" if dtype_name == "bf16" and parallel is None else "fp32"
    if requested == "bf16" and dtype_name != "bf16":
        raise ValueError("--params bf16 needs --dtype bf16 (bf16 parameters under fp32 compute are not a mode)")
    if requested == "bf16" and parallel is not None:
        raise ValueError("--params bf16 is not implemented with --parallel: its gradient reduction works on the "
                         "parameters' .grad, which the fp32 accumulation frees")
    return requested


def _follow_rank_zero(variants, parallel, dtype_name) -> int:
    """A torchrun rank other than 0: its part of every step's and variant's `--parallel` run, nothing printed or
    written (rank 0 writes the records); it stops at a failure, as rank 0 does, with one line."""
    import torch

    from harts.model.config import load_model_config_with
    from harts.parallel.launch import RankFailed

    try:
        for _, step, _, run_args in _cases(variants[0], variants):
            case_config = load_model_config_with(run_args.model, run_args.experts_backend)
            try:
                measure_parallel_step(run_args, parallel, case_config, step, dtype_name)
            finally:
                release_memory(torch.device(run_args.device))
    except RankFailed as error:
        print_error(str(error))
        return 1
    return 0


HEADLINE_KEYS = ("semantic_tokens", "compact_tokens", "compression", "fbg_speedup", "core_speedup", "efficiency")


def _error_row(config: dict[str, Any], progress: dict[str, Any], error: BaseException, device) -> dict[str, Any]:
    import torch

    from harts.tracking.records import error_message, make_record

    if device.type == "cuda":
        torch.cuda.empty_cache()
    message = f"{progress['phase']}: {error_message(error)}"
    logger.error(message)
    if os.environ.get("HARTS_DEBUG"):
        traceback.print_exc()
    return {**make_record("speedup", config, error=message), "finished_steps": progress["finished"]}


def headline(record: dict[str, Any]) -> dict[str, Any]:
    config = record["config"]
    summary = {"step": config.get("step"), "model": config["model"], "parallel": config.get("parallel")}
    if "error" in record:
        return {**summary, **{k: None for k in HEADLINE_KEYS}, "error": record["error"]}
    return {**summary, **{k: record["results"][k] for k in HEADLINE_KEYS}}


def format_table(records: list[dict[str, Any]]) -> str:
    lines = [
        "| step | parallel | S | C | S/C | baseline F+B+G s | compact F+B+G s | F/B/Grad speedup | Core speedup | "
        "efficiency |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for record in records:
        step, parallel = record["config"].get("step"), record["config"].get("parallel")
        if "error" in record:
            lines.append(f"| {step} | {parallel} | error: {record['error']} | | | | | | | |")
            continue
        r = record["results"]
        lines.append(
            f"| {step} | {parallel} | {r['semantic_tokens']:,} | {r['compact_tokens']:,} | {r['compression']:.2f} | "
            f"{r['baseline']['fbg_s']:.2f} | {r['compact']['fbg_s']:.2f} | {r['fbg_speedup']:.2f}x | "
            f"{r['core_speedup']:.2f}x | {r['efficiency']:.2f}{' (flagged)' if r.get('timing_flags') else ''} |"
        )
    lines.append(
        f"| paper | 8 GPUs | | | {PAPER['compression']:.2f} | | | {PAPER['speedup']:.2f}x | | "
        f"{PAPER['efficiency']:.2f} |"
    )
    lines += [f"flagged: step {record['config'].get('step')}, {record['config'].get('parallel')}: {flag}"
              for record in records for flag in record.get("results", {}).get("timing_flags", [])]
    return "\n".join(lines)
