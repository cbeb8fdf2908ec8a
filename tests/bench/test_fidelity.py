"""The fidelity benchmark's harness: ablation and excess arithmetic from known per-position metrics, the
metrics themselves on hand-computed logits, parallel rows from known reports, error rows, and records.

`harts bench fidelity` end to end on a small tree step with the tiny model in fp32: in one process (the
ablation's depth bins cover every position, replay matches the baseline), and with `--parallel dp2`
(one record of both executions +/- recomputation against the single-process baseline, within the
thresholds of tests/parallel/test_verify.py). A failing case is an error row. tp2-sp, pp2 and ep2 are slow.
"""

import json
import math

import numpy as np
import pytest
import torch

from harts.bench.fidelity import (
    _plan_members,
    ablation_table,
    compact_attention_splits,
    compare,
    excess_over_floor,
    parallel_fidelity_rows,
    position_handoff_depth,
)
from harts.cli.main import main
from harts.parallel.launch import RankFailed
from tests.bench.helpers import sigterm_on_call, tiny_with_vocab


@pytest.mark.parametrize(
    "value, noise, expected",
    [
        pytest.param(2.0, 1.0, 1.0, id="double"),
        pytest.param(1.3, 1.0, 0.3, id="plus-30pct"),
        pytest.param(0.0, 0.5, -1.0, id="zero-value"),
        pytest.param(1.0, 0.0, None, id="zero-noise"),
        pytest.param(None, 1.0, None, id="no-value"),
        pytest.param(1.0, None, None, id="no-noise"),
    ],
)
def test_excess_over_floor(value, noise, expected):
    result = excess_over_floor(value, noise)
    assert result == (None if expected is None else pytest.approx(expected, rel=1e-12))


def _metrics(symkl, dnll):
    return {"symkl": torch.tensor(symkl, dtype=torch.float64), "abs_dnll": torch.tensor(dnll, dtype=torch.float64)}


def test_ablation_table_from_known_metrics():
    nan = math.nan
    depth = torch.tensor([0, 0, 1, 1, 1, 3])
    # Position 4 is a trajectory's last token (no target): its |dNLL| is NaN and is left out.
    has_target = torch.tensor([True, True, True, True, False, False])
    per_path = {
        "rerun": _metrics([0.0, 0.0, 1.0, 3.0, 5.0, 2.0], [0.0, 0.0, 0.2, 0.4, nan, nan]),
        "split-rerun": _metrics([1.0, 1.0, 2.0, 2.0, 2.0, 4.0], [0.1, 0.1, 0.4, 0.4, nan, nan]),
        "replay": _metrics([0.0, 0.0, 1.0, 3.0, 2.0, 2.0], [0.0, 0.0, 0.3, 0.3, nan, nan]),
        "no-replay": _metrics([1.0, 3.0, 6.0, 6.0, 6.0, 5.0], [0.1, 0.3, 0.6, 0.6, nan, nan]),
    }
    table = ablation_table(per_path, depth, has_target)
    # Over the split rerun (SymKL 1, |dNLL| 0.1 at depth 0; 2 and 0.4 at depth 1; 4 and none at depth 3).
    assert table["0"]["replay"]["symkl_excess_over_split_rerun"] == pytest.approx(-1.0)
    assert table["0"]["no-replay"]["abs_dnll_excess_over_split_rerun"] == pytest.approx(1.0)
    assert table["1"]["no-replay"]["symkl_excess_over_split_rerun"] == pytest.approx(2.0)
    assert table["1"]["replay"]["abs_dnll_excess_over_split_rerun"] == pytest.approx(-0.25)
    assert table["3"]["no-replay"]["symkl_excess_over_split_rerun"] == pytest.approx(0.25)
    assert table["3"]["no-replay"]["abs_dnll_excess_over_split_rerun"] is None
    assert list(table) == ["0", "1", "3"]
    assert [table[d]["positions"] for d in table] == [2, 3, 1]
    assert [table[d]["target_positions"] for d in table] == [2, 2, 0]

    zero = table["0"]  # the rerun noise is 0: no excess, and no division error
    assert zero["rerun"] == {"symkl": 0.0, "abs_dnll": 0.0}
    assert zero["no-replay"]["symkl"] == pytest.approx(2.0) and zero["no-replay"]["abs_dnll"] == pytest.approx(0.2)
    for path in ("replay", "no-replay"):
        assert zero[path]["symkl_excess_over_rerun"] is None and zero[path]["abs_dnll_excess_over_rerun"] is None

    one = table["1"]  # rerun: SymKL mean 3, |dNLL| mean over targets 0.3
    assert one["rerun"] == {"symkl": pytest.approx(3.0), "abs_dnll": pytest.approx(0.3)}
    assert one["replay"]["symkl"] == pytest.approx(2.0)
    assert one["replay"]["symkl_excess_over_rerun"] == pytest.approx(2.0 / 3.0 - 1.0)
    assert one["replay"]["abs_dnll_excess_over_rerun"] == pytest.approx(0.0, abs=1e-12)
    assert one["no-replay"]["symkl_excess_over_rerun"] == pytest.approx(1.0)
    assert one["no-replay"]["abs_dnll_excess_over_rerun"] == pytest.approx(1.0)

    three = table["3"]  # no position with a target at this depth
    assert three["no-replay"]["symkl_excess_over_rerun"] == pytest.approx(1.5)
    for path in ("rerun", "replay", "no-replay"):
        assert three[path]["abs_dnll"] is None
    assert three["no-replay"]["abs_dnll_excess_over_rerun"] is None


