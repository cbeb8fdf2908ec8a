"""The data steps of a training run: generated from a trees config or read from step files.

`StepSource(trees, seed, vocab_size)` holds `num_steps` data steps and returns step i with
`step(i)` (generated or read when asked, so a run holds one step at a time):
- a trees config (a shipped NAME or a YAML path): `num_steps` of the config, step i generated
  deterministically by `harts.trees.synth.generate_step(config, seed, i)`;
- a directory of `step_NNN.npz` / `.jsonl` / `.jsonl.gz` files (what `harts trees synth` writes):
  one step per file, numbered 0..M-1 without gaps; any other step-format file in it is an error,
  not skipped;
- any other step path (a file, or a directory of other step files): one step (`read_step`).
Token ids are checked against the model's vocabulary. `digests()` identifies each data step by
content (sha256 of the file, or of the generator's config, seed and index), which a resume compares
with the run's.

`epoch_order(num_steps, shuffle)` is the order in which an epoch visits them: in order, or a
permutation drawn from torch's global RNG (whose state checkpoints keep). Tested in
tests/training/test_data.py.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import torch

from harts.config import config_to_dict, load_config, shipped_config_path
from harts.trees.io import JSONL_SUFFIXES, NPZ_SUFFIX, read_step, step_files
from harts.trees.sources import is_config
from harts.trees.step import Step
from harts.trees.synth import SynthConfig, generate_step

STEP_FILE = re.compile(r"step_(\d+)(\.npz|\.jsonl|\.jsonl\.gz)")


class StepSource:
    """The data steps named by `trees` (see the module docstring)."""

    def __init__(self, trees: str, seed: int, vocab_size: int) -> None:
        self.trees, self.seed, self.vocab_size = trees, seed, vocab_size
        self.synth = None
        self.files: list[Path] = []
        if is_config(trees):
            self.synth = load_config(shipped_config_path(trees, "trees"), SynthConfig)
            if self.synth.vocab_size > vocab_size:
                raise ValueError(f"{trees}: vocab_size {self.synth.vocab_size} exceeds the model's {vocab_size}")
            self.num_steps = self.synth.num_steps
        else:
            self.files = step_sequence(Path(trees))
            if not self.files:
                step_files(trees)  # a missing path or a wrong file type is an error now, not at the first step
                self.files = [Path(trees)]
            self.num_steps = len(self.files)

    def step(self, index: int) -> Step:
        assert 0 <= index < self.num_steps, index
        if self.synth is not None:
            return generate_step(self.synth, self.seed, index)
        return read_step(self.files[index], vocab_size=self.vocab_size)

    def digests(self) -> list[str]:
        """The sha256 of each data step's content: its file's bytes, or the generator's config, seed and index."""
        if self.synth is not None:
            base = {"trees": config_to_dict(self.synth), "seed": self.seed}
            return [hashlib.sha256(json.dumps({**base, "step": i}, sort_keys=True).encode()).hexdigest()
                    for i in range(self.num_steps)]
        return [file_digest(path) for path in self.files]

    def describe(self, index: int) -> str:
        return f"{self.trees} step {index}" if self.synth is not None else str(self.files[index])


def step_sequence(path: Path) -> list[Path]:
    """The step_NNN files of directory `path` in order, or [] when it holds none (one step, or not a directory)."""
    if not path.is_dir():
        return []
    numbered: dict[int, Path] = {}
    others = []
    for entry in sorted(path.iterdir()):
        match = STEP_FILE.fullmatch(entry.name)
        if match:
            number = int(match.group(1))
            if number in numbered:
                raise ValueError(f"{path}: step {number} is given twice ({numbered[number].name}, {entry.name})")
            numbered[number] = entry
        elif entry.name.endswith((*JSONL_SUFFIXES, NPZ_SUFFIX)):
            others.append(entry)
    if not numbered:
        return []
    if others:
        raise ValueError(f"{others[0]}: not a step_NNN file in a directory of numbered steps (rename or move it)")
    missing = sorted(set(range(max(numbered) + 1)) - set(numbered))
    if missing:
        raise ValueError(f"{path}: step {missing[0]} is missing (the steps are numbered 0..{max(numbered)})")
    return [numbered[i] for i in range(len(numbered))]


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def epoch_order(num_steps: int, shuffle: bool) -> list[int]:
    """The data steps of one epoch in visiting order (a permutation from torch's global RNG when shuffling)."""
    if shuffle:
        return torch.randperm(num_steps).tolist()
    return np.arange(num_steps).tolist()
