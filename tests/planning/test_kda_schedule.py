"""`validate_schedule` against corrupted schedules: one per rule, each failing with that rule's message.

The planner's tests only ever hand the validator valid schedules, so a rule deleted from it
went unnoticed. Here a valid schedule of a small tree with forks (root of 5 tokens, two
children of 5, each with two children of 3; B = 4, so both fork levels replay: 3 calls) is
corrupted in one place per case, the smallest change that breaks exactly one rule (rules are
checked call by call, so a few cases move two fields together to get past an earlier rule),
including a state taken from the sibling branch at the same position.
"""

import re
from dataclasses import replace

import numpy as np
import pytest

from harts.planning.kda_calls import compact_parent_row, plan_kda_calls
from harts.planning.kda_schedule import validate_schedule

from .kda_helpers import tree_from_shape

CHUNK = 4


@pytest.fixture(scope="module")
def tree():
    return tree_from_shape([-1, 0, 0, 1, 1, 2, 2], [5, 5, 5, 3, 3, 3, 3])


@pytest.fixture(scope="module")
def schedule(tree):
    schedule = plan_kda_calls(tree, CHUNK, replay=True)
    # The layout the cases below corrupt: call 0 computes root → child 1 → its first leaf and
    # returns the states at 4 and 8; call 1 runs child 1's second leaf (from the state at 8) and
    # child 2 → its first leaf (from the state at 4, returning the one at 8 on its own path);
    # call 2 runs child 2's second leaf from that state.
    assert [call.initial_source.tolist() for call in schedule.calls] == [
        [[-1, -1, -1]], [[0, 0, 1], [0, 0, 0]], [[1, 1, 0]]]
    assert [call.path_start.tolist() for call in schedule.calls] == [[0], [8, 4], [8]]
    return schedule


def _with_call(schedule, r, **fields):
    calls = list(schedule.calls)
    calls[r] = replace(calls[r], **fields)
    return replace(schedule, calls=tuple(calls))


def _set(array, index, value):
    array = array.copy()
    array[index] = value
    return array


def _drop_first_row(schedule, r, i):
    """Sequence i of call r without its first row (its path start one further)."""
    call = schedule.calls[r]
    first = int(call.cu_seqlens[i])
    keep = np.delete(np.arange(call.num_rows), first)
    cu_seqlens = call.cu_seqlens.copy()
    cu_seqlens[i + 1 :] -= 1
    return _with_call(schedule, r, rows=call.rows[keep], is_replay=call.is_replay[keep], cu_seqlens=cu_seqlens,
                      path_start=_set(call.path_start, i, call.path_start[i] + 1))


def _corrupt(schedule, case):
    c0, c1, c2 = schedule.calls
    return {
        "is-replay-too-short": lambda: _with_call(schedule, 0, is_replay=c0.is_replay[:-1]),
        "empty-sequence": lambda: _with_call(schedule, 1, cu_seqlens=np.array([0, 5, 5, 14])),
        "path-start-not-first-row": lambda: _with_call(schedule, 1, path_start=np.array([8, 0])),
        "rows-not-consecutive": lambda: _with_call(schedule, 1, rows=c1.rows[[0, 1, 3, 2, *range(4, 14)]]),
        "replay-after-computed": lambda: _with_call(schedule, 1, is_replay=_set(c1.is_replay, [1, 2], [False, True])),
        "nothing-computed": lambda: _with_call(schedule, 2, is_replay=np.ones(5, dtype=bool)),
        "start-off-chunk": lambda: _drop_first_row(schedule, 1, 0),
        "replay-rows-reach-b": lambda: replace(schedule, chunk_size=2),
        "zero-state-mid-path": lambda: _with_call(schedule, 1, initial_source=_set(c1.initial_source, 0, -1)),
        "state-from-same-call": lambda: _with_call(schedule, 1, initial_source=_set(c1.initial_source, 0, [1, 1, 0])),
        "state-from-other-position": lambda: _with_call(
            schedule, 1, initial_source=_set(c1.initial_source, 0, [0, 0, 0])),
        "state-from-sibling-branch": lambda: _with_call(
            schedule, 2, initial_source=_set(c2.initial_source, 0, [0, 0, 1])),
        "handoff-depth": lambda: _with_call(schedule, 2, handoff_depth=np.array([1])),
        "boundary-past-end": lambda: _with_call(schedule, 1, boundary_offsets=np.array([12])),
        "boundary-off-chunk": lambda: _with_call(schedule, 1, boundary_offsets=np.array([3])),
        "row-never-computed": lambda: _with_call(schedule, 1, is_replay=_set(c1.is_replay, 2, True)),
        "row-computed-twice": lambda: _with_call(schedule, 2, is_replay=_set(c2.is_replay, 1, False)),
    }[case]()


MESSAGES = {
    "is-replay-too-short": "rows and is_replay: one per packed row",
    "empty-sequence": "cu_seqlens rise strictly from 0",
    "path-start-not-first-row": "a sequence's first row is at its path start",
    "rows-not-consecutive": "rows are consecutive positions of one path",
    "replay-after-computed": "replay rows come first",
    "nothing-computed": "a sequence computes at least one row",
    "start-off-chunk": "with replay, a sequence starts at a chunk multiple",
    "replay-rows-reach-b": "with replay, fewer than B replay rows",
    "zero-state-mid-path": "only sequences starting at position 0 use the zero state",
    "state-from-same-call": "initial state from an earlier call",
    "state-from-other-position": "state handed over at the sequence's start",
    "state-from-sibling-branch": "the state comes from this path",
    "handoff-depth": "handoff depth: 1 + the source's",
    "boundary-past-end": "a boundary lies within its sequence",
    "boundary-off-chunk": "with replay, boundaries are chunk multiples",
    "row-never-computed": "every compact row computed exactly once",
    "row-computed-twice": "every compact row computed exactly once",
}


def test_planned_schedule_is_valid(tree, schedule):
    validate_schedule(schedule, tree.compact_positions(), compact_parent_row(tree))


@pytest.mark.parametrize("case", MESSAGES)
def test_corrupted_schedule_breaks_its_rule(tree, schedule, case):
    corrupted = _corrupt(schedule, case)
    with pytest.raises(AssertionError, match=f"^{re.escape(MESSAGES[case])}$"):
        validate_schedule(corrupted, tree.compact_positions(), compact_parent_row(tree))
