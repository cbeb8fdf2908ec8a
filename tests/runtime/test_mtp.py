"""The MTP depths' rows against the trajectories' token lists (harts.runtime.mtp).

Every reference is computed from the tokens alone (prefixes as Python tuples), never through the trie, the
call planner or the layout code under test. For depths k = 1 .. 3, in both executions, on random trees and on
hand-made ones (a fork at every depth, a fork right before the last token, trajectories that differ only in their
first token, copies, trajectories of length <= k):
- the depth's semantic positions are (x, i >= k), each row's token is x_i and its position i - k;
- per trajectory, one row per position; under the tree, two positions share a row iff their trajectories agree on
  tokens 0 .. i, one row per such prefix, the row's multiplicity its number of positions;
- each row reads the previous depth's row (the main layout's for k = 1) of the prefix one token shorter;
- the attention of each row sees exactly the rows of its own prefixes of length > k (itself included), and the
  causal conv of the KDA rows equals a plain conv over each trajectory's shifted sequence of row inputs.
"""

import numpy as np
import pytest
import torch

from harts.runtime.layout import baseline_layout, compact_layout
from harts.runtime.mtp import mtp_layouts
from harts.trees.trie import PrefixIndex
from tests.trees.helpers import make_step, random_sequences

CONV_SIZE = 4
CHUNK_SIZE = 4
NUM_DEPTHS = 3

HAND_MADE = {
    # Forks at every depth: each level doubles.
    "fork-every-depth": [[a, b, c, d] for a in (0, 1) for b in (0, 1) for c in (0, 1) for d in (0, 1)],
    # A long shared prefix that forks right before the last token, beside a copy and a proper prefix.
    "fork-before-last": [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 9], [1, 2, 3, 4, 5, 6, 7, 9],
                         [1, 2, 3, 4, 5]],
    # Equal but for the first token: no MTP row may be shared at any depth.
    "first-token-differs": [[0, 5, 5, 5, 5, 6], [1, 5, 5, 5, 5, 6], [2, 5, 5, 5, 5, 7], [3, 5, 5, 5, 5, 7]],
    # Trajectories of length 1 .. 4: some have no row at the deeper depths.
    "short": [[3], [3, 1], [3, 1, 2], [3, 1, 2, 0], [2, 2], [2, 2, 2, 2]],
}


def _steps():
    steps = {name: (make_step(sequences), None) for name, sequences in HAND_MADE.items()}
    for seed in range(3):
        rng = np.random.default_rng(seed)
        step = make_step(random_sequences(rng, 12, 30, 2))
        steps[f"random-{seed}"] = (step, rng.permutation(step.num_trajectories)[:9])
    return steps


STEPS = _steps()


def _layouts(step, members, execution):
    index = PrefixIndex.from_step(step)
    knobs = dict(conv_size=CONV_SIZE, chunk_size=CHUNK_SIZE)
    main = (compact_layout(step, index, members, **knobs) if execution == "compact"
            else baseline_layout(step, members, **knobs))
    return main, mtp_layouts(step, members, NUM_DEPTHS, execution=execution, index=index, **knobs)


def _positions(step, members):
    """(trajectory index among members, token index) of the microbatch's semantic positions, in order."""
    return [(j, i) for j, k in enumerate(members) for i in range(int(step.lengths[k]))]


