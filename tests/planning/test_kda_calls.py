"""The KDA call planner against the exhaustive scheduler, its naive twin and the schedule validator."""

import json
import subprocess
import sys
import zlib

import numpy as np
import pytest

from harts.bench.kda_calls import random_segment_tree
from harts.cli.main import main
from harts.planning.kda_calls import (
    call_counts,
    compact_parent_row,
    forced_replay,
    min_calls,
    naive_call_counts,
    naive_plan_kda_calls,
    plan_kda_calls,
)
from harts.planning.kda_schedule import validate_schedule
from harts.trees.io import read_step, write_step
from harts.trees.trie import PrefixIndex, SegmentTree

from ..trees.helpers import make_step, random_sequences
from .kda_helpers import (
    SHAPES,
    brute_force_min_calls,
    continuation_choices,
    random_tree,
    replay_total,
    tree_from_shape,
)

CHUNKS = (1, 2, 4, 64)
MODES = {"replay": True, "no-replay": False}
CALL_FIELDS = (
    "rows", "is_replay", "cu_seqlens", "path_start", "initial_source", "boundary_offsets", "boundary_ptr",
    "handoff_depth",
)


def _seed(*parts) -> int:
    return 42 + zlib.crc32("/".join(map(str, parts)).encode())


def check_schedule(tree: SegmentTree, chunk: int, replay: bool):
    """Every property a recovered schedule must have; returns it."""
    schedule = plan_kda_calls(tree, chunk, replay=replay)
    validate_schedule(schedule, tree.compact_positions(), compact_parent_row(tree))
    assert schedule.num_calls == min_calls(tree, chunk, replay=replay)
    assert schedule.replay_tokens == (forced_replay(tree, chunk) if replay else 0)
    assert schedule.num_sequences == int((tree.num_children == 0).sum()), "one sequence per leaf"
    segment_starts = set(tree.start.tolist())
    positions = tree.compact_positions()
    consumed = set()
    for call in schedule.calls:
        for i in range(call.num_sequences):
            offsets = call.sequence_boundaries(i)
            assert (np.diff(offsets) > 0).all(), "boundaries are distinct and ascending"
            source = tuple(int(x) for x in call.initial_source[i])
            assert (source[0] < 0) == (call.handoff_depth[i] == 0)
            if source[0] >= 0:
                consumed.add(source)
            lo, hi = call.cu_seqlens[i], call.cu_seqlens[i + 1]
            head_start = int(positions[call.rows[lo + int(call.is_replay[lo:hi].sum())]])
            assert head_start in segment_starts, "a sequence computes from a segment's start"
            expected = head_start // chunk * chunk if replay else head_start
            assert call.path_start[i] == expected
    returned = {
        (r, i, k) for r, call in enumerate(schedule.calls)
        for i in range(call.num_sequences) for k in range(len(call.sequence_boundaries(i)))
    }
    assert returned == consumed, "every returned state is used, none twice over"
    return schedule


def assert_same_schedule(schedule, reference):
    assert (schedule.num_calls, schedule.chunk_size, schedule.replay) == (
        reference.num_calls, reference.chunk_size, reference.replay)
    for call, expected in zip(schedule.calls, reference.calls):
        for name in CALL_FIELDS:
            got, want = getattr(call, name), getattr(expected, name)
            assert got.dtype == want.dtype and np.array_equal(got, want), name


# name: (parent, lengths, trajectory ends, B, replay, calls, replay rows)
HAND_BUILT = {
    "fork-mid-chunk": ([-1, 0, 0], [3, 2, 2], set(), 4, True, 1, 3),
    "fork-mid-chunk-no-replay": ([-1, 0, 0], [3, 2, 2], set(), 4, False, 2, 0),
    "fork-on-chunk": ([-1, 0, 0], [4, 2, 2], set(), 4, True, 2, 0),
    "fork-in-second-chunk": ([-1, 0, 0], [6, 2, 2], set(), 4, True, 2, 2),
    "nested-forks-in-first-chunk": ([-1, 0, 0, 1, 1], [2, 2, 1, 3, 3], set(), 8, True, 1, 6),
    "binary-one-token": ([-1, 0, 0, 1, 1, 2, 2], [1] * 7, set(), 1, True, 3, 0),
    "binary-one-token-chunk-4": ([-1, 0, 0, 1, 1, 2, 2], [1] * 7, set(), 4, True, 1, 1 + 2 * 2),
    "chain-of-trajectory-ends": ([-1, 0, 1, 2], [3, 3, 3, 3], {0, 1, 2}, 4, True, 1, 0),
    "forest": ([-1, 0, 0, -1, 3, 3], [4, 1, 1, 2, 1, 1], set(), 4, True, 2, 2),
}


