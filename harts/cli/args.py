"""Argument types shared by the `harts` subcommands (no heavy imports: `harts trees` and `harts plan` start fast)."""

from __future__ import annotations

import argparse


def index_list(text: str) -> list[int]:
    """argparse type of `--steps 0,3,7`: comma-separated non-negative integers, at least one."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative step indices, got {text!r}")
    return values