def _nested_step():
    """Four trajectories of 12 tokens, in batch order c, a, d, b: a shared prefix P, then X or Y, then one
    of two leaves each (a, b after X; c, d after Y). Siblings come in token order (X before Y, a before b,
    c before d) and tie, so the first is the heavy child: its sequence continues, the other waits."""
    from tests.trees.helpers import make_step

    prefix, x, y = [1] * 4, [2] * 4, [3] * 4
    paths = {"a": prefix + x + [4] * 4, "b": prefix + x + [5] * 4, "c": prefix + y + [6] * 4,
             "d": prefix + y + [7] * 4}
    order = ["c", "a", "d", "b"]
    return make_step([paths[k] for k in order], ids=order)


@pytest.mark.parametrize("microbatches, expected", [
    # One trie: Y leaves the heavy X (1 handoff), d leaves the heavy c under Y (2).
    pytest.param([[2, 0, 3, 1]], {"c": [0] * 4 + [1] * 8, "a": [0] * 12, "d": [0] * 4 + [1] * 4 + [2] * 4,
                                  "b": [0] * 8 + [1] * 4}, id="one-microbatch"),
    # Per microbatch: {a, b} and {c, d} are each one fork deep.
    pytest.param([[3, 1], [2, 0]], {"c": [0] * 12, "a": [0] * 12, "d": [0] * 8 + [1] * 4, "b": [0] * 8 + [1] * 4},
                 id="two-microbatches"),
])
def test_position_handoff_depth_counts_the_forks_off_the_heavy_child(microbatches, expected):
    from harts.trees.trie import PrefixIndex

    step = _nested_step()
    # Forks inside the first chunk: with replay the side branches would start in their parent's call.
    depth = position_handoff_depth(step, [np.asarray(m) for m in microbatches], PrefixIndex.from_step(step), 64)
    assert depth.dtype == np.int64
    for k, name in enumerate(step.ids):
        assert depth[step.offsets[k] : step.offsets[k + 1]].tolist() == expected[name], name


def test_cpu_deep_step_0_reaches_deep_handoffs():
    """configs/trees/cpu-deep.yaml, step 0 (seed 0) at T = 1,024, as `harts bench fidelity` plans it, counted
    from the no-replay KDA schedules (no model run): the binomial nesting (`fork_order: rounds`) holds
    hundreds of positions at every depth up to 5 (286 at depth 5) and reaches 6, as the config's comment says."""
    from harts.model.config import load_model_config
    from harts.trees.sources import iter_steps
    from harts.trees.trie import PrefixIndex

    (_, step, _), = iter_steps("configs/trees/cpu-deep.yaml", 0, [0])
    index = PrefixIndex.from_step(step)
    microbatches = _plan_members(step, 1024, "harts", index)
    chunk = load_model_config("cpu-small").kda.chunk_size
    counts = np.bincount(position_handoff_depth(step, microbatches, index, chunk))
    assert len(counts) >= 7 and counts[5] >= 250, counts
    assert (counts[:5] >= 700).all(), counts


