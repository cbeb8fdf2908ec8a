"""`sort_with_lcp` (the prefix index's sort) against its reference `naive_sort_with_lcp`."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.trees.trie import naive_sort_with_lcp, sort_with_lcp

from .helpers import make_step, random_sequences


def _check(sequences: list[list[int]]) -> None:
    step = make_step(sequences)
    order, lcp = sort_with_lcp(step)
    expected_order, expected_lcp = naive_sort_with_lcp(step)
    assert order.tolist() == expected_order.tolist()
    assert lcp.tolist() == expected_lcp.tolist()
    assert order.dtype == lcp.dtype == np.int64


CASES = {
    "copies": [[3, 1], [3, 1], [3], [3, 1], [3]],
    "prefix-chain": [[1, 2, 3, 4], [1], [1, 2], [1, 2, 3]],
    "caterpillar": [[0] * k + [1] + [k] for k in range(12)] + [[0] * 13],
    "distinct-first-tokens": [[5], [2, 2], [9, 1], [0]],
    "large-token-ids": [[157_183, 2**31 - 1], [157_183, 0], [2**31 - 1], [256, 1], [1, 256]],
}


@pytest.mark.parametrize("name", CASES)
def test_hand_built(name):
    _check(CASES[name])


@pytest.mark.parametrize("seed", range(30))
def test_random_steps(seed):
    rng = np.random.default_rng(42 + seed)
    _check(random_sequences(rng, int(rng.integers(1, 60)), int(rng.integers(1, 80)), int(rng.integers(1, 5))))


def test_long_shared_runs_cross_the_comparison_windows():
    # Shared prefixes of 4,095 .. 20,000 tokens: differences on both sides of every window edge.
    rng = np.random.default_rng(42)
    base = rng.integers(0, 3, 20_000).tolist()
    sequences = [base[:cut] + [int(rng.integers(0, 3))] + [7] * 5 for cut in (4095, 4096, 4097, 20_000, 16_383)]
    sequences += [base, base[:4096], list(base)]
    _check(sequences)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=10), min_size=1, max_size=15))
def test_property(sequences):
    _check(sequences)