@pytest.mark.parametrize("execution", ["baseline", "compact"])
@pytest.mark.parametrize("name", STEPS)
def test_rows_against_prefixes(name, execution):
    step, members = STEPS[name]
    members = np.arange(step.num_trajectories) if members is None else members
    trajectories = [step.trajectory_tokens(k).tolist() for k in members]
    positions = _positions(step, members)
    main, layouts = _layouts(step, members, execution)
    previous = {positions[s]: int(row) for s, row in enumerate(main.semantic_rows)}
    expected_depths = min(NUM_DEPTHS, max(len(t) for t in trajectories) - 1)
    assert [mtp.depth for mtp in layouts] == list(range(1, expected_depths + 1))
    for mtp in layouts:
        depth, layout = mtp.depth, mtp.layout
        wanted = [(j, i) for j, i in positions if i >= depth]
        assert [positions[s] for s in mtp.semantic_positions] == wanted
        rows = layout.semantic_rows.numpy()
        assert len(rows) == len(wanted) == layout.info["semantic_tokens"]
        tokens = np.array([trajectories[j][i] for j, i in wanted])
        assert np.array_equal(layout.input_ids.numpy()[rows], tokens)
        assert np.array_equal(layout.positions.numpy()[rows], [i - depth for _, i in wanted])
        prefixes = [tuple(trajectories[j][: i + 1]) for j, i in wanted]
        if execution == "baseline":
            assert np.array_equal(rows, np.arange(layout.num_rows)), "one row per position"
            assert layout.multiplicity is None
        else:
            row_of_prefix = {}
            for prefix, row in zip(prefixes, rows):
                assert row_of_prefix.setdefault(prefix, row) == row, "one prefix, one row"
            assert sorted(row_of_prefix.values()) == list(range(layout.num_rows)), "one row per prefix"
            counts = np.bincount(rows, minlength=layout.num_rows)
            assert np.array_equal(layout.multiplicity.numpy(), counts)
        hidden_rows = mtp.hidden_rows.numpy()
        for (j, i), row in zip(wanted, rows):
            assert hidden_rows[row] == previous[(j, i - 1)], "reads the previous depth's row of the parent prefix"
        previous = {position: int(row) for position, row in zip(wanted, rows)}


def test_first_token_differences_share_no_row():
    """The guard against building the MTP trie from shifted tokens: x_1.. agree, x_0 does not."""
    step, _ = STEPS["first-token-differs"]
    _, layouts = _layouts(step, np.arange(step.num_trajectories), "compact")
    for mtp in layouts:
        assert mtp.num_rows == sum(int(n) - mtp.depth for n in step.lengths), mtp.depth


def _visible_keys(groups):
    """{query row: set of key rows it attends to} (bottom-right aligned causal groups)."""
    seen = {}
    q_ptr, kv_ptr = groups.q_ptr.tolist(), groups.kv_ptr.tolist()
    q_index, kv_index = groups.q_index.tolist(), groups.kv_index.tolist()
    for g in range(len(q_ptr) - 1):
        queries = q_index[q_ptr[g] : q_ptr[g + 1]]
        keys = kv_index[kv_ptr[g] : kv_ptr[g + 1]]
        before = len(keys) - len(queries)
        for a, row in enumerate(queries):
            seen[row] = set(keys[: before + a + 1])
    return seen


@pytest.mark.parametrize("execution", ["baseline", "compact"])
@pytest.mark.parametrize("name", STEPS)
def test_attention_and_conv_follow_each_trajectory(name, execution):
    step, members = STEPS[name]
    members = np.arange(step.num_trajectories) if members is None else members
    trajectories = [step.trajectory_tokens(k).tolist() for k in members]
    _, layouts = _layouts(step, members, execution)
    generator = torch.Generator().manual_seed(0)
    for mtp in layouts:
        depth, layout = mtp.depth, mtp.layout
        rows = layout.semantic_rows.tolist()
        visible = _visible_keys(layout.groups)
        assert sorted(visible) == list(range(layout.num_rows)), "every row is a query once"
        # Per trajectory: the rows of its positions depth .. L - 1, in order.
        paths, start = [], 0
        for t in trajectories:
            count = max(len(t) - depth, 0)
            paths.append(rows[start : start + count])
            start += count
        for path in paths:
            for a, row in enumerate(path):
                assert visible[row] == set(path[: a + 1]), (depth, row)
        x = torch.randn(layout.num_rows, 6, generator=generator)
        weight = torch.randn(6, CONV_SIZE, generator=generator)
        out = layout.from_kda_rows(layout.causal_conv(layout.kda_rows(x), weight))
        for path in paths:
            if not path:
                continue
            sequence = torch.cat([x.new_zeros(CONV_SIZE - 1, 6), x[path]])
            expected = sum(sequence[CONV_SIZE - 1 - j : CONV_SIZE - 1 - j + len(path)] * weight[:, -1 - j]
                           for j in range(CONV_SIZE))
            torch.testing.assert_close(out[path], expected, rtol=1e-6, atol=1e-6)