def test_gpu_deep_step_0_reaches_deep_handoffs():
    """configs/trees/gpu-deep.yaml, step 0 (seed 0) at T = 65,536 with the h200 model's KDA chunk: the
    cpu-deep shape scaled to the GPU holds thousands of positions at every depth 0 to 6, as its comment says."""
    from harts.model.config import load_model_config
    from harts.trees.sources import iter_steps
    from harts.trees.trie import PrefixIndex

    (_, step, _), = iter_steps("configs/trees/gpu-deep.yaml", 0, [0])
    index = PrefixIndex.from_step(step)
    microbatches = _plan_members(step, 65536, "harts", index)
    chunk = load_model_config("h200").kda.chunk_size
    counts = np.bincount(position_handoff_depth(step, microbatches, index, chunk))
    assert len(microbatches) == 4 and len(counts) == 7, counts
    assert counts[6] >= 5000 and (counts >= 5000).all(), counts


def test_compare_on_hand_computed_logits():
    # Vocabulary 2 and an identity LM head: the hidden states are the logits. Reference [1, 1] gives
    # p = (1/2, 1/2); candidate [1 + ln 3, 1] gives q = (3/4, 1/4).
    weight = torch.eye(2)
    reference = torch.tensor([[1.0, 1.0], [0.5, -2.0], [1.0, 1.0]])
    candidate = torch.tensor([[1.0 + math.log(3.0), 1.0], [0.5, -2.0], [1.0 + math.log(3.0), 1.0]])
    targets = torch.tensor([0, 1, 1])
    has_target = torch.tensor([True, True, False])
    result = compare(weight, reference, candidate, targets, has_target, chunk=2)
    symkl = -0.25 * math.log(0.5 / 0.75) + 0.25 * math.log(0.5 / 0.25)
    cosine = (2.0 + math.log(3.0)) / (math.sqrt(2.0) * math.hypot(1.0 + math.log(3.0), 1.0))
    assert result["symkl"].tolist() == pytest.approx([symkl, 0.0, symkl], abs=1e-6)
    assert result["abs_dnll"][:2].tolist() == pytest.approx([math.log(1.5), 0.0], abs=1e-6)
    assert math.isnan(result["abs_dnll"][2])
    assert result["cosine"].tolist() == pytest.approx([cosine, 1.0, cosine], abs=1e-6)


@pytest.mark.parametrize(("elements", "rows"), [(1 << 28, 4096), (6, 3), (1, 1)], ids=["at-most-4096", "by-vocab",
                                                                                     "one-row"])
def test_compare_forms_a_bounded_number_of_logits_at_a_time(elements, rows, monkeypatch):
    """The default chunk is LOGIT_CHUNK_ELEMENTS logits (at most 4,096 rows), and the results do not depend on it."""
    import harts.bench.fidelity as fidelity

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(2, 3, generator=generator)  # vocabulary 2
    reference, candidate = (torch.randn(7, 3, generator=generator) for _ in range(2))
    targets, has_target = torch.tensor([0, 1, 1, 0, 1, 0, 0]), torch.ones(7, dtype=torch.bool)
    used = []
    inner = fidelity._compare
    monkeypatch.setattr(fidelity, "LOGIT_CHUNK_ELEMENTS", elements)
    monkeypatch.setattr(fidelity, "_compare", lambda *args: used.append(args[-1]) or inner(*args))
    result = fidelity.compare(weight, reference, candidate, targets, has_target)
    assert used == [rows]
    whole = fidelity.compare(weight, reference, candidate, targets, has_target, chunk=7)
    for key in ("symkl", "abs_dnll", "cosine"):
        torch.testing.assert_close(result[key], whole[key], rtol=1e-12, atol=1e-15)


def test_the_baseline_block_outputs_are_freed_before_the_logit_comparison(tree_step_path, tmp_path, capsys,
                                                                          monkeypatch):
    """The [L, S, D] fp32 block outputs of the baseline path are no longer held (by any path's BlockOutputs) when
    the logits are compared."""
    import gc
    import weakref

    import harts.bench.fidelity as fidelity

    kept, alive = [], []
    init, compare = fidelity.BlockOutputs.__init__, fidelity.compare

    def tracked_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self.kept is not None:
            kept.append(weakref.ref(self.kept))

    def checked_compare(*args, **kwargs):
        gc.collect()
        alive.append(any(ref() is not None for ref in kept))
        return compare(*args, **kwargs)

    monkeypatch.setattr(fidelity.BlockOutputs, "__init__", tracked_init)
    monkeypatch.setattr(fidelity, "compare", checked_compare)
    path, _ = tree_step_path
    code, records, _ = _fidelity(["--trees", path, "--capacity", "80", "--no-gradients"], tmp_path, capsys)
    assert code == 0, records[0]
    assert len(kept) == 1 and alive and not any(alive)


