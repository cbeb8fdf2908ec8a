"""What `harts bench speedup` prints and keeps of its records: the headline figures of `--json` (`headline`), the
Markdown table with the paper's row, the flagged timings and the reused baselines (`format_table`), and the record
of a failed case (`error_row`: the phase it reached, the error's first line and the seconds of every step it
finished), so that a failure is a row, never a gap. Tested in tests/bench/speedup/test_records.py and test_run.py.
"""

from __future__ import annotations

import logging
import os
import traceback
from typing import Any

from harts.bench.speedup.reuse import case_name

logger = logging.getLogger(__name__)

# The paper's figures (DESIGN §6), the last row of the table and beside ours in the report.
PAPER = {"compression": 5.62, "speedup": 4.81, "efficiency": 4.81 / 5.62}
# The figures `--json` prints of each record.
HEADLINE_KEYS = ("semantic_tokens", "compact_tokens", "compression", "fbg_speedup", "core_speedup", "efficiency")


def headline(record: dict[str, Any]) -> dict[str, Any]:
    """A record's step, model, parallel configuration and `HEADLINE_KEYS` (None in an error row, with its error)."""
    config = record["config"]
    summary = {"step": config.get("step"), "model": config["model"], "parallel": config.get("parallel")}
    if "error" in record:
        return {**summary, **{k: None for k in HEADLINE_KEYS}, "error": record["error"]}
    return {**summary, **{k: record["results"][k] for k in HEADLINE_KEYS}}


def format_table(records: list[dict[str, Any]]) -> str:
    """The records as a Markdown table, the paper's row last, then a line per timing flag and per record whose
    baseline is an earlier case's (`results.baseline_reused_from`)."""
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
    lines += [f"baseline reused: step {record['config'].get('step')}, {record['config'].get('parallel')}, "
              f"{case_name(record['config'].get('variant'))}: the baseline of {case_name(source)}, not measured again"
              for record in records if (source := record.get("results", {}).get("baseline_reused_from"))]
    return "\n".join(lines)


def error_row(config: dict[str, Any], progress: dict[str, Any], error: BaseException, device) -> dict[str, Any]:
    """The record of a case that failed in `progress`'s phase, logged as one line (a traceback with HARTS_DEBUG)."""
    import torch

    from harts.tracking.records import error_message, make_record

    if device.type == "cuda":
        torch.cuda.empty_cache()
    message = f"{progress['phase']}: {error_message(error)}"
    logger.error(message)
    if os.environ.get("HARTS_DEBUG"):
        traceback.print_exc()
    return {**make_record("speedup", config, error=message), "finished_steps": progress["finished"]}