@pytest.mark.parametrize("name", HAND_BUILT)
def test_hand_built(name):
    parent, lengths, ends, chunk, replay, calls, replay_rows = HAND_BUILT[name]
    tree = tree_from_shape(parent, lengths, ends)
    assert tree.num_segments == len(parent)
    schedule = check_schedule(tree, chunk, replay)
    assert schedule.num_calls == calls == brute_force_min_calls(tree, chunk, replay=replay)
    assert schedule.replay_tokens == replay_rows


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunk", CHUNKS, ids=lambda b: f"B{b}")
@pytest.mark.parametrize("shape", SHAPES)
def test_min_calls_equal_exhaustive_search(shape, chunk, mode):
    rng = np.random.default_rng(_seed(shape, chunk, mode))
    for _ in range(6):
        tree = random_tree(rng, shape, int(rng.integers(1, 11)), chunk)
        expected = brute_force_min_calls(tree, chunk, replay=MODES[mode])
        assert min_calls(tree, chunk, replay=MODES[mode]) == expected
        reference = naive_call_counts(tree, chunk, replay=MODES[mode])
        assert int(reference.t_pre[tree.parent < 0].max()) == expected


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunk", CHUNKS, ids=lambda b: f"B{b}")
def test_min_calls_equal_exhaustive_search_deeper(chunk, mode):
    rng = np.random.default_rng(_seed("deeper", chunk, mode))
    seen = set()
    for index in range(60):
        tree = random_tree(rng, ("binary", "random", "one-token")[index % 3], 15, chunk)
        if tree.num_segments > 15:
            continue
        expected = brute_force_min_calls(tree, chunk, replay=MODES[mode])
        assert min_calls(tree, chunk, replay=MODES[mode]) == expected
        seen.add(expected)
    assert max(seen) >= 3


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunk", CHUNKS, ids=lambda b: f"B{b}")
@pytest.mark.parametrize("shape", SHAPES)
def test_schedule_is_valid_minimal_and_equals_naive(shape, chunk, mode):
    rng = np.random.default_rng(_seed("schedule", shape, chunk, mode))
    for _ in range(3):
        tree = random_tree(rng, shape, int(rng.integers(1, 60)), chunk)
        schedule = check_schedule(tree, chunk, MODES[mode])
        assert_same_schedule(schedule, naive_plan_kda_calls(tree, chunk, replay=MODES[mode]))


