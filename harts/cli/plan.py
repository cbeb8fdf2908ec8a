"""`harts plan ...`: microbatch planning and linear-attention call planning (no torch).

Each planning command lives in its own module with a `register(subcommands)` function,
listed in `_COMMAND_MODULES`.
"""

from __future__ import annotations

import argparse
import importlib

_COMMAND_MODULES: tuple[str, ...] = ("harts.cli.plan_kda", "harts.cli.plan_microbatches")


def register(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser("plan", help="plan microbatches or linear-attention calls")
    sub = plan.add_subparsers(dest="plan_command", required=True, metavar="SUBCOMMAND")
    for module in _COMMAND_MODULES:
        importlib.import_module(module).register(sub)
