"""`iter_steps`: a trees config by NAME or path generates its steps; a step on disk is read, and wins over a name."""

import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from harts.trees.sources import first_trees, iter_steps

REPO = Path(__file__).resolve().parents[2]


def test_a_shipped_name_is_the_config(tmp_path, monkeypatch):
    by_path = list(iter_steps(str(REPO / "configs/trees/tiny.yaml"), 3, [0, 1]))
    monkeypatch.chdir(tmp_path)  # the name does not depend on the working directory
    by_name = list(iter_steps("tiny", 3, [0, 1]))
    assert [(i, meta["trees"], meta["step"]) for i, _, meta in by_name] == [(0, "tiny", 0), (1, "tiny", 1)]
    for (_, expected, meta_path), (_, step, meta_name) in zip(by_path, by_name):
        assert meta_name["synth"] == meta_path["synth"]
        np.testing.assert_array_equal(step.tokens, expected.tokens)


def test_a_step_folder_wins_over_a_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    shutil.copy(REPO / "data/samples/tiny-step.jsonl.gz", tmp_path / "tiny" / "step.jsonl.gz")
    ((index, step, meta),) = iter_steps("tiny", 0, None)
    assert (index, meta, step.num_semantic_tokens) == (0, {"trees": "tiny", "step": 0}, 1971)


def test_an_unknown_name_lists_the_shipped_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    known = ", ".join(sorted(path.stem for path in (REPO / "configs/trees").glob("*.yaml")))
    with pytest.raises(ValueError, match=rf"^unknown trees config 'nope' \(known: {re.escape(known)};"):
        list(iter_steps("nope", 0, None))


def test_first_trees_keep_whole_trees_in_order():
    ((_, step, _),) = iter_steps("tiny", 0, [0])
    trees = list(dict.fromkeys(step.trees))
    ((_, sliced, meta),) = iter_steps("tiny", 0, [0], max_trees=1)
    assert meta["max_trees"] == 1 and set(sliced.trees) == {trees[0]}
    assert sliced.ids == tuple(i for i, t in zip(step.ids, step.trees) if t == trees[0])
    assert sliced.num_semantic_tokens == sum(int(n) for n, t in zip(step.lengths, step.trees) if t == trees[0])
    assert first_trees(step, None) is step and first_trees(step, len(trees) + 3).ids == step.ids
