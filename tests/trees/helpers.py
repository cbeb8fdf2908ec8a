"""Small step builders, a brute-force dict trie (the oracle of the vectorised structures) and the
checks of a refused bad input (library message, CLI line), word-level tokenizer files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from harts.cli.main import main
from harts.trees.step import TOKEN_DTYPE, Step

BAD_INPUTS = Path(__file__).resolve().parents[1] / "data" / "bad_inputs"
"""Committed bad input files (made by make.py there)."""


def make_step(sequences: list[list[int]], ids: list[str] | None = None, trees: list[str] | None = None) -> Step:
    lengths = [len(s) for s in sequences]
    offsets = np.zeros(len(sequences) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.concatenate([np.asarray(s, dtype=TOKEN_DTYPE) for s in sequences])
    loss_mask = np.ones(len(tokens), dtype=np.uint8)
    loss_mask[offsets[:-1]] = 0
    ids = ids or [f"t{k}" for k in range(len(sequences))]
    return Step(
        ids=tuple(ids),
        trees=tuple(trees or ids),
        offsets=offsets,
        tokens=tokens,
        loss_mask=loss_mask,
        rewards=np.zeros(len(sequences), dtype=np.float32),
        advantage_per_trajectory=np.zeros(len(sequences), dtype=np.float32),
    )


def random_sequences(rng: np.random.Generator, num: int, max_len: int, vocab: int) -> list[list[int]]:
    """Random trajectories that share prefixes: each copies a random prefix of an earlier one."""
    sequences: list[list[int]] = []
    for _ in range(num):
        length = int(rng.integers(1, max_len + 1))
        if sequences and rng.random() < 0.8:
            base = sequences[int(rng.integers(len(sequences)))]
            keep = int(rng.integers(0, min(len(base), length) + 1))
            tail = rng.integers(0, vocab, length - keep).tolist()
            sequences.append(base[:keep] + tail)
        else:
            sequences.append(rng.integers(0, vocab, length).tolist())
    return sequences


class BruteTrie:
    """A trie of Python dicts: node ids in insertion order, one node per unique prefix."""

    def __init__(self, sequences: list[list[int]]) -> None:
        self.children: list[dict[int, int]] = [{}]  # node 0 is the empty prefix
        self.ends: list[int] = [0]
        self.paths: list[list[int]] = []
        for sequence in sequences:
            node, path = 0, []
            for token in sequence:
                if token not in self.children[node]:
                    self.children[node][token] = len(self.children)
                    self.children.append({})
                    self.ends.append(0)
                node = self.children[node][token]
                path.append(node)
            self.ends[node] += 1
            self.paths.append(path)

    @property
    def num_nodes(self) -> int:
        return len(self.children) - 1

    def num_segments(self) -> int:
        """Nodes that start a segment: a child of the root, of a fork, or of a trajectory end."""
        count = 0
        for node, children in enumerate(self.children):
            if node == 0 or len(children) >= 2 or self.ends[node] > 0:
                count += len(children)
        return count

    def num_forks(self) -> int:
        return sum(1 for node, c in enumerate(self.children) if node and len(c) >= 2)

    def multiplicity(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for path in self.paths:
            for node in path:
                counts[node] = counts.get(node, 0) + 1
        return counts

    def fork_depths(self) -> list[int]:
        """Forks strictly before the last token on each path."""
        return [sum(1 for node in path[:-1] if len(self.children[node]) >= 2) for path in self.paths]


def assert_message(message: str, expected: str, path: Path) -> None:
    """`message` is `expected` with {path} filled in; `...` stands for a library's own wording
    (zlib's, zipfile's), which may change with its version."""
    pattern = ".*".join(re.escape(part) for part in expected.format(path=path).split("..."))
    assert re.fullmatch(pattern, message), f"{message!r} is not {expected!r}"


def cli_error(argv: list[str], capsys) -> str:
    """Run `harts argv` in-process; assert that it failed cleanly and return its one stderr line.

    An uncaught exception propagates out of main (the test fails with its traceback); argparse
    usage errors exit through SystemExit.
    """
    try:
        status = main(argv)
    except SystemExit as exit:
        status = exit.code
    err = capsys.readouterr().err
    assert status not in (0, None), f"exit status {status}"
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("harts: error: "), err
    return lines[0]


HUGE_TOKEN_ID = 2**24


def save_word_tokenizer(path: Path, vocab: dict[str, int], unk: str | None) -> Path:
    """A whitespace WordLevel tokenizer.json over `vocab` with the ChatML markers as special tokens, at `path`.
    Ids of at least HUGE_TOKEN_ID are written into the saved file in place of free small ones: tokenizers' save
    walks every id up to the largest (35 s for one id of 2^31)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    top = max((i for i in vocab.values() if i < HUGE_TOKEN_ID), default=-1)
    huge = sorted((token for token, i in vocab.items() if i >= HUGE_TOKEN_ID), key=vocab.__getitem__)
    tokenizer = Tokenizer(models.WordLevel({**vocab, **{t: top + 1 + n for n, t in enumerate(huge)}}, unk_token=unk))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tokenizer.save(str(path))
    if huge:
        saved = json.loads(path.read_text())
        saved["model"]["vocab"].update({token: vocab[token] for token in huge})
        path.write_text(json.dumps(saved))
    return path
