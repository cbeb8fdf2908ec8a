import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.trees.trie import PrefixIndex

from .helpers import BruteTrie, make_step, random_sequences

HAND_BUILT = {
    # name: (sequences, C, segments, forks)
    "prefix-of-another": ([[1, 2, 3], [1, 2, 3, 4, 5]], 5, 2, 0),
    "several-first-tokens": ([[1, 2], [3, 4], [5]], 5, 3, 0),
    "single-token-segments": ([[1, 2], [1, 3], [1, 2, 4], [1, 2, 5]], 5, 5, 2),
    "identical": ([[7, 7, 7], [7, 7, 7]], 3, 1, 0),
    "mixed": ([[1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 7], [9], [1, 2, 3, 4, 6], [1, 2, 3]], 8, 7, 2),
    "one-token": ([[0]], 1, 1, 0),
}


@pytest.mark.parametrize("name", HAND_BUILT)
def test_hand_built(name):
    sequences, compact, segments, forks = HAND_BUILT[name]
    step = make_step(sequences)
    tree = PrefixIndex.from_step(step).segment_tree()
    assert step.num_semantic_tokens == sum(len(s) for s in sequences)
    assert tree.num_compact_tokens == compact
    assert tree.num_segments == segments
    assert int((tree.num_children >= 2).sum()) == forks
    assert tree.multiplicity().sum() == step.num_semantic_tokens


def _check_against_brute_force(sequences):
    step = make_step(sequences)
    index = PrefixIndex.from_step(step)
    tree = index.segment_tree()
    brute = BruteTrie(sequences)
    assert tree.num_compact_tokens == brute.num_nodes
    assert tree.num_segments == brute.num_segments()
    assert int((tree.num_children >= 2).sum()) == brute.num_forks()

    compact_map = tree.compact_map()
    brute_nodes = np.concatenate([np.asarray(p) for p in brute.paths])
    # Same partition of semantic positions: rows and brute-force nodes correspond one to one.
    pairs = set(zip(compact_map.tolist(), brute_nodes.tolist()))
    assert len(pairs) == brute.num_nodes == len(set(compact_map.tolist()))
    assert set(compact_map.tolist()) == set(range(tree.num_compact_tokens))

    multiplicity = tree.multiplicity()
    brute_q = brute.multiplicity()
    for row, node in pairs:
        assert multiplicity[row] == brute_q[node]
    positions = np.concatenate([np.arange(len(s)) for s in sequences])
    assert (tree.compact_positions()[compact_map] == positions).all()
    compact_tokens = np.empty(tree.num_compact_tokens, dtype=np.int64)
    compact_tokens[compact_map] = step.tokens
    assert (compact_tokens[compact_map] == step.tokens).all()

    fork_depth = tree.fork_depth()[tree.end_segment]
    order = tree.sorted_position
    assert sorted(fork_depth.tolist()) == sorted(np.asarray(brute.fork_depths())[order].tolist())
    # Preorder: a parent precedes its children and subtrees are contiguous.
    assert (tree.parent < np.arange(tree.num_segments)).all()
    for v in range(tree.num_segments):
        inside = np.arange(v + 1, tree.subtree_end[v])
        assert all(_is_ancestor(tree.parent, v, w) for w in inside)


def _is_ancestor(parent, v, w):
    while w >= 0:
        if w == v:
            return True
        w = parent[w]
    return False


@pytest.mark.parametrize("seed", range(20))
def test_random_steps_match_brute_force(seed):
    rng = np.random.default_rng(42 + seed)
    _check_against_brute_force(random_sequences(rng, int(rng.integers(1, 30)), 40, int(rng.integers(2, 6))))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=12), min_size=1, max_size=12))
def test_property_brute_force(sequences):
    _check_against_brute_force(sequences)


@pytest.mark.parametrize("seed", range(8))
def test_subset_equals_fresh_build(seed):
    rng = np.random.default_rng(42 + seed)
    sequences = random_sequences(rng, 25, 30, 3)
    index = PrefixIndex.from_step(make_step(sequences))
    members = rng.permutation(len(sequences))[: int(rng.integers(1, len(sequences) + 1))]
    subset = index.segment_tree(members)
    fresh = PrefixIndex.from_step(make_step([sequences[k] for k in members])).segment_tree()
    assert subset.num_compact_tokens == fresh.num_compact_tokens
    assert (subset.compact_map() == fresh.compact_map()).all()
    assert (subset.parent == fresh.parent).all() and (subset.start == fresh.start).all()


def test_lcp_queries():
    sequences = [[1, 2, 3, 4], [1, 2, 9], [1, 2, 3, 5, 6], [4], [1, 2, 3, 4, 0]]
    index = PrefixIndex.from_step(make_step(sequences))
    for a in range(len(sequences)):
        for b in range(len(sequences)):
            expected = 0
            while (expected < min(len(sequences[a]), len(sequences[b]))
                   and sequences[a][expected] == sequences[b][expected]):
                expected += 1
            assert index.lcp_of(a, b) == expected


def test_duplicate_members_rejected():
    index = PrefixIndex.from_step(make_step([[1], [2]]))
    with pytest.raises(ValueError, match="distinct"):
        index.segment_tree(np.array([0, 0]))
