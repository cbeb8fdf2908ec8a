"""Optional dependencies: which extra of `pip install harts[...]` provides each, and one clear error without it.

The core (torch, numpy, PyYAML, tqdm, safetensors, tokenizers, fla-core) is all `harts.api`, training and planning
need; benchmarks, reports, the pipeline and W&B import their packages only where they are used, through
`require`, which raises `MissingExtra` (a ModuleNotFoundError naming the extra; the CLI prints it as one line).
Tested in tests/test_extras.py against pyproject's extras.
"""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRAS = {"ortools": "bench", "matplotlib": "bench", "wandb": "wandb", "snakemake": "pipeline", "trl": "trl"}
"""Top-level package -> the extra that installs it."""


class MissingExtra(ModuleNotFoundError):
    """An optional package is not installed."""


def require(module: str, purpose: str) -> ModuleType:
    """`import module` (a dotted name under one of EXTRAS), or MissingExtra saying what needs it and how to
    install it."""
    package = module.split(".")[0]
    assert package in EXTRAS, package
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name is None or error.name.split(".")[0] != package:
            raise
        raise MissingExtra(f"{purpose} needs {package}, which is not installed: pip install 'harts[{EXTRAS[package]}]'",
                           name=package) from None
