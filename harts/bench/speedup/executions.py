"""The two executions a speedup record compares (`EXECUTIONS`: the per-trajectory baseline, then the compact
execution) and what each runs: its StepConfig from the run flags (its microbatches are `Plan.members`).

Both executions get the same settings except two the compact one may have of its own: `--compact-attention-backend`
and `--compact-recompute-blocks` (`compact_recompute_blocks`: the baseline's where not given). Tested in
tests/bench/speedup/test_run.py.
"""

from __future__ import annotations

from harts.bench.speedup.recompute import SEARCHED
from harts.config.execution import FIELDS, ExecutionConfig

EXECUTIONS = ("baseline", "compact")
RUN_KNOBS = tuple(name for name in FIELDS if name not in ("execution", "dtype"))
"""The execution knobs of a run (harts.config.execution): every one but the execution (both run) and the dtype
(the weights' and the compiled kernels': a run flag of its own)."""
RECORD_KNOBS = tuple(name for name in RUN_KNOBS if name != "experts_backend")
"""The run knobs a speedup record's config names as they are given: every one but the experts backend, which the
record's model_config holds (its moe.experts_backend, the flag's override applied)."""


def knobs_of(args, name: str, recompute_blocks: int | str | None = None):
    """The execution config of one execution (`name`) from the run flags: the compact execution's own attention
    backend, and `recompute_blocks` (a search's AUTO stands for blocks not yet known: checked as one block)."""
    knobs = {field: getattr(args, field) for field in RUN_KNOBS if field != "recompute_blocks"}
    if name == "compact" and args.compact_attention_backend is not None:
        knobs["attention_backend"] = args.compact_attention_backend
    knobs["recompute_blocks"] = 1 if recompute_blocks in SEARCHED else recompute_blocks
    return ExecutionConfig(execution=name, dtype=args.dtype, **knobs)


def step_configs(args, dtype_name: str, blocks: dict[str, int | None] | None = None,
                 names: tuple[str, ...] = EXECUTIONS) -> dict:
    """The StepConfig of each execution of `names` (default: both); `blocks`: its recompute_blocks (default: the
    flags')."""
    from harts.objective.step import step_config

    blocks = blocks or requested_blocks(args)
    return {name: step_config(knobs_of(args, name, blocks[name]), args.device, dtype=dtype_name,
                              recompute_blocks=blocks[name])
            for name in names}


def compact_recompute_blocks(args) -> int | str | None:
    """The compact execution's recompute_blocks: --compact-recompute-blocks where given, else --recompute-blocks."""
    return args.recompute_blocks if args.compact_recompute_blocks is None else args.compact_recompute_blocks


def requested_blocks(args) -> dict[str, int | str | None]:
    """Each execution's recompute_blocks as the flags give them (an int, None: every block, or AUTO)."""
    return {"baseline": args.recompute_blocks, "compact": compact_recompute_blocks(args)}
