"""`harts bench ...`: benchmarks that write JSON records.

Each benchmark lives in its own module with a `register(subcommands)` function, listed in
`_COMMAND_MODULES`.
"""

from __future__ import annotations

import argparse
import importlib

_COMMAND_MODULES: tuple[str, ...] = (
    "harts.bench.trees", "harts.bench.kda_calls", "harts.bench.planning", "harts.bench.planning_grpo",
    "harts.bench.kda_handoff",
    "harts.bench.speedup.cli", "harts.bench.attention", "harts.bench.fidelity", "harts.bench.conv_tiles",
    "harts.bench.routing",
    "harts.integrations.trl_bench",
)


def register(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="run benchmarks (JSON records)")
    sub = bench.add_subparsers(dest="bench_command", required=True, metavar="SUBCOMMAND")
    for module in _COMMAND_MODULES:
        importlib.import_module(module).register(sub)