def _report(execution, recompute, loss, rel):
    return {
        "execution": execution, "recompute": recompute, "loss": loss, "loss_rel_diff": rel,
        "logit_cosine_min": 0.9999, "logit_cosine_mean": 0.99999, "max_abs_logprob_diff": 1e-6,
        "moe_loss_abs_diff": 0.0, "grad_rel_diff": 2e-5, "replica_grad_max_rel_diff": 0.0,
        "tokens_per_expert_max_abs_diff": 0.0, "reference_rows": 100, "candidate_rows": 80,
        "seconds": {"forward": 1.0},
    }


def test_parallel_fidelity_rows_from_known_reports():
    reports = [_report("baseline", False, -2.0, 1e-3), _report("baseline", True, 4.0, 0.0),
               _report("compact", False, 0.5, 2e-6), _report("compact", True, 0.0, 1e-3)]
    rows = parallel_fidelity_rows(reports)
    assert list(rows) == ["baseline", "compact"]
    assert list(rows["baseline"]) == ["no-recompute", "recompute"]
    assert rows["baseline"]["no-recompute"]["abs_dloss"] == pytest.approx(2e-3)
    assert rows["baseline"]["recompute"]["abs_dloss"] == 0.0
    assert rows["compact"]["no-recompute"]["abs_dloss"] == pytest.approx(1e-6)
    # A zero reference loss: verify's relative difference is over max(|loss|, 1e-30).
    assert rows["compact"]["recompute"]["abs_dloss"] == pytest.approx(1e-33)
    assert rows["compact"]["no-recompute"]["loss_reference"] == 0.5
    assert "seconds" not in rows["compact"]["recompute"]


def _fidelity(args, tmp_path, capsys):
    out = tmp_path / "fidelity.json"
    code = main(["bench", "fidelity", "--model", "tiny", "--dtype", "fp32", *args, "--out", str(out)])
    printed = capsys.readouterr().out
    return code, json.loads(out.read_text()), printed


@pytest.mark.parametrize("parallel", [[], ["--parallel", "dp2"]], ids=["single", "dp2"])
def test_vocabulary_smaller_than_the_tokens_is_an_error_row(parallel, tree_step_path, tmp_path, capsys):
    path, _ = tree_step_path
    code, records, printed = _fidelity(["--model", tiny_with_vocab(tmp_path, 4), "--trees", path, *parallel],
                                       tmp_path, capsys)
    (record,) = records
    assert code == 1 and "results" not in record and "vocabulary size 4" in record["error"]
    assert record["config"]["parallel"] == ("dp2" if parallel else "single")
    assert printed.startswith("fidelity: error: ")


def test_parallel_failures_are_error_rows(tree_step_path, tmp_path, capsys, monkeypatch):
    path, step = tree_step_path
    one = tmp_path / "one.jsonl"
    from harts.trees.io import write_step

    write_step(step.subset(np.array([0])), one)
    code, records, _ = _fidelity(["--trees", str(one), "--parallel", "dp2"], tmp_path, capsys)
    assert code == 1 and "2 data-parallel replicas need at least 2" in records[0]["error"], records[0]

    def failed_rank(*args, **kwargs):
        raise RankFailed("rank 0: RuntimeError: lost on purpose")

    monkeypatch.setattr("harts.parallel.launch.launch", failed_rank)
    code, records, _ = _fidelity(["--trees", path, "--parallel", "dp2"], tmp_path, capsys)
    assert code == 1 and records[0]["error"] == "RankFailed: rank 0: RuntimeError: lost on purpose"


def test_no_gradients_with_parallel_is_bad_input(tree_step_path, tmp_path, capsys):
    path, _ = tree_step_path
    assert main(["bench", "fidelity", "--model", "tiny", "--trees", path, "--parallel", "dp2", "--no-gradients",
                 "--out", str(tmp_path / "x.json")]) == 2
    assert "--no-gradients" in capsys.readouterr().err


