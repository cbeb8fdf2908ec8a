"""`--recompute-blocks auto` and `--compact-recompute-blocks auto|within-baseline`: which executions are searched,
and in what order (`search_executions`: each by its engine's `fit_recompute_blocks`, harts.engine, the baseline
first), `within-baseline` also asking a compact step to peak no higher than a baseline step at its own blocks
(`_baseline_peak`); the checks of these flags (`check_recompute_flags`) and the config keys of the blocks found
(`found_blocks`). The search itself, with its memory margin (`--memory-margin`), is the engine's
(harts.engine_memory).

Tested in tests/bench/speedup/test_recompute.py against simulated memory on the CPU (harts.config.execution's
`SEARCH_DEVICES` widened).
"""

from __future__ import annotations

from typing import Any

from harts.config import execution
from harts.config.execution import AUTO

WITHIN_BASELINE = "within-baseline"
SEARCHED = (AUTO, WITHIN_BASELINE)


def check_recompute_flags(run_args, where: str) -> None:
    """--recompute-blocks and --compact-recompute-blocks of one run's settings: each needs --recompute, and a search
    needs one process on a `SEARCH_DEVICES` device (ValueError, its message prefixed by `where`)."""
    for flag in ("recompute_blocks", "compact_recompute_blocks"):
        value, name = getattr(run_args, flag), f"--{flag.replace('_', '-')}"
        if value is not None and not run_args.recompute:
            raise ValueError(f"{where}{name} needs --recompute")
        if value in SEARCHED and (run_args.device not in execution.SEARCH_DEVICES or run_args.parallel):
            raise ValueError(f"{where}{name} {value} searches one GPU's memory: it needs --device cuda and no "
                             "--parallel")


def search_executions(engines: dict, step, planned: dict, requested: dict[str, Any], progress: dict[str, Any],
                      found: dict[str, Any] | None = None) -> dict[str, Any]:
    """Search each execution `requested` as AUTO or WITHIN_BASELINE with its engine (`Engine.fit_recompute_blocks`,
    which sets the engine's blocks), the baseline first; per execution searched, the search's record, with
    WITHIN_BASELINE also "baseline_probe" (the untimed baseline step that measured the peak to stay within, or
    None: the baseline's own search did), after the records of `found` (an earlier case's search of a baseline
    reused here, which within-baseline takes as the baseline's own). ValueError naming the flag and the execution
    when one does not fit."""
    search: dict[str, Any] = dict(found or {})
    for name, value in requested.items():  # the baseline first: within-baseline needs its blocks
        if value not in SEARCHED:
            continue
        within_bytes, baseline_probe = None, None
        if value == WITHIN_BASELINE:
            within_bytes, baseline_probe = _baseline_peak(engines, step, planned, search, progress)

        def on_probe(n: int, name: str = name) -> None:
            progress["phase"] = f"{name} memory search ({n} blocks recomputed)"

        try:
            search[name] = engines[name].fit_recompute_blocks(step, planned[name], within_bytes=within_bytes,
                                                              within="the baseline's peak", on_probe=on_probe)
        except ValueError as error:
            flag = "--compact-recompute-blocks" if value == WITHIN_BASELINE else "--recompute-blocks"
            raise ValueError(f"{flag} {value}: the {name} execution: {error}") from None
        if value == WITHIN_BASELINE:
            search[name]["baseline_probe"] = baseline_probe
    return search


def _baseline_peak(engines: dict, step, planned: dict, search: dict[str, Any], progress: dict[str, Any]) -> tuple:
    """The peak memory of a baseline step at its blocks and the probe that measured it: its search's probe at the
    blocks found (probe None), else one untimed step (`Engine.probe`) at the baseline's given blocks."""
    if "baseline" in search:
        found = search["baseline"]["recompute_blocks"]
        return next(p["peak_memory_bytes"] for p in search["baseline"]["probes"]
                    if p["recompute_blocks"] == found and p["fits"]), None
    progress["phase"] = "baseline peak memory"
    baseline = engines["baseline"]
    probe = baseline.probe(step, planned["baseline"], baseline.config.recompute_blocks)
    if not probe["fits"]:
        raise ValueError("--compact-recompute-blocks within-baseline: the baseline execution does not fit in memory "
                         "at its own blocks, so it has no peak to stay within")
    return probe["peak_memory_bytes"], probe


def found_blocks(results: dict[str, Any]) -> dict[str, Any]:
    """The config keys of the blocks `--recompute-blocks auto` found, with `recompute_blocks_auto` naming the
    executions searched; empty without a search."""
    search = results.get("recompute_search")
    if not search:
        return {}
    keys = {"baseline": "recompute_blocks", "compact": "compact_recompute_blocks"}
    return {**{keys[name]: found["recompute_blocks"] for name, found in search.items()},
            "recompute_blocks_auto": sorted(search)}
