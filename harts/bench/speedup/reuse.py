"""A step's baseline measured once and reused by the later cases of the step whose baseline would run the same
(`BaselineReuse`; off with `--no-reuse-baseline`): a `--variant` that changes only the compact execution (its own
flags, `COMPACT_ONLY`, the planner, kda_calls, or the memory margin where the baseline's blocks are not
searched) takes the baseline of the first case of the step that measured it (`ReusedBaseline`: its times and
samples, peak memory, `--recompute-blocks auto` search record, the breakdown's baseline op times and the baseline's
profile) and measures the compact execution alone.

Invariant: two cases of a step share a baseline only when their `baseline_settings` are equal: the baseline engine's
StepConfig as `executions.step_configs` builds it for `measure_step` and the parallel step (every execution knob
that reaches the baseline is in it, one added later too) but the fields its measurement does not read
(`unread_by_baseline`), its recompute_blocks as requested (`auto` stands for the search), and every other setting of
the case but `COMPACT_ONLY` and the variant's text (`repeats`; the run's own flags, the same in every case). A
baseline that was searched is also shared, without its search record, with a later case that gives the blocks found.
Only a case that wrote results is a source: after an error row, the next case with its settings measures its own
baseline. Tested in tests/bench/speedup/test_reuse.py (a spy counting the baseline's steps and searches; every run
flag changed one at a time).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from harts.bench.speedup.executions import EXECUTIONS, requested_blocks, step_configs
from harts.bench.speedup.recompute import SEARCHED
from harts.config.execution import FIELDS

COMPACT_ONLY = ("compact_recompute_blocks", "compact_attention_backend")
"""The run flags that reach the compact execution alone (`executions.knobs_of` and `executions.requested_blocks`
give them to it, never to the baseline): a variant changing only these reuses the baseline. Every other run flag
changes `baseline_settings` but where the baseline does not read it (`unread_by_baseline`; tests/bench/speedup/
test_reuse.py changes each, one at a time)."""
THE_RUNS_OWN = "the run's own"


def unread_by_baseline(blocks: int | str | None) -> tuple[str, ...]:
    """The fields of the baseline's StepConfig that its measurement does not read, with its recompute_blocks
    `blocks` as requested: the planner (the command plans the baseline per-trajectory whatever `--planner` says:
    measure.py, parallel.py), kda_calls (the baseline's KDA is one packed call, no planned calls) and,
    unless its blocks are searched, the memory margin (only the search of the recomputed blocks reads it)."""
    unread = ("planner", "kda_calls")
    return unread if blocks in SEARCHED else (*unread, "memory_margin")


def case_name(source: str | None) -> str:
    """A case as the log and the printed table name it: the run's own (source None or THE_RUNS_OWN), or its
    `--variant` text."""
    return THE_RUNS_OWN if source in (None, THE_RUNS_OWN) else f"--variant {source}"


@dataclass(frozen=True)
class ReusedBaseline:
    """An earlier case's baseline measurement of the step."""

    source: str
    """The case that measured it: THE_RUNS_OWN or its `--variant` text (the record's `results.baseline_reused_from`)."""
    execution: dict[str, Any]
    """Its `results.baseline`."""
    search: dict[str, Any] | None = None
    """Its `results.recompute_search.baseline`, where it searched and the case reusing it asks `auto` too."""
    op_seconds: tuple[dict[str, float], float] | None = None
    """Its breakdown's baseline op seconds and sampled microbatch fraction (None without a breakdown)."""
    profile: dict[str, Any] | None = None
    """Its `results.profile.baseline` (with `--profile`)."""


def measured_executions(reused: ReusedBaseline | None) -> tuple[str, ...]:
    """The executions a case measures itself: both, or the compact one where it reuses a baseline."""
    return EXECUTIONS if reused is None else ("compact",)


def baseline_settings(run_args, dtype_name: str, found_blocks: int | None = None) -> tuple:
    """What a case's baseline measurement depends on, comparable between cases: the baseline's StepConfig
    (`executions.step_configs`) but `unread_by_baseline`, with its recompute_blocks as requested (`auto`), or
    `found_blocks` (those a search found), and every other setting of `run_args` but `COMPACT_ONLY` and the variant's
    text."""
    blocks = requested_blocks(run_args)["baseline"] if found_blocks is None else found_blocks
    config = step_configs(run_args, dtype_name, {"baseline": 1 if blocks in SEARCHED else blocks},
                          names=("baseline",))["baseline"]
    unread = unread_by_baseline(blocks)
    engine = {**{k: v for k, v in dataclasses.asdict(config).items() if k not in unread}, "recompute_blocks": blocks}
    others = {name: value for name, value in vars(run_args).items()
              if name not in (*FIELDS, *COMPACT_ONLY, "variant")}
    return tuple(tuple(sorted((k, repr(v)) for k, v in part.items())) for part in (engine, others))


class BaselineReuse:
    """The baselines measured so far in the step being run, by `baseline_settings`; none when not `enabled`."""

    def __init__(self, enabled: bool, dtype_name: str) -> None:
        self.enabled = enabled
        self.dtype_name = dtype_name
        self._step: int | None = None
        self._measured: dict[tuple, ReusedBaseline] = {}

    def find(self, index: int, run_args) -> ReusedBaseline | None:
        """The baseline of an earlier case of step `index` that this case's (`run_args`) would measure again, or
        None: measure it."""
        if not self.enabled:
            return None
        if index != self._step:  # the cases run step after step: a baseline is its own step's
            self._step, self._measured = index, {}
        return self._measured.get(baseline_settings(run_args, self.dtype_name))

    def keep(self, index: int, run_args, results: dict[str, Any]) -> None:
        """After a case of step `index` (`find` asked first) wrote `results`: its baseline, unless one was kept for
        its settings (the one it reused)."""
        if not self.enabled:
            return
        assert index == self._step, "find(index, ...) comes first"
        key = baseline_settings(run_args, self.dtype_name)
        if key in self._measured:
            return
        source = run_args.variant or THE_RUNS_OWN
        search = results.get("recompute_search", {}).get("baseline")
        breakdown = results.get("breakdown")
        ops = None if breakdown is None else (breakdown["op_seconds"]["baseline"],
                                              breakdown["sampled_microbatch_fraction"]["baseline"])
        profile = results.get("profile", {}).get("baseline")
        self._measured[key] = ReusedBaseline(source, results["baseline"], search, ops, profile)
        if search is not None:
            # A later case giving the blocks found runs the same baseline engine; it searched nothing itself.
            found = baseline_settings(run_args, self.dtype_name, search["recompute_blocks"])
            self._measured.setdefault(found, ReusedBaseline(source, results["baseline"], None, ops, profile))