def test_single_process_record(tree_step_path, tmp_path, capsys):
    path, step = tree_step_path
    code, records, printed = _fidelity(["--trees", path, "--capacity", "80"], tmp_path, capsys)
    (record,) = records
    assert code == 0, record
    config, results = record["config"], record["results"]
    assert config["parallel"] == "single" and config["world_size"] == 1
    assert results["semantic_tokens"] == step.num_semantic_tokens
    # Binned as `position_handoff_depth` counts them on the compact plan (T = 80, the tiny model's chunk 16).
    from harts.trees.trie import PrefixIndex

    index = PrefixIndex.from_step(step)
    counts = np.bincount(position_handoff_depth(step, _plan_members(step, 80, "harts", index), index, 16))
    assert list(results["ablation"]) == [str(d) for d in range(len(counts))] and len(counts) >= 2
    assert [row["positions"] for row in results["ablation"].values()] == counts.tolist()
    assert sum(row["target_positions"] for row in results["ablation"].values()) == (
        step.num_semantic_tokens - step.num_trajectories)
    assert results["logit_cosine"]["replay"]["min"] >= 0.99999
    assert set(results["logit_cosine"]) == {"rerun", "split-rerun", "replay", "no-replay"}
    for row in results["loss_and_gradients"].values():
        assert row["abs_dloss"] <= 1e-6 * abs(row["loss_baseline"]) and row["grad_cosine"] >= 0.99999
    assert "parallel_fidelity" not in results and "logit cosine vs baseline" in printed
    distance = results["block_distance"]
    assert list(distance) == ["0", "1", "2", "3"] and [row["kind"] for row in distance.values()] == [
        "kda", "kda", "kda", "mla"]
    assert all(set(row) == {"kind", *results["ablation"]} for row in distance.values())


