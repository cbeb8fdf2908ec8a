"""The `harts` command line.

Each subcommand lives in a module of `harts.cli` that registers its parser; heavy packages
(torch, fla, megatron) are imported inside the command functions that need them, so
`harts trees ...` and `harts plan ...` start fast. User errors (ValueError, OSError, a missing optional package:
harts.extras.MissingExtra) print one line, `harts: error: ...`, and exit with status 2; set HARTS_DEBUG=1 to see the
traceback. Usage errors (a bad option value, a missing argument) print one such line too, naming the command.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from harts import __version__
from harts.args import print_error
from harts.cli import bench as bench_cli
from harts.cli import export as export_cli
from harts.cli import model as model_cli
from harts.cli import plan as plan_cli
from harts.cli import rl as rl_cli
from harts.cli import train as train_cli
from harts.cli import train_loop as train_loop_cli
from harts.cli import trees as trees_cli
from harts.extras import MissingExtra
from harts.files import check_outputs, output_locks


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors: `harts: error: COMMAND: MESSAGE (see ... --help)`.

    Subcommand parsers are of the same class (add_subparsers builds them with type(parent)). `innermost` is the last
    parser that parsed (the subcommand's), so that an unknown option points to the subcommand's help.
    """

    innermost: _Parser | None = None

    def parse_known_args(self, args=None, namespace=None):
        _Parser.innermost = self
        return super().parse_known_args(args, namespace)

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
    export_cli.register(commands)
    model_cli.register(commands)
    rl_cli.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    _Parser.innermost = None
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        (_Parser.innermost or parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    standard_output = sys.stdout
    if standard_output is not None:
        sys.stdout = _StandardOutput(standard_output)
    try:
        return _run(args)
    finally:
        if isinstance(sys.stdout, _StandardOutput):
            sys.stdout = standard_output


def _run(args: argparse.Namespace) -> int:
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
            status = int(args.run(args) or 0)
        _flush_standard_output()
        return status
    except (ValueError, OSError, MissingExtra) as error:
        if os.environ.get("HARTS_DEBUG"):
            raise
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print_error(message)
        return 2
    except KeyboardInterrupt:
        print("harts: interrupted", file=sys.stderr)
        return 130


class _StandardOutput:
    """sys.stdout whose write errors (a full disk, a closed pipe) name it; after one, nothing more is written."""

    def __init__(self, stream) -> None:
        self._stream = stream
        self._failed = False

    def write(self, text: str) -> int:
        return self._guard(self._stream.write, text)

    def flush(self) -> None:
        self._guard(self._stream.flush)

    def _guard(self, operation, *args):
        if self._failed:
            return 0
        try:
            return operation(*args)
        except OSError as error:
            self._failed = True
            # What is still buffered would fail again when Python flushes it at exit (an ignored-exception traceback).
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())
            raise OSError(f"could not write to standard output ({error.strerror})") from None

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _flush_standard_output() -> None:
    """Flush stdout inside the command's error handling rather than at exit."""
    if sys.stdout is not None:
        sys.stdout.flush()
