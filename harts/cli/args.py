"""Argument types shared by the `harts` subcommands (no heavy imports: `harts trees` and `harts plan` start fast).

Numeric options are checked when parsed (argparse's `int`/`float` take "nan", "inf" and negatives),
so a bad value stops the command with `harts: error: ...` before any work. Tested in
tests/cli/test_args.py.
"""

from __future__ import annotations

import argparse
import math


def index_list(text: str) -> list[int]:
    """argparse type of `--steps 0,3,7`: comma-separated non-negative integers, at least one."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative step indices, got {text!r}")
    return values


def positive_int(text: str) -> int:
    """argparse type of a count or size: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type of a seed: an integer >= 0 (numpy's seeds are non-negative)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse type of a duration: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type of a coefficient or clip ratio: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def non_finite_fields(value, prefix: str = "") -> list[str]:
    """`field = value` for every number in nested dicts/lists of `value` that is NaN or infinite."""
    if isinstance(value, dict):
        return [f for key, inner in value.items() for f in non_finite_fields(inner, f"{prefix}{key}.")]
    if isinstance(value, (list, tuple)):
        return [f for i, inner in enumerate(value) for f in non_finite_fields(inner, f"{prefix}{i}.")]
    if isinstance(value, float) and not math.isfinite(value):
        return [f"{prefix.rstrip('.')} = {value}"]
    return []