@pytest.mark.parametrize("chunk", CHUNKS, ids=lambda b: f"B{b}")
@pytest.mark.parametrize("shape", SHAPES)
def test_forced_replay_does_not_depend_on_continuations(shape, chunk):
    rng = np.random.default_rng(_seed("replay", shape, chunk))
    for _ in range(4):
        tree = random_tree(rng, shape, int(rng.integers(1, 9)), chunk)
        totals = {replay_total(tree, chunk, c) for c in continuation_choices(tree, allow_stop=False)}
        assert totals == {forced_replay(tree, chunk)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunk", CHUNKS, ids=lambda b: f"B{b}")
def test_call_counts_equal_naive_on_token_steps(chunk, mode):
    rng = np.random.default_rng(_seed("tokens", chunk, mode))
    for _ in range(3):
        step = make_step(random_sequences(rng, int(rng.integers(1, 150)), 300, int(rng.integers(2, 5))))
        tree = PrefixIndex.from_step(step).segment_tree()
        counts = call_counts(tree, chunk, replay=MODES[mode])
        reference = naive_call_counts(tree, chunk, replay=MODES[mode])
        for name in ("t_pre", "t_in", "continuation"):
            assert np.array_equal(getattr(counts, name), getattr(reference, name)), name
        check_schedule(tree, chunk, MODES[mode])


def test_chunk_one_replay_is_no_replay():
    rng = np.random.default_rng(42)
    for shape in SHAPES:
        tree = random_tree(rng, shape, 40, 1)
        with_replay = plan_kda_calls(tree, 1, replay=True)
        without = plan_kda_calls(tree, 1, replay=False)
        assert with_replay.num_calls == without.num_calls
        for call, other in zip(with_replay.calls, without.calls):
            for name in CALL_FIELDS:
                assert np.array_equal(getattr(call, name), getattr(other, name)), name


def test_compact_parent_row_follows_every_trajectory():
    rng = np.random.default_rng(42)
    sequences = random_sequences(rng, 40, 60, 3)
    tree = PrefixIndex.from_step(make_step(sequences)).segment_tree()
    parent_row = compact_parent_row(tree)
    compact_map = tree.compact_map()
    offset = 0
    for sequence in sequences:
        rows = compact_map[offset : offset + len(sequence)]
        assert parent_row[rows[0]] == -1
        assert (parent_row[rows[1:]] == rows[:-1]).all()
        offset += len(sequence)


def test_empty_tree():
    empty = np.zeros(0, dtype=np.int64)
    tree = SegmentTree.build(empty, empty, empty, empty)
    assert plan_kda_calls(tree, 64).num_calls == min_calls(tree, 64) == forced_replay(tree, 64) == 0


@pytest.mark.parametrize("chunk", [0, -1, 2.5, True, "64"], ids=repr)
def test_bad_chunk_size(chunk):
    tree = tree_from_shape([-1, 0, 0], [3, 2, 2])
    for planner in (plan_kda_calls, min_calls, forced_replay, naive_plan_kda_calls):
        with pytest.raises(ValueError, match="chunk size must be a positive integer"):
            planner(tree, chunk)


@pytest.mark.parametrize("max_length", [1, 3, 16])
def test_bench_tree_equals_trie_of_its_tokens(max_length):
    tree = random_segment_tree(400, max_length, seed=max_length)
    single = np.flatnonzero(tree.num_children == 1)
    rebuilt = tree_from_shape(tree.parent.tolist(), tree.segment_lengths.tolist(), set(single.tolist()))
    for name in ("parent", "start", "end", "compact_start", "subtree_end", "num_children", "member_lengths"):
        assert np.array_equal(getattr(tree, name), getattr(rebuilt, name)), name
    assert np.array_equal(tree.end_segment, rebuilt.end_segment)


@pytest.fixture(scope="module")
def step_file(tmp_path_factory):
    rng = np.random.default_rng(42)
    path = tmp_path_factory.mktemp("kda") / "step.jsonl"
    write_step(make_step(random_sequences(rng, 30, 200, 3)), path)
    return path


@pytest.mark.parametrize("mode", MODES)
def test_cli_json(step_file, capsys, mode):
    argv = ["plan", "kda", str(step_file), "--chunk", "4", "--json"] + ([] if MODES[mode] else ["--no-replay"])
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    tree = PrefixIndex.from_step(read_step(step_file)).segment_tree()
    schedule = plan_kda_calls(tree, 4, replay=MODES[mode])
    assert summary == {
        "calls": schedule.num_calls,
        "sequences": schedule.num_sequences,
        "replay_tokens": schedule.replay_tokens,
        "compact_tokens": tree.num_compact_tokens,
        "semantic_tokens": tree.num_semantic_tokens,
    }


def test_cli_table_and_bad_chunk(step_file, capsys):
    assert main(["plan", "kda", str(step_file), "--chunk", "64"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[0] == "calls" and "max handoff" in out
    with pytest.raises(SystemExit) as usage_error:
        main(["plan", "kda", str(step_file), "--chunk", "0"])
    assert usage_error.value.code == 2
    assert "argument --chunk: expected a positive integer below 2^62, got '0'" in capsys.readouterr().err


def test_cli_imports_no_torch(step_file):
    code = (
        "import sys\n"
        "from harts.cli.main import main\n"
        f"assert main(['plan', 'kda', {str(step_file)!r}, '--chunk', '64', '--json']) == 0\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'fla', 'megatron')]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)


def test_bench_writes_records(tmp_path, capsys):
    out = tmp_path / "kda.json"
    assert main(["bench", "kda-calls", "--segments", "2000", "--chunk", "8", "--repeats", "1", "--out", str(out)]) == 0
    records = json.loads(out.read_text())
    assert [r["config"]["replay"] for r in records] == [True, False]
    for record in records:
        results = record["results"]
        assert results["segments"] == 2000 and results["calls"] >= 1
        assert results["plan_and_schedule_seconds_median"] > 0
    assert records[1]["results"]["replay_tokens"] == 0
