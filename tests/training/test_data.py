from pathlib import Path

import numpy as np
import pytest
import torch

from harts.config import load_config
from harts.trees.io import write_step
from harts.trees.synth import SynthConfig, generate_step
from harts.training.data import StepSource, epoch_order

MICRO = str(Path(__file__).with_name("micro-trees.yaml"))


def _steps(count: int) -> list:
    synth = load_config(MICRO, SynthConfig)
    return [generate_step(synth, 0, i) for i in range(count)]


def _same(a, b) -> bool:
    return a.ids == b.ids and np.array_equal(a.tokens, b.tokens) and np.array_equal(a.offsets, b.offsets)


def test_trees_config_generates_each_step():
    source = StepSource(MICRO, seed=0, vocab_size=256)
    assert source.num_steps == 3
    for i, expected in enumerate(_steps(3)):
        assert _same(source.step(i), expected)
    assert source.describe(2) == f"{MICRO} step 2"
    assert StepSource("tiny", seed=0, vocab_size=256).num_steps == 2  # a shipped config by name


def test_directory_of_numbered_steps_is_a_sequence(tmp_path):
    steps = _steps(3)
    for i, (step, suffix) in enumerate(zip(steps, (".npz", ".jsonl", ".jsonl.gz"))):
        write_step(step, tmp_path / f"step_{i:03d}{suffix}")
    (tmp_path / "notes.txt").write_text("not a step")
    source = StepSource(str(tmp_path), seed=0, vocab_size=256)
    assert source.num_steps == 3
    assert all(_same(source.step(i), steps[i]) for i in range(3))
    assert source.describe(1) == str(tmp_path / "step_001.jsonl")


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (["step_000.npz", "step_002.npz"], "step 1 is missing"),
        (["step_000.npz", "step_0.jsonl"], "step 0 is given twice"),
        (["step_000.npz", "extra.npz"], "extra.npz: not a step_NNN file"),
    ],
    ids=["gap", "twice", "stray-step-file"],
)
def test_directory_of_numbered_steps_refuses_ambiguity(tmp_path, names, message):
    step = _steps(1)[0]
    for name in names:
        write_step(step, tmp_path / name)
    with pytest.raises(ValueError, match=message):
        StepSource(str(tmp_path), seed=0, vocab_size=256)


def test_other_step_paths_are_one_step(tmp_path):
    step = _steps(1)[0]
    write_step(step, tmp_path / "a.npz")
    assert StepSource(str(tmp_path / "a.npz"), seed=0, vocab_size=256).num_steps == 1
    assert StepSource(str(tmp_path), seed=0, vocab_size=256).num_steps == 1  # a directory of unnumbered files
    with pytest.raises(ValueError, match="no such file"):
        StepSource(str(tmp_path / "missing" / "b.npz"), seed=0, vocab_size=256)


def test_vocabulary_is_checked():
    with pytest.raises(ValueError, match="vocab_size 256 exceeds the model's 100"):
        StepSource(MICRO, seed=0, vocab_size=100)


def test_epoch_order():
    assert epoch_order(4, shuffle=False) == [0, 1, 2, 3]
    torch.manual_seed(5)
    first = epoch_order(6, shuffle=True)
    second = epoch_order(6, shuffle=True)
    torch.manual_seed(5)
    assert sorted(first) == list(range(6)) and epoch_order(6, shuffle=True) == first  # from torch's global RNG
    assert first != second
