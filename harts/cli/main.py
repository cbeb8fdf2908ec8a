"""The `harts` command line.

Each subcommand lives in a module of `harts.cli` that registers its parser; heavy packages
(torch, fla, megatron) are imported inside the command functions that need them, so
`harts trees ...` and `harts plan ...` start fast. User errors (ValueError, OSError, a missing optional package:
harts.extras.MissingExtra) print one line, `harts: error: ...`, and exit with status 2; set HARTS_DEBUG=1 to see the
traceback. Usage errors (a bad option value, a missing argument) print one such line too, naming the command.
"""

from __future__ import annotations

import argparse
import os
import sys

from harts import __version__
from harts.cli import bench as bench_cli
from harts.cli import plan as plan_cli
from harts.cli import rl as rl_cli
from harts.cli import train as train_cli
from harts.cli import train_loop as train_loop_cli
from harts.cli import trees as trees_cli
from harts.cli.args import print_error
from harts.extras import MissingExtra
from harts.files import check_outputs, output_locks


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors: `harts: error: COMMAND: MESSAGE (see ... --help)`.

    Subcommand parsers are of the same class (add_subparsers builds them with type(parent)).
    """

    def error(self, message: str) -> None:
        command = self.prog.removeprefix("harts").strip()
        self.exit(2, f"harts: error: {command + ': ' if command else ''}{message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="harts", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"harts {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    trees_cli.register(commands)
    plan_cli.register(commands)
    bench_cli.register(commands)
    train_cli.register(commands)
    train_loop_cli.register(commands)
    rl_cli.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        command, outputs = "harts", []
        if hasattr(args, "files"):
            # Before any work: a command never writes over one of its own inputs, nor beside another writer.
            outputs, inputs = args.files(args)
            words = [args.command, getattr(args, f"{args.command}_command", None)]
            command = " ".join(["harts", *filter(None, words)])
            check_outputs(command, outputs, inputs)
        # Under torchrun every rank runs this; rank 0 alone writes (and locks) the outputs.
        with output_locks(command, outputs if os.environ.get("RANK", "0") == "0" else []):
            return int(args.run(args) or 0)
    except (ValueError, OSError, MissingExtra) as error:
        if os.environ.get("HARTS_DEBUG"):
            raise
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print_error(message)
        return 2
    except KeyboardInterrupt:
        print("harts: interrupted", file=sys.stderr)
        return 130