def _row_bits_independent_of_row_count(num_rows: int, fewer_rows: int, chunk_size: int) -> bool:
    """Whether this CPU's kernels give the first `fewer_rows` rows the same bits in a matmul of `num_rows`
    rows as alone, and their chunks the same bits in a batched matmul over all the chunks as alone: the
    compact execution runs fewer rows and chunks than the baseline through the same kernels. (Some row
    counts take other kernels: here, matmuls of fewer than 8 rows.)"""
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(num_rows, 64, generator=generator), torch.randn(64, 96, generator=generator)
    chunks, fewer_chunks = -(-num_rows // chunk_size), -(-fewer_rows // chunk_size)
    a, b = (torch.randn(chunks, chunk_size, chunk_size, generator=generator) for _ in range(2))
    return (torch.equal((x @ weight)[:fewer_rows], x[:fewer_rows] @ weight)
            and torch.equal((a @ b)[:fewer_chunks], a[:fewer_chunks] @ b[:fewer_chunks]))


def test_block_distance_locates_the_handoffs(tmp_path, capsys):
    """On a step whose replay schedule hands states between calls, in one microbatch: the first layer
    (KDA, where handoffs act first) equals the baseline bit for bit at every depth with replay, and
    departs from it on side branches (depth >= 1) without replay.

    In exact arithmetic all three agree (no-replay only changes where chunks start), so the distances
    are rounding: replay repeats the baseline's arithmetic row for row, no-replay does not. That shows
    only where a row's bits do not depend on how many rows a kernel runs, so it is checked first."""
    from harts.trees.io import write_step
    from harts.trees.trie import PrefixIndex
    from tests.objective.helpers import random_tree_step

    step = random_tree_step(np.random.default_rng(1), num=8, max_len=120, vocab=5).step
    compact_rows = PrefixIndex.from_step(step).segment_tree().num_compact_tokens
    if not _row_bits_independent_of_row_count(step.num_semantic_tokens, compact_rows, chunk_size=16):
        pytest.skip("this CPU's matmul rounds a row differently at the two executions' row counts: replay's "
                    "bit-for-bit agreement with the baseline cannot be observed here")
    path = tmp_path / "deep.jsonl"
    write_step(step, path)
    code, records, _ = _fidelity(["--trees", str(path), "--capacity", "1024", "--no-gradients"], tmp_path, capsys)
    assert code == 0, records[0]
    first = records[0]["results"]["block_distance"]["0"]
    depths = [d for d in first if d != "kind"]
    assert len(depths) >= 2 and all(first[d]["replay"] == 0.0 for d in depths), first
    assert min(first[d]["no-replay"] for d in depths if d != "0") > 1e-8, first


def test_gradient_comparison_on_the_short_trajectories(tree_step_path, tmp_path, capsys):
    path, step = tree_step_path
    limit = int(np.median(step.lengths))
    code, records, _ = _fidelity(["--trees", path, "--capacity", "80", "--grad-max-tokens", str(limit)],
                                 tmp_path, capsys)
    results = records[0]["results"]
    assert code == 0 and results["semantic_tokens"] == step.num_semantic_tokens
    short = step.lengths <= limit
    assert results["gradient_inputs"] == {"trajectories": int(short.sum()), "max_tokens": limit,
                                          "semantic_tokens": int(step.lengths[short].sum())}
    assert 0 < int(short.sum()) < step.num_trajectories
    for row in results["loss_and_gradients"].values():
        assert row["abs_dloss"] <= 1e-6 * abs(row["loss_baseline"]) and row["grad_cosine"] >= 0.99999

    code, failed, printed = _fidelity(["--trees", path, "--capacity", "80", "--grad-max-tokens", "1"], tmp_path,
                                      capsys)
    assert code == 1 and failed[0]["error"].startswith("loss and gradients: ValueError: --grad-max-tokens 1")
    # What finished before the gradients stays in the error record (the same numbers: same weights and inputs).
    finished = {k: v for k, v in results.items() if k not in ("loss_and_gradients", "gradient_inputs")}
    assert failed[0]["finished_results"] == finished and "results" not in failed[0]
    assert "the record's finished_results" in printed


def test_sigterm_writes_an_error_row_naming_the_phase(tree_step_path, tmp_path, capsys, monkeypatch):
    import signal

    import harts.bench.fidelity as fidelity

    path, _ = tree_step_path
    monkeypatch.setattr(fidelity, "path_hidden", sigterm_on_call(fidelity.path_hidden, 2))
    code, records, _ = _fidelity(["--trees", path, "--capacity", "80"], tmp_path, capsys)
    assert code == 128 + signal.SIGTERM and records[0]["error"] == "rerun forward: Terminated: SIGTERM"
    assert "finished_results" not in records[0]


def _parallel_record(name, tree_step_path, tmp_path, capsys):
    from harts.parallel.config import load_parallel_config

    path, step = tree_step_path
    code, records, printed = _fidelity(["--trees", path, "--parallel", name], tmp_path, capsys)
    (record,) = records
    assert code == 0, record
    parallel = load_parallel_config(name)
    assert record["config"]["parallel"] == name and record["config"]["world_size"] == parallel.world_size
    results = record["results"]
    assert "ablation" not in results and results["microbatches"] % parallel.dp == 0
    assert results["microbatch_capacity"] == int(step.lengths.max())
    rows = results["parallel_fidelity"]
    assert {(e, s) for e in rows for s in rows[e]} == {
        (e, s) for e in ("baseline", "compact") for s in ("no-recompute", "recompute")
    }
    for execution, settings in rows.items():
        for setting, row in settings.items():
            where = f"{name} {execution} {setting}"
            assert row["logit_cosine_min"] >= 0.99999, where
            assert row["abs_dloss"] <= 1e-6 * abs(row["loss_reference"]), where
            assert row["grad_rel_diff"] <= 1e-4 and row["replica_grad_max_rel_diff"] <= 1e-6, where
            assert row["reference_rows"] == step.num_semantic_tokens
    assert rows["baseline"]["no-recompute"]["candidate_rows"] == step.num_semantic_tokens
    assert rows["compact"]["no-recompute"]["candidate_rows"] < step.num_semantic_tokens
    assert f"| {name} vs single-process baseline" in printed


def test_parallel_dp2_record(tree_step_path, tmp_path, capsys):
    _parallel_record("dp2", tree_step_path, tmp_path, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp2-sp", "pp2", "ep2"])
def test_parallel_record_slow(name, tree_step_path, tmp_path, capsys):
    _parallel_record(name, tree_step_path, tmp_path, capsys)


@pytest.mark.gpu
def test_parallel_dp2_record_cuda(tree_step_path, tmp_path, capsys):
    """NCCL ranks in bf16 with the GPU kernels: every row present; replicas hold one reduced gradient."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    path, _ = tree_step_path
    out = tmp_path / "fidelity.json"
    assert main(["bench", "fidelity", "--model", "tiny", "--trees", path, "--parallel", "dp2", "--device", "cuda",
                 "--out", str(out)]) == 0
    (record,) = json.loads(out.read_text())
    rows = record["results"]["parallel_fidelity"]
    assert record["config"]["dtype"] == "bf16" and len(rows["baseline"]) == len(rows["compact"]) == 2
    for settings in rows.values():
        for row in settings.values():
            assert row["logit_cosine_min"] >= 0.999 and row["replica_grad_max_rel_diff"] <= 1e-6, row


def test_compact_attention_splits_follow_the_query_groups():
    """Each trajectory's splits are where the compact layout's query group changes along its path."""
    from harts.model.config import load_model_config
    from harts.model.model import HybridModel
    from harts.objective.step import StepConfig, build_layout
    from harts.trees.trie import PrefixIndex
    from tests.objective.helpers import random_tree_step

    step = random_tree_step(np.random.default_rng(1), num=8, max_len=120, vocab=5).step
    model = HybridModel(load_model_config("tiny"))
    index = PrefixIndex.from_step(step)
    config = StepConfig(execution="compact")
    microbatches = [np.arange(4), np.arange(4, 8)]
    splits = compact_attention_splits(step, microbatches, model, config, index)
    assert sum(len(c) for c in splits) > 0
    for members in microbatches:
        layout = build_layout(step, members, model, config, index)
        groups = layout.groups
        starts = set(groups.q_index[groups.q_ptr[:-1]].tolist())  # first row of every query group
        rows = layout.semantic_rows.numpy()
        offset = 0
        for k in members.tolist():
            path = rows[offset : offset + int(step.lengths[k])]
            cuts = splits[k]
            assert (np.diff(cuts) > 0).all() and (len(cuts) == 0 or 0 < cuts[0] and cuts[-1] < len(path))
            # A group starts at each split; between splits the path stays in its group (no other group starts).
            assert all(int(path[c]) in starts for c in cuts)
            assert not [p for p in range(1, len(path)) if int(path[p]) in starts and p not in set(cuts.tolist())]
            offset += int(step.lengths[k])


@pytest.mark.parametrize("multiple_of", [1, 2, 3], ids=lambda d: f"dp{d}")
def test_gradient_subset_keeps_a_multiple_of_the_replicas(multiple_of):
    """The short trajectories in batch order, cut to a multiple of D (trajectories that each fill a
    microbatch must form K mod D = 0 microbatches)."""
    from harts.bench.fidelity import gradient_subset
    from tests.objective.helpers import random_tree_step

    step = random_tree_step(np.random.default_rng(3), num=9, max_len=60, vocab=5).step
    limit = int(np.sort(step.lengths)[6])
    short = np.flatnonzero(step.lengths <= limit)
    kept = short[: len(short) - len(short) % multiple_of]
    subset = gradient_subset(step, limit, multiple_of=multiple_of)
    assert subset.num_trajectories == len(kept) and subset.num_trajectories % multiple_of == 0
    for j, k in enumerate(kept):
        assert np.array_equal(subset.trajectory_tokens(j), step.trajectory_tokens(k))
    assert gradient_subset(step, None) is step
    with pytest.raises(ValueError, match="--grad-max-tokens 1: no trajectory is that short"):
        gradient_subset(step, 1, multiple_of=multiple_of)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gradient_cosine_is_the_cosine_of_the_flat_gradients(dtype):
    """Summed parameter by parameter, the cosine of every gradient as one vector (torch's cosine_similarity of the
    flat fp64 concatenations), for gradients of several shapes that point partly alike."""
    from harts.bench.fidelity import gradient_cosine

    generator = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (13,), (3, 4, 2), (1,)]
    first = [torch.randn(shape, generator=generator).to(dtype) for shape in shapes]
    second = [(a.float() + 0.7 * torch.randn(a.shape, generator=generator)).to(dtype) for a in first]
    flat = [torch.cat([g.double().flatten() for g in grads]) for grads in (first, second)]
    expected = float(torch.nn.functional.cosine_similarity(*flat, dim=0))
    assert 0.3 < expected < 0.95
    assert gradient_cosine(first, second) == pytest.approx(expected, rel=1e-12)
    assert gradient_cosine(first, first) == pytest.approx(1.0, rel=1e-12)
