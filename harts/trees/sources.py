"""Where steps come from: generated from a trees config, or read from a step path (the benchmarks; harts train's
`StepSource` tells the two apart with `is_config`).

`iter_steps(trees, seed, steps)` yields (step_index, Step, description) for `trees` being a
trees config, a `configs/trees/*.yaml` path or a shipped config's NAME (each requested step
generated deterministically from the seed), or a step on disk (a .jsonl/.jsonl.gz/.npz file or a
directory: one step, index 0). `first_trees(step, max_trees)` keeps a step's first task trees.
Tested in tests/trees/test_sources.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any


def is_config(trees: str) -> bool:
    """A YAML path, or a bare NAME (no suffix, no folder) that is no step on disk: a shipped trees config."""
    path = Path(trees)
    return path.suffix in (".yaml", ".yml") or (not path.suffix and len(path.parts) == 1 and not path.exists())


def first_trees(step, max_trees: int | None):
    """The step restricted to its first `max_trees` task trees (in the order they first appear), or the
    step itself: a slice of the same shape, for measurements that cannot afford a whole step."""
    import numpy as np

    if max_trees is None:
        return step
    chosen, keep = [], []
    for k, tree in enumerate(step.trees):
        if tree not in chosen:
            if len(chosen) == max_trees:
                continue
            chosen.append(tree)
        keep.append(k)
    return step.subset(np.asarray(keep))


def iter_steps(trees: str, seed: int, steps: list[int] | None,
               max_trees: int | None = None) -> Iterator[tuple[int, Any, dict[str, Any]]]:
    from harts.config import config_to_dict, load_config, shipped_config_path
    from harts.trees.io import read_step
    from harts.trees.synth import SynthConfig, generate_step

    sliced = {"max_trees": max_trees} if max_trees is not None else {}
    if is_config(trees):
        synth = load_config(shipped_config_path(trees, "trees"), SynthConfig)
        indices = steps if steps is not None else [0]
        beyond = [i for i in indices if i >= synth.num_steps]
        if beyond:
            raise ValueError(f"{trees}: step {beyond[0]} is beyond num_steps = {synth.num_steps}")
        for index in indices:
            yield index, first_trees(generate_step(synth, seed, index), max_trees), {
                "trees": trees, "seed": seed, "step": index, "synth": config_to_dict(synth), **sliced,
            }
    else:
        if steps not in (None, [0]):
            raise ValueError(f"{trees}: a step path holds one step; --steps applies to a trees config")
        yield 0, first_trees(read_step(trees), max_trees), {"trees": trees, "step": 0, **sliced}
