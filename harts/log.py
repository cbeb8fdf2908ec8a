"""The `harts` logger: the notes and warnings the library writes for a person, one line each on stderr.

Modules log through `logging.getLogger(__name__)` (children of `harts`). The `harts` logger has one handler of its
own that writes `harts: MESSAGE` (INFO), `harts: warning: MESSAGE` (WARNING) or `harts: error: MESSAGE` to the
current `sys.stderr` in one write (the ranks of a torchrun job share the stream), and does not propagate, so an
application's root configuration does not print each line twice. An application that routes everything through
its own handlers calls `propagate_to_root()`; `logging.getLogger("harts").setLevel(logging.WARNING)` silences
the notes.
"""

from __future__ import annotations

import logging
import sys

ROOT = "harts"


class _StderrHandler(logging.Handler):
    """Writes to whatever sys.stderr is when a record is emitted (pytest's capture, a redirected stream)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # logging must never fail the caller
            self.handleError(record)


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno <= logging.INFO else f"{record.levelname.lower()}: "
        return f"{ROOT}: {level}{record.getMessage()}"


_handler = _StderrHandler()
_handler.setFormatter(_Formatter())
_logger = logging.getLogger(ROOT)
_logger.addHandler(_handler)
_logger.setLevel(logging.INFO)
_logger.propagate = False


def propagate_to_root() -> None:
    """Drop the `harts` logger's own handler and pass its records to the root logger's handlers."""
    _logger.removeHandler(_handler)
    _logger.propagate = True
