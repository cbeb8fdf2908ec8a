"""The two executions a speedup record compares (`EXECUTIONS`: the per-trajectory baseline, then the compact
execution) and what each runs: its microbatches as positions in the step, and its StepConfig from the run flags.

Both executions get the same settings except two the compact one may have of its own: `--compact-attention-backend`
and `--compact-recompute-blocks` (`compact_recompute_blocks`: the baseline's where not given). Tested in
tests/bench/speedup/test_run.py.
"""

from __future__ import annotations

EXECUTIONS = ("baseline", "compact")


def step_microbatches(step, plan) -> list:
    """Each microbatch of `plan` as the positions of its trajectories in `step`."""
    import numpy as np

    position = {trajectory_id: k for k, trajectory_id in enumerate(step.ids)}
    return [np.asarray([position[t] for t in mb.trajectory_ids], dtype=np.int64) for mb in plan.microbatches]


def step_configs(args, dtype_name: str, blocks: dict[str, int | None] | None = None) -> dict:
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
