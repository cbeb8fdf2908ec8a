"""The speedup benchmark's harness: metrics and breakdown from known timings, per-rank aggregation, error rows.

Pure arithmetic first (`speedup_metrics`, `execution_times`, `breakdown_terms`, `first_slot`), checked
against figures worked out by hand; then `harts bench speedup` itself on a small tree step with the tiny
model: the records' figures agree with each other (F + B = F/B/Grad time in one process, compression =
S / C, the breakdown's terms sum to the excess), a failing case is an error row (capacity below the longest
trajectory, a vocabulary smaller than the tokens, a parallel config the model cannot be split by, a rank
that fails) and `--json` prints the headline keys. `--parallel` runs dp2, tp2-sp, pp2 and ep2.
"""

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from harts.bench import speedup as speedup_module
from harts.bench.speedup import (
    HEADLINE_KEYS,
    breakdown_terms,
    execution_times,
    fewest_recomputed_blocks,
    first_slot,
    flops_metrics,
    headline,
    speedup_metrics,
    step_fits,
    timing_flags,
)
from harts.cli.main import main
from harts.config import from_dict
from harts.model.config import ModelConfig
from harts.model.moe import MoE
from harts.parallel.launch import RankFailed
from harts.trees.trie import PrefixIndex
from tests.bench.helpers import sigterm_on_call, tiny_with_vocab


@pytest.mark.parametrize(
    "base, comp, semantic, compact, expected",
    [
        pytest.param({"fbg_s": 10.0, "planning_s": 1.0}, {"fbg_s": 4.0, "planning_s": 2.0}, 1000, 400,
                     {"compression": 2.5, "fbg_speedup": 2.5, "core_speedup": 11 / 6, "efficiency": 1.0},
                     id="speedup-equals-compression"),
        pytest.param({"fbg_s": 9.0, "planning_s": 0.0}, {"fbg_s": 3.0, "planning_s": 0.5}, 600, 100,
                     {"compression": 6.0, "fbg_speedup": 3.0, "core_speedup": 9 / 3.5, "efficiency": 0.5},
                     id="half-efficient"),
        pytest.param({"fbg_s": 2.0, "planning_s": 0.1}, {"fbg_s": 4.0, "planning_s": 0.1}, 50, 50,
                     {"compression": 1.0, "fbg_speedup": 0.5, "core_speedup": 2.1 / 4.1, "efficiency": 0.5},
                     id="no-sharing-slower"),
    ],
)
def test_speedup_metrics_from_known_timings(base, comp, semantic, compact, expected):
    metrics = speedup_metrics(base, comp, semantic, compact)
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-12), key


@pytest.mark.parametrize(("pair_scale", "below_rows"), [(1.0, False), (2.0, True)],
                         ids=["pairs-shrink-like-rows", "pairs-shrink-less"])
def test_flops_metrics_count_each_execution_own_rows_and_pairs(pair_scale, below_rows):
    """On the tiny config: when the compact's (query, key) pairs shrink by exactly its rows' factor, every
    FLOP term (per row and per pair) shrinks by it, so the FLOPs compression is S / C; with twice the pairs it
    falls below S / C (the attention share of the work stays), and the efficiency over FLOPs rises above the one
    over rows by the same factor."""
    from harts.model.config import load_model_config

    config = load_model_config("tiny")
    semantic, compact, base_pairs = 6000, 1500, 800_000
    base = {"rows": semantic, "attention_pairs": base_pairs, "fbg_s": 8.0}
    comp = {"rows": compact, "attention_pairs": int(pair_scale * base_pairs * compact / semantic), "fbg_s": 2.5}
    metrics = flops_metrics(config, base, comp)
    compression = semantic / compact
    if below_rows:
        assert metrics["flops_compression"] < 0.99 * compression
    else:
        assert metrics["flops_compression"] == pytest.approx(compression, rel=1e-12)
    assert metrics["flops_efficiency"] == pytest.approx(8.0 / 2.5 / metrics["flops_compression"], rel=1e-12)


def _rank(forward, backward, grad_reduce, alone, layout=0.01):
    return {"layout": layout, "forward": forward, "backward": backward, "grad_reduce": grad_reduce,
            "grad_reduction_alone": alone}


def test_execution_times_critical_path_and_medians():
    # Repeat 1: rank 0 finishes early and waits 2.5 s inside its reduction; rank 1 is the critical path.
    # Repeat 2: rank 0 is slower in forward, rank 1 in backward: the maxima come from different ranks.
    # Repeat 3: an outlier the median ignores.
    samples = [
        [_rank(1.0, 2.0, 3.0, 0.5, layout=0.2), _rank(2.0, 3.5, 0.4, 0.6, layout=0.1)],
        [_rank(3.0, 1.0, 0.5, 0.3), _rank(1.0, 2.5, 0.1, 0.4, layout=0.3)],
        [_rank(30.0, 20.0, 9.0, 5.0, layout=4.0), _rank(30.0, 20.0, 9.0, 5.0)],
    ]
    times = execution_times(samples)
    # Per repeat: forward max 2, 3, 30; backward 3.5, 2.5, 20; alone 0.6, 0.4, 5; layout 0.2, 0.3, 4;
    # critical path max(1+2+3, 2+3.5+0.4) = 6, max(3+1+0.5, 1+2.5+0.1) = 4.5, 59.
    assert times.pop("fbg_repeats_s") == pytest.approx([6.0, 4.5, 59.0], rel=1e-12)
    assert times == pytest.approx(
        {"forward_s": 3.0, "backward_s": 3.5, "grad_reduction_s": 0.6, "layout_s": 0.3, "fbg_s": 6.0}, rel=1e-12
    )


def _timed(efficiency, baseline_repeats, compact_repeats):
    return {"efficiency": efficiency, "baseline": {"fbg_repeats_s": baseline_repeats},
            "compact": {"fbg_repeats_s": compact_repeats}}


@pytest.mark.parametrize("results, expected", [
    pytest.param(_timed(0.91, [10.0], [2.0]), [], id="clean-one-repeat"),
    pytest.param(_timed(1.05, [10.0, 10.9, 10.2], [2.0, 2.1]), [], id="at-the-limits"),
    pytest.param(_timed(2.86, [10.0], [2.0]), ["efficiency 2.86 > 1.05"], id="too-efficient"),
    pytest.param(_timed(0.8, [10.0, 10.1, 12.0], [2.0, 2.0]), ["baseline F+B+G varies by 20% over 3 repeats"],
                 id="noisy-baseline"),
    pytest.param(_timed(1.2, [10.0, 10.0], [2.0, 3.0]), ["efficiency 1.20 > 1.05", "compact F+B+G varies by 40%"],
                 id="both"),
])
def test_timing_flags(results, expected):
    flags = timing_flags(results)
    assert len(flags) == len(expected) and all(f.startswith(e) for f, e in zip(flags, expected)), flags


def test_execution_times_single_process_is_forward_plus_backward():
    samples = [[_rank(1.5, 2.5, 0.0, 0.0)], [_rank(1.0, 2.0, 0.0, 0.0)], [_rank(2.0, 4.0, 0.0, 0.0)]]
    times = execution_times(samples)
    assert times["fbg_s"] == pytest.approx(4.0) and times["grad_reduction_s"] == 0.0
    assert times["forward_s"] == 1.5 and times["backward_s"] == 2.5


def test_breakdown_terms_from_known_op_times():
    # Per layer and step: baseline KDA 1.0 s, MLA 2.0 s, LM head 1.0 s; compact KDA 0.8 s (one call over the
    # same rows 0.6 s, 0.5 s without the replay rows), MLA 1.5 s, LM head 0.4 s. 3 KDA + 1 MLA layers.
    b = {"kda": 1.0, "mla": 2.0, "lm_head": 1.0}
    c = {"kda": 0.8, "kda_one_call": 0.6, "kda_one_call_no_replay": 0.5, "mla": 1.5, "lm_head": 0.4}
    base = {"fbg_s": 10.0, "layout_s": 0.1}
    comp = {"fbg_s": 6.0, "layout_s": 0.35}
    result = breakdown_terms(b, c, 3, 1, base, comp, compression=2.0)
    # Ideal: 10 / 2 = 5; excess 1. Baseline ops 3 + 2 + 1 = 6, rest 4; compact ops 2.4 + 1.5 + 0.4 = 4.3, rest 1.7.
    expected = {
        "replay": 3 * 0.1,
        "boundary_handoff_and_calls": 3 * 0.2,
        "kda_other": 1.5 - 0.5 * 3.0,
        "ancestor_kv_attention": 1.5 - 0.5 * 2.0,
        "lm_head": 0.4 - 0.5 * 1.0,
        "per_row_other": 1.7 - 0.5 * 4.0,
    }
    assert result["ideal_compact_fbg_s"] == pytest.approx(5.0)
    assert result["excess_s"] == pytest.approx(1.0)
    assert result["terms_s"].keys() == expected.keys()
    for key, value in expected.items():
        assert result["terms_s"][key] == pytest.approx(value, abs=1e-12), key
    assert sum(result["terms_s"].values()) == pytest.approx(result["excess_s"], abs=1e-12)
    assert result["layout_materialisation_s"] == pytest.approx(0.25)
    assert result["ancestor_kv_attention_pairs_s"] is None
    # With pair counts: the compact attends to 0.6 of the baseline's pairs against C/S = 0.5, so 0.1 × the
    # baseline's 2.0 s of MLA of the 0.5 s ancestor_kv_attention term is the extra pairs'.
    paired = breakdown_terms(b, c, 3, 1, {**base, "attention_pairs": 1000}, {**comp, "attention_pairs": 600},
                             compression=2.0)
    assert paired["ancestor_kv_attention_pairs_s"] == pytest.approx(0.1 * 2.0)
    assert paired["terms_s"] == result["terms_s"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_breakdown_terms_always_sum_to_the_excess(seed):
    rng = np.random.default_rng(42 + seed)
    b = {key: float(rng.random()) for key in ("kda", "mla", "lm_head")}
    c = {key: float(rng.random()) for key in ("kda", "kda_one_call", "kda_one_call_no_replay", "mla", "lm_head")}
    base = {"fbg_s": float(rng.random() * 20), "layout_s": 0.0}
    comp = {"fbg_s": float(rng.random() * 20), "layout_s": 0.0}
    result = breakdown_terms(b, c, int(rng.integers(1, 8)), int(rng.integers(1, 4)), base, comp,
                             compression=float(1 + rng.random() * 5))
    assert sum(result["terms_s"].values()) == pytest.approx(result["excess_s"], abs=1e-9)


def test_first_slot(tree_step_path):
    _, step = tree_step_path
    microbatches = [np.array([3, 1]), np.array([0]), np.array([2, 4, 5]), np.array([6, 7])]
    sub, members = first_slot(step, microbatches, dp=2)
    assert sub.ids == tuple(step.ids[k] for k in (3, 1, 0))
    assert [m.tolist() for m in members] == [[0, 1], [2]]
    assert np.array_equal(sub.trajectory_tokens(2), step.trajectory_tokens(0))


def _record(results=None, error=None, parallel="dp2"):
    record = {"config": {"step": 3, "model": "tiny", "parallel": parallel}}
    if error is not None:
        record["error"] = error
    else:
        record["results"] = results
    return record


def test_headline_of_results_and_error_rows():
    results = {key: float(i + 1) for i, key in enumerate(HEADLINE_KEYS)}
    assert headline(_record(results)) == {"step": 3, "model": "tiny", "parallel": "dp2", **results}
    row = headline(_record(error="ValueError: boom"))
    assert row == {"step": 3, "model": "tiny", "parallel": "dp2", **dict.fromkeys(HEADLINE_KEYS),
                   "error": "ValueError: boom"}


def _speedup(args, tmp_path, capsys):
    out = tmp_path / "speedup.json"
    code = main(["bench", "speedup", "--model", "tiny", *args, "--out", str(out), "--json"])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return code, json.loads(out.read_text()), printed


@pytest.mark.parametrize("parallel", [[], ["--parallel", "dp2"]], ids=["single", "dp2"])
@pytest.mark.parametrize("case", ["capacity", "vocabulary"])
def test_failing_case_is_an_error_row(case, parallel, tree_step_path, tmp_path, capsys):
    path, step = tree_step_path
    args = ["--trees", path, "--capacity", "1000", "--repeats", "1", *parallel]
    if case == "capacity":
        args[args.index("--capacity") + 1] = str(int(step.lengths.max()) - 1)
        expected = "more than the capacity"
    else:
        args = ["--model", tiny_with_vocab(tmp_path, 4), *args]
        expected = "vocabulary size 4"
    code, records, printed = _speedup(args, tmp_path, capsys)
    assert code == 1 and len(records) == 1 and "results" not in records[0]
    assert expected in records[0]["error"], records[0]["error"]
    assert records[0]["config"]["parallel"] == ("dp2" if parallel else "single")
    assert printed == [{"step": 0, "model": records[0]["config"]["model"], "parallel": records[0]["config"]["parallel"],
                        **dict.fromkeys(HEADLINE_KEYS), "error": records[0]["error"]}]


def test_unsplittable_model_and_failed_rank_are_error_rows(tree_step_path, tmp_path, capsys, monkeypatch):
    path, _ = tree_step_path
    too_wide = tmp_path / "tp4.yaml"
    too_wide.write_text("name: tp4\ntp: 4\n")
    code, records, _ = _speedup(["--trees", path, "--capacity", "80", "--parallel", str(too_wide)], tmp_path, capsys)
    assert code == 1 and "not divisible by tp (4)" in records[0]["error"]
    assert records[0]["config"]["world_size"] == 4

    def failed_rank(*args, **kwargs):
        raise RankFailed("rank 1: RuntimeError: lost on purpose")

    monkeypatch.setattr("harts.parallel.launch.launch", failed_rank)
    code, records, printed = _speedup(["--trees", path, "--capacity", "80", "--parallel", "dp2"], tmp_path, capsys)
    assert code == 1 and records[0]["error"] == "--parallel dp2: RankFailed: rank 1: RuntimeError: lost on purpose"
    assert printed[0]["error"] == records[0]["error"]


def test_sigterm_ends_the_run_with_an_error_row_keeping_the_finished_steps(tree_step_path, tmp_path, capsys,
                                                                          monkeypatch):
    import signal

    import harts.objective.step as step_module

    path, _ = tree_step_path
    monkeypatch.setattr(step_module, "run_step", sigterm_on_call(step_module.run_step, 2))
    before = signal.getsignal(signal.SIGTERM)
    code, records, _ = _speedup(["--trees", path, "--capacity", "80", "--repeats", "1"], tmp_path, capsys)
    assert code == 128 + signal.SIGTERM and len(records) == 1
    assert records[0]["error"] == "compact warm-up: Terminated: SIGTERM"
    (finished,) = records[0]["finished_steps"]
    assert finished["phase"] == "baseline warm-up" and finished["forward"] > 0 and finished["backward"] > 0
    assert signal.getsignal(signal.SIGTERM) is before


def test_sigterm_between_steps_keeps_the_finished_records(tree_step_path, tmp_path, capsys, monkeypatch):
    import os
    import signal

    import harts.trees.sources as steps_module

    path, _ = tree_step_path
    iter_steps = steps_module.iter_steps

    def terminated_before_the_second_step(*args, **kwargs):
        yield from iter_steps(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM must have been raised")

    monkeypatch.setattr(steps_module, "iter_steps", terminated_before_the_second_step)
    code, records, _ = _speedup(["--trees", path, "--capacity", "80", "--repeats", "1"], tmp_path, capsys)
    assert code == 128 + signal.SIGTERM
    assert len(records) == 1 and "error" not in records[0] and records[0]["results"]["fbg_speedup"] > 0


def test_profile_of_the_largest_microbatch(tree_step_path, tmp_path, capsys):
    from harts.bench.speedup import PROFILE_TOP

    path, step = tree_step_path
    code, records, _ = _speedup(["--trees", path, "--capacity", "80", "--repeats", "1", "--no-breakdown", "--profile"],
                                tmp_path, capsys)
    assert code == 0
    profile = records[0]["results"]["profile"]
    assert set(profile) == {"baseline", "compact"}
    assert profile["baseline"]["rows"] == profile["baseline"]["semantic_tokens"]
    assert 0 < profile["compact"]["rows"] < profile["compact"]["semantic_tokens"]
    for name, entry in profile.items():
        assert entry["sorted_by"] == "self_cpu_time_total" and entry["semantic_tokens"] > 0
        assert 0 < len(entry["top"]) <= PROFILE_TOP and entry["total_self_ms"] > 0
        times = [op["self_ms"] for op in entry["top"]]
        assert times == sorted(times, reverse=True) and all(op["calls"] >= 1 for op in entry["top"])
        assert any(op["name"] == "aten::mm" or op["name"] == "aten::addmm" for op in entry["top"]), name


def test_compact_attention_backend_applies_to_the_compact_execution_only(tree_step_path, tmp_path, capsys):
    import argparse

    from harts.bench.speedup import _step_configs

    args = argparse.Namespace(device="cpu", recompute=True, attention_backend=None, compact_attention_backend="naive",
                              kda_backend="fla", logprob_grad_precision="input", recompute_blocks=2,
                              keep_attention=True, keep_kda_intermediates=True, logprob_chunk_rows=1024,
                              compact_recompute_blocks=None, recompute_by_rows=False)
    configs = _step_configs(args, "fp32")
    assert (configs["baseline"].attention_backend, configs["compact"].attention_backend) == ("sdpa", "naive")
    for config in configs.values():
        assert (config.logprob_grad_precision, config.recompute, config.recompute_blocks) == ("input", True, 2)
        assert config.logprob_chunk_rows == 1024
        assert config.keep_attention and config.keep_kda_intermediates and config.kda_backend == "fla"
    path, _ = tree_step_path
    code, records, _ = _speedup(["--trees", path, "--capacity", "80", "--repeats", "1", "--no-breakdown",
                                 "--compact-attention-backend", "naive"], tmp_path, capsys)
    assert code == 0 and records[0]["config"]["compact_attention_backend"] == "naive"


def test_recompute_blocks(tree_step_path, tmp_path, capsys):
    """--recompute-blocks reaches both executions' StepConfig and the record; without --recompute it is an error."""
    path, _ = tree_step_path
    code, records, _ = _speedup(["--trees", path, "--capacity", "80", "--repeats", "1", "--no-breakdown",
                                 "--recompute", "--recompute-blocks", "1"], tmp_path, capsys)
    assert code == 0 and records[0]["config"]["recompute_blocks"] == 1
    assert records[0]["config"]["keep_attention"] is False
    code = main(["bench", "speedup", "--model", "tiny", "--trees", path, "--recompute-blocks", "1",
                 "--out", str(tmp_path / "bad.json")])
    assert code != 0 and "--recompute-blocks needs --recompute" in capsys.readouterr().err


def test_compact_recompute_blocks_and_recompute_by_rows(tree_step_path, tmp_path, capsys, monkeypatch):
    """--compact-recompute-blocks reaches the compact execution's StepConfig only and --recompute-by-rows both,
    and the record names both; each without what it needs is a one-line error, no record."""
    from harts.objective import step as step_module

    seen = []
    run_step = step_module.run_step
    monkeypatch.setattr(step_module, "run_step", lambda model, step, microbatches, config, **k: seen.append(
        (config.execution, config.recompute_blocks, config.recompute_by_rows)) or run_step(
        model, step, microbatches, config, **k))
    path, _ = tree_step_path
    code, records, _ = _speedup(["--trees", path, "--capacity", "80", "--repeats", "1", "--no-breakdown",
                                 "--recompute", "--recompute-blocks", "2", "--compact-recompute-blocks", "1",
                                 "--recompute-by-rows"], tmp_path, capsys)
    config = records[0]["config"]
    assert code == 0 and (config["recompute_blocks"], config["compact_recompute_blocks"]) == (2, 1)
    assert config["recompute_by_rows"] is True
    assert seen and set(seen) == {("baseline", 2, True), ("compact", 1, True)}
    for flags, message in ((["--compact-recompute-blocks", "1"], "--compact-recompute-blocks needs --recompute"),
                           (["--recompute", "--recompute-by-rows"], "--recompute-by-rows scales the kept blocks")):
        code = main(["bench", "speedup", "--model", "tiny", "--trees", path, *flags,
                     "--out", str(tmp_path / "bad.json")])
        err = capsys.readouterr().err
        assert code != 0 and message in err and "Traceback" not in err
        assert not (tmp_path / "bad.json").exists()


@pytest.mark.parametrize("num_blocks", [1, 2, 4, 24])
def test_fewest_recomputed_blocks_bisects_from_every_block(num_blocks):
    """Against every threshold k (n fits when n >= k): the answer is k, the first try is every block, and the
    tries are at most 1 + ceil(log2(num_blocks)); with k above num_blocks nothing fits, a ValueError."""
    for k in range(1, num_blocks + 2):
        tried = []
        fits = lambda n: tried.append(n) or n >= k  # noqa: E731
        if k > num_blocks:
            with pytest.raises(ValueError, match=f"even with every block \\({num_blocks}\\) recomputed"):
                fewest_recomputed_blocks(fits, num_blocks)
            assert tried == [num_blocks]
            continue
        assert fewest_recomputed_blocks(fits, num_blocks) == k, (k, tried)
        assert tried[0] == num_blocks and len(tried) <= 1 + math.ceil(math.log2(num_blocks))
        assert all(1 <= n <= num_blocks for n in tried)


def test_step_fits_answers_no_on_out_of_memory_and_frees_the_gradients(tree_step_path, monkeypatch):
    """An out-of-memory error in the step is the answer "does not fit" (the gradients it left freed); a step that
    runs fits; another error is raised."""
    from harts.model.config import load_model_config
    from harts.model.model import HybridModel
    from harts.objective import step as step_module
    from harts.objective.step import StepConfig

    _, step = tree_step_path
    model = HybridModel(load_model_config("tiny"))
    model.init_weights(0)
    config = StepConfig(execution="baseline", recompute=True, recompute_blocks=2)
    microbatches = [np.arange(step.num_trajectories)]
    run_step = step_module.run_step

    def out_of_memory(model, step, microbatches, config, **kwargs):
        run_step(model, step, microbatches, config, **kwargs)  # leaves gradients, as a backward that failed late
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    answer = step_fits(model, step, microbatches, config, None, torch.device("cpu"))
    assert answer["fits"] is True and answer["recompute_blocks"] == 2 and answer["seconds"] > 0
    monkeypatch.setattr(step_module, "run_step", out_of_memory)
    answer = step_fits(model, step, microbatches, config, None, torch.device("cpu"))
    assert answer["fits"] is False and all(p.grad is None for p in model.parameters())
    monkeypatch.setattr(step_module, "run_step", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("other")))
    with pytest.raises(RuntimeError, match="other"):
        step_fits(model, step, microbatches, config, None, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_step_fits_on_cuda_recovers_from_a_real_out_of_memory():
    """With the GPU's memory taken but for less than a step needs beyond the weights, the step runs out of memory:
    the answer is no, nothing it allocated stays, and the same step fits again once the memory is given back."""
    from harts.model.config import load_model_config
    from harts.model.model import HybridModel
    from harts.objective.step import StepConfig
    from harts.trees.io import read_step

    step = read_step(Path(__file__).parents[2] / "data/samples/tiny-step.jsonl.gz")
    device = torch.device("cuda", torch.cuda.current_device())
    with device:
        model = HybridModel(load_model_config("tiny"))
    model.init_weights(0)
    config = StepConfig(execution="baseline", recompute=True, recompute_blocks=2, dtype="bf16", kda_backend="torch")
    microbatches = [np.arange(step.num_trajectories)]
    assert step_fits(model, step, microbatches, config, None, device)["fits"] is True
    weights = torch.cuda.memory_allocated(device)
    answer = step_fits(model, step, microbatches, config, None, device)
    assert answer["fits"] is True and torch.cuda.memory_allocated(device) == weights
    assert answer["peak_memory_bytes"] - weights > 8 << 20, "the step must need more than the 2 MB pieces left"
    # Take every byte the allocator can get: one large piece, then 2 MB pieces until none is left.
    taken = [torch.empty(torch.cuda.mem_get_info(device)[0] - (64 << 20), dtype=torch.uint8, device=device)]
    try:
        while True:
            taken.append(torch.empty(2 << 20, dtype=torch.uint8, device=device))
    except torch.OutOfMemoryError:
        pass
    answer = step_fits(model, step, microbatches, config, None, device)
    del taken
    torch.cuda.empty_cache()
    assert answer["fits"] is False and torch.cuda.memory_allocated(device) == weights
    assert step_fits(model, step, microbatches, config, None, device)["fits"] is True


def _simulated_memory(monkeypatch, fewest):
    """run_step raises out of memory when an execution recomputes fewer blocks than `fewest[execution]`; the
    (execution, blocks) of every step that ran, in order."""
    from harts.objective import step as step_module

    monkeypatch.setattr(speedup_module, "AUTO_DEVICES", ("cpu", "cuda"))
    ran = []
    run_step = step_module.run_step

    def simulated(model, step, microbatches, config, **kwargs):
        if config.recompute_blocks < fewest[config.execution]:
            raise torch.OutOfMemoryError(f"{config.execution} at {config.recompute_blocks} blocks (simulated)")
        ran.append((config.execution, config.recompute_blocks))
        return run_step(model, step, microbatches, config, **kwargs)

    monkeypatch.setattr(step_module, "run_step", simulated)
    return ran


def test_recompute_blocks_auto_finds_each_executions_fewest(tree_step_path, tmp_path, capsys, monkeypatch):
    """`auto` searches each execution for itself (the tiny model's 4 blocks): the timed steps run the blocks found,
    the record's config holds them and names the executions searched, and results keep every probe."""
    ran = _simulated_memory(monkeypatch, {"baseline": 3, "compact": 2})
    path, _ = tree_step_path
    code, records, _ = _speedup(["--trees", path, "--capacity", "80", "--repeats", "2", "--no-breakdown",
                                 "--recompute", "--recompute-blocks", "auto", "--recompute-by-rows"], tmp_path, capsys)
    assert code == 0, records
    config, search = records[0]["config"], records[0]["results"]["recompute_search"]
    assert (config["recompute_blocks"], config["compact_recompute_blocks"]) == (3, 2)
    assert config["recompute_blocks_auto"] == ["baseline", "compact"]
    for name, found, tries in (("baseline", 3, [(4, True), (2, False), (3, True)]),
                               ("compact", 2, [(4, True), (2, True), (1, False)])):
        assert search[name]["recompute_blocks"] == found
        assert [(p["recompute_blocks"], p["fits"]) for p in search[name]["probes"]] == tries
    # After the search: one warm-up and two timed steps of each execution, with the blocks found.
    assert ran[-6:] == [("baseline", 3), ("compact", 2)] + [("baseline", 3), ("compact", 2)] * 2


def test_recompute_blocks_auto_beside_given_blocks_and_when_nothing_fits(tree_step_path, tmp_path, capsys,
                                                                         monkeypatch):
    """A given --compact-recompute-blocks is kept while the baseline's are searched; an execution that does not fit
    with every block recomputed is an error row that says so."""
    fewest = {"baseline": 3, "compact": 1}
    _simulated_memory(monkeypatch, fewest)
    path, _ = tree_step_path
    flags = ["--trees", path, "--capacity", "80", "--repeats", "1", "--no-breakdown", "--recompute",
             "--recompute-blocks", "auto", "--compact-recompute-blocks", "4"]
    code, records, _ = _speedup(flags, tmp_path, capsys)
    config = records[0]["config"]
    assert code == 0 and (config["recompute_blocks"], config["compact_recompute_blocks"]) == (3, 4)
    assert config["recompute_blocks_auto"] == ["baseline"]
    assert list(records[0]["results"]["recompute_search"]) == ["baseline"]
    fewest["baseline"] = 5
    code = main(["bench", "speedup", "--model", "tiny", *flags, "--out", str(tmp_path / "none.json")])
    (record,) = json.loads((tmp_path / "none.json").read_text())
    assert code != 0 and record["config"]["recompute_blocks"] == "auto"
    assert "the baseline execution: the step does not fit in memory even with every block (4)" in record["error"]


def _simulated_probes(monkeypatch, fewest, peaks):
    """step_fits answers from tables: an execution fits from `fewest[execution]` blocks on, with the peak
    `peaks[execution][blocks]`; the (execution, blocks) of every probe, in order."""
    monkeypatch.setattr(speedup_module, "AUTO_DEVICES", ("cpu", "cuda"))
    probed = []

    def simulated(model, step, microbatches, config, index, device):
        blocks = config.recompute_blocks
        probed.append((config.execution, blocks))
        return {"recompute_blocks": blocks, "fits": blocks >= fewest[config.execution],
                "peak_memory_bytes": peaks[config.execution][blocks], "seconds": 0.0}

    monkeypatch.setattr(speedup_module, "step_fits", simulated)
    return probed


@pytest.mark.parametrize(("baseline_flag", "fewest", "peaks", "found", "limit", "probed"), [
    # Memory alone would take 1 compact block; only 3 and 4 peak at or below the given baseline's 100 (3: equal).
    ("2", {"baseline": 1, "compact": 1}, {"baseline": {2: 100}, "compact": {4: 60, 3: 100, 2: 110, 1: 130}},
     3, 100, [("baseline", 2), ("compact", 4), ("compact", 2), ("compact", 3)]),
    # The baseline searched first (3 blocks): the limit is its probe at 3, not its first probe at 4.
    ("auto", {"baseline": 3, "compact": 1}, {"baseline": {4: 80, 3: 95, 2: 120}, "compact": {4: 60, 3: 90, 2: 96}},
     3, 95, [("baseline", 4), ("baseline", 2), ("baseline", 3), ("compact", 4), ("compact", 2), ("compact", 3)]),
], ids=["given-baseline-blocks", "searched-baseline-blocks"])
def test_compact_recompute_blocks_within_baseline(baseline_flag, fewest, peaks, found, limit, probed, tree_step_path,
                                                  tmp_path, capsys, monkeypatch):
    """within-baseline: the fewest compact blocks whose step fits and peaks no higher than a baseline step at the
    baseline's own blocks (a probe of its own when the baseline's blocks are given)."""
    probes = _simulated_probes(monkeypatch, fewest, peaks)
    path, _ = tree_step_path
    code, records, _ = _speedup(["--trees", path, "--capacity", "80", "--repeats", "1", "--no-breakdown",
                                 "--recompute", "--recompute-blocks", baseline_flag,
                                 "--compact-recompute-blocks", "within-baseline"], tmp_path, capsys)
    assert code == 0, records
    config, search = records[0]["config"], records[0]["results"]["recompute_search"]
    assert config["compact_recompute_blocks"] == found and probes == probed
    assert search["compact"]["within_peak_memory_bytes"] == limit
    assert [p["recompute_blocks"] for p in search["compact"]["probes"]] == [n for e, n in probed if e == "compact"]
    baseline_probe = search["compact"]["baseline_probe"]
    if baseline_flag == "auto":
        assert baseline_probe is None and config["recompute_blocks_auto"] == ["baseline", "compact"]
    else:
        assert baseline_probe["recompute_blocks"] == 2 and config["recompute_blocks_auto"] == ["compact"]


def test_compact_recompute_blocks_within_baseline_when_nothing_is(tree_step_path, tmp_path, capsys, monkeypatch):
    _simulated_probes(monkeypatch, {"baseline": 1, "compact": 1}, {"baseline": {2: 50}, "compact": {4: 60}})
    path, _ = tree_step_path
    code, records, _ = _speedup(["--trees", path, "--capacity", "80", "--repeats", "1", "--no-breakdown",
                                 "--recompute", "--recompute-blocks", "2",
                                 "--compact-recompute-blocks", "within-baseline"], tmp_path, capsys)
    (record,) = records
    assert code != 0 and record["config"]["compact_recompute_blocks"] == "within-baseline"
    assert ("--compact-recompute-blocks within-baseline: the compact execution: the step does not fit within the "
            "baseline's peak (0.00 GB) even with every block (4) recomputed") in record["error"]


@pytest.mark.parametrize("flags, message", [
    (["--recompute", "--recompute-blocks", "auto"], "--recompute-blocks auto searches one GPU's memory"),
    (["--recompute", "--compact-recompute-blocks", "within-baseline"],
     "--compact-recompute-blocks within-baseline searches one GPU's memory"),
    (["--recompute", "--variant", "compact-recompute-blocks=within-baseline"],
     "--variant compact-recompute-blocks=within-baseline: --compact-recompute-blocks within-baseline searches"),
    (["--recompute", "--recompute-blocks", "within-baseline"], "below 2^62 or auto, got 'within-baseline'"),
    (["--recompute", "--compact-recompute-blocks", "some"], "below 2^62, auto or within-baseline, got 'some'"),
    (["--recompute", "--recompute-blocks", "2", "--compact-recompute-blocks", "auto"],
     "--compact-recompute-blocks auto searches one GPU's memory"),
    (["--recompute", "--variant", "recompute-blocks=auto"], "--variant recompute-blocks=auto: --recompute-blocks"),
    (["--recompute-blocks", "auto"], "--recompute-blocks needs --recompute"),
    (["--recompute", "--recompute-blocks", "some"], "below 2^62 or auto, got 'some'"),
], ids=["on-cpu", "within-on-cpu", "within-variant-on-cpu", "within-for-the-baseline", "compact-not-a-number",
        "compact-on-cpu", "variant-on-cpu", "without-recompute", "not-a-number"])
def test_recompute_blocks_auto_errors(flags, message, tree_step_path, tmp_path, capsys):
    path, _ = tree_step_path
    out = tmp_path / "speedup.json"
    try:
        code = main(["bench", "speedup", "--model", "tiny", "--trees", path, *flags, "--out", str(out)])
    except SystemExit as exit:  # argparse's own errors
        code = exit.code
    err = capsys.readouterr().err
    assert code != 0 and message in err and "Traceback" not in err, err
    assert not out.exists()


def test_recompute_blocks_auto_needs_one_process(tree_step_path, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(speedup_module, "AUTO_DEVICES", ("cpu", "cuda"))
    path, _ = tree_step_path
    code = main(["bench", "speedup", "--model", "tiny", "--trees", path, "--recompute", "--recompute-blocks",
                 "auto", "--parallel", "dp2", "--out", str(tmp_path / "bad.json")])
    err = capsys.readouterr().err
    assert code != 0 and "needs --device cuda and no --parallel" in err and "Traceback" not in err


def test_keep_attention(tree_step_path, tmp_path, capsys, monkeypatch):
    """--keep-attention reaches the model's forward in both executions and the record; with a backend whose
    kernels cannot be kept it is an error naming the field, one line, no record."""
    from harts.model.model import HybridModel

    kept = []
    forward = HybridModel.forward
    monkeypatch.setattr(HybridModel, "forward", lambda self, *a, **k: kept.append(k["keep_attention"]) or
                        forward(self, *a, **k))
    path, _ = tree_step_path
    code, records, _ = _speedup(["--trees", path, "--capacity", "80", "--repeats", "1", "--no-breakdown",
                                 "--recompute", "--keep-attention"], tmp_path, capsys)
    assert code == 0 and records[0]["config"]["keep_attention"] is True
    assert kept and set(kept) == {True}
    for flags, message in ((["--recompute", "--compact-attention-backend", "flex"],
                            "keep_attention needs an attention backend among"),
                           ([], "--keep-attention needs --recompute")):
        code = main(["bench", "speedup", "--model", "tiny", "--trees", path, "--keep-attention", *flags,
                     "--out", str(tmp_path / "bad.json")])
        err = capsys.readouterr().err
        assert code != 0 and message in err and "Traceback" not in err
        assert not (tmp_path / "bad.json").exists()


def _check_record(record, step, parallel: str, world_size: int):
    config, results = record["config"], record["results"]
    assert config["parallel"] == parallel and config["world_size"] == world_size
    semantic = step.num_semantic_tokens
    assert results["semantic_tokens"] == semantic
    assert results["baseline"]["attention_pairs"] == sum(int(n) * (int(n) + 1) // 2 for n in step.lengths)
    pairs = (results["compact"]["attention_pairs"], results["baseline"]["attention_pairs"])
    assert results["attention_pair_ratio"] == pairs[0] / pairs[1]
    assert 0 < results["attention_pair_ratio"] < 1
    base, comp = results["baseline"], results["compact"]
    assert base["rows"] == semantic and base["attention_kv_rows"] == semantic
    assert results["compact_tokens"] == comp["rows"] >= results["lower_bound_compact_tokens"]
    assert results["lower_bound_compact_tokens"] == PrefixIndex.from_step(step).segment_tree().num_compact_tokens
    assert results["compression"] == pytest.approx(semantic / comp["rows"])
    for name, execution in (("baseline", base), ("compact", comp)):
        assert len(execution["samples"]) == 1 and len(execution["samples"][0]) == world_size, name
        assert execution_times(execution["samples"]) == {k: execution[k] for k in execution_times(execution["samples"])}
        assert execution["planning_s"] >= execution["layout_s"] > 0
        assert execution["fbg_s"] >= max(execution["forward_s"], execution["backward_s"]) > 0
        assert execution["peak_memory_bytes"] > 0
    assert results["fbg_speedup"] == pytest.approx(base["fbg_s"] / comp["fbg_s"])
    assert results["efficiency"] == pytest.approx(results["fbg_speedup"] / results["compression"])
    model_config = from_dict(ModelConfig, config["model_config"], "record")
    assert {k: results[k] for k in ("flops_compression", "flops_efficiency")} == flops_metrics(model_config, base, comp)


def test_single_process_record(tree_step_path, tmp_path, capsys):
    path, step = tree_step_path
    code, records, printed = _speedup(["--trees", path, "--capacity", "80", "--repeats", "1"], tmp_path, capsys)
    assert code == 0, records
    (record,) = records
    _check_record(record, step, "single", 1)
    results = record["results"]
    for name in ("baseline", "compact"):
        execution = results[name]
        assert execution["grad_reduction_s"] == 0.0
        assert execution["fbg_s"] == pytest.approx(execution["forward_s"] + execution["backward_s"])
    breakdown = results["breakdown"]
    assert breakdown["ideal_compact_fbg_s"] == pytest.approx(results["baseline"]["fbg_s"] / results["compression"])
    assert sum(breakdown["terms_s"].values()) == pytest.approx(breakdown["excess_s"], abs=1e-9)
    assert printed == [{"step": 0, "model": "tiny", "parallel": "single",
                        **{key: results[key] for key in HEADLINE_KEYS}}]


def _parallel_record(name, tree_step_path, tmp_path, capsys):
    from harts.parallel.config import load_parallel_config

    path, step = tree_step_path
    code, records, _ = _speedup(["--trees", path, "--capacity", "80", "--repeats", "1", "--parallel", name],
                                tmp_path, capsys)
    assert code == 0, records
    (record,) = records
    parallel = load_parallel_config(name)
    _check_record(record, step, name, parallel.world_size)
    results = record["results"]
    assert results["world_size"] == parallel.world_size and "breakdown" not in results
    assert results["breakdown_skipped"].startswith("--parallel")
    for name in ("baseline", "compact"):
        assert results[name]["microbatches"] % parallel.dp == 0
        assert len(results[name]["kda_calls"]) == results[name]["microbatches"]
    return record


def test_parallel_dp2_record(tree_step_path, tmp_path, capsys):
    record = _parallel_record("dp2", tree_step_path, tmp_path, capsys)
    for name in ("baseline", "compact"):
        execution = record["results"][name]
        assert execution["grad_reduction_s"] > 0
        (ranks,) = execution["samples"]
        assert execution["fbg_s"] == pytest.approx(max(r["forward"] + r["backward"] + r["grad_reduce"] for r in ranks))
        assert all(math.isfinite(r["grad_reduction_alone"]) and r["grad_reduction_alone"] > 0 for r in ranks)


@pytest.mark.parametrize("name", ["tp2-sp", "pp2", "ep2"])
def test_parallel_record_other_configs(name, tree_step_path, tmp_path, capsys):
    _parallel_record(name, tree_step_path, tmp_path, capsys)


@pytest.mark.gpu
def test_parallel_dp2_record_cuda(tree_step_path, tmp_path, capsys):
    """NCCL ranks, CUDA allocator peaks and bf16 with the GPU kernels (fla KDA, varlen attention)."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    path, step = tree_step_path
    code, records, _ = _speedup(["--trees", path, "--capacity", "80", "--repeats", "2", "--parallel", "dp2",
                                 "--device", "cuda"], tmp_path, capsys)
    (record,) = records
    assert code == 0, record
    assert record["config"]["dtype"] == "bf16"
    results = record["results"]
    for name in ("baseline", "compact"):
        execution = results[name]
        assert len(execution["samples"]) == 2 and all(len(ranks) == 2 for ranks in execution["samples"])
        assert execution_times(execution["samples"]) == {k: execution[k] for k in execution_times(execution["samples"])}
        assert execution["grad_reduction_s"] > 0 and execution["peak_memory_bytes"] > 0
    assert 0 < results["baseline_mfu"] < 1


def test_op_times_one_call_rows(monkeypatch):
    """The breakdown's one-call KDA variants run the compact layout's KDA rows as one call (every
    planned sequence), and without replay exactly the computed rows of each sequence."""
    import torch

    import harts.ops.kda.packed as packed
    from harts.bench.speedup import op_times
    from harts.model.config import load_model_config
    from harts.model.model import HybridModel
    from harts.runtime.layout import compact_layout
    from tests.objective.helpers import random_tree_step

    config = load_model_config("tiny")
    model = HybridModel(config)
    model.init_weights(0)
    step = random_tree_step(np.random.default_rng(7), num=8, max_len=80, vocab=3).step
    layout = compact_layout(step, PrefixIndex.from_step(step), np.arange(step.num_trajectories),
                            conv_size=config.kda.conv_size, chunk_size=config.kda.chunk_size)
    assert layout.info["replay_rows"] > 0
    calls = []
    real = packed.packed_kda

    def recording(q, k, v, g, beta, cu_seqlens, **kwargs):
        calls.append((q.detach().clone(), cu_seqlens.cpu().numpy()))
        return real(q, k, v, g, beta, cu_seqlens, **kwargs)

    monkeypatch.setattr(packed, "packed_kda", recording)
    times = op_times(model, layout, torch.device("cpu"), None)
    assert set(times) == {"kda", "kda_one_call", "kda_one_call_no_replay", "mla", "lm_head"}
    schedule = layout.kda_schedule
    lengths = np.concatenate([np.diff(call.cu_seqlens) for call in schedule.calls])
    replay = np.concatenate([call.is_replay for call in schedule.calls])
    computed = [int((~replay[a:b]).sum()) for a, b in zip(np.cumsum(lengths) - lengths, np.cumsum(lengths))]
    with_replay = next(c for c in calls if len(c[0]) == layout.num_kda_rows)
    without = next(c for c in calls if len(c[0]) == layout.num_rows)
    np.testing.assert_array_equal(np.diff(with_replay[1]), lengths)
    np.testing.assert_array_equal(np.diff(without[1]), computed)
    torch.testing.assert_close(without[0], with_replay[0][torch.from_numpy(np.flatnonzero(~replay))], rtol=0, atol=0)


def test_breakdown_scales_each_sampled_op_by_its_work(monkeypatch):
    """With op times proportional to each op's work (`OP_WORK`), the breakdown's estimate from a sample of the
    microbatches is the whole step's: attention scaled by pairs, KDA by its call rows, the LM head by its rows
    (scaling every op by the sample's semantic rows misses attention by the spread of trajectory lengths)."""
    import torch

    from harts.bench.speedup import OP_WORK, breakdown, op_work
    from harts.model.config import load_model_config
    from harts.model.model import HybridModel
    from harts.objective.step import StepConfig, build_layout
    from tests.objective.helpers import random_tree_step

    model = HybridModel(load_model_config("tiny"))
    step = random_tree_step(np.random.default_rng(3), num=12, max_len=90, vocab=3).step
    index = PrefixIndex.from_step(step)
    order = np.argsort(-step.lengths, kind="stable")  # like first-fit decreasing: long trajectories first
    microbatches = {"baseline": [order[k:k + 1] for k in range(12)],
                    "compact": [order[k:k + 3] for k in range(0, 12, 3)]}
    configs = {name: StepConfig(execution=name) for name in speedup_module.EXECUTIONS}
    per_unit = {"kda": 1e-3, "kda_one_call": 9e-4, "kda_one_call_no_replay": 8e-4, "mla": 1e-5, "lm_head": 2e-3}

    def proportional(model, layout, device, dtype, grad_precision="fp32"):
        work = op_work(layout)
        return {key: per_unit[key] * work[OP_WORK[key]] for key in per_unit}

    monkeypatch.setattr(speedup_module, "op_times", proportional)
    monkeypatch.setattr(speedup_module, "BREAKDOWN_MICROBATCHES", 2)
    execution = {"fbg_s": 1.0, "layout_s": 0.0, "attention_pairs": 1}
    result = breakdown(model, step, microbatches, configs, index, torch.device("cpu"), None, execution, execution, 2.0)
    assert result["sampled_microbatch_fraction"] == {"baseline": 2 / 12, "compact": 2 / 4}
    for name in speedup_module.EXECUTIONS:
        layouts = [build_layout(step, m, model, configs[name], index) for m in microbatches[name]]
        whole = {key: sum(proportional(model, layout, None, None)[key] for layout in layouts) for key in per_unit}
        measured = result["op_seconds"][name]
        assert measured.keys() == whole.keys()
        for key in per_unit:
            assert measured[key] == pytest.approx(whole[key], rel=1e-9), (name, key)


def test_model_flops_both_ways_on_the_tiny_config():
    """Each term written out for configs/models/tiny.yaml (hidden 64, vocabulary 256, layers KDA, KDA,
    KDA, MLA, the first dense): per token, 2 × in × out of every weight product, 3 × for forward +
    backward; attention: the KDA chunk terms per token and MLA's per causal pair."""
    from harts.bench.speedup import estimate_model_flops
    from harts.model.config import load_model_config

    config = load_model_config("tiny")
    lm_head = 64 * 256
    kda = 4 * 64 * 32 + 2 * (64 * 16 + 16 * 32) + 64 * 2  # q, k, v, o; two low-rank gates; beta
    mla = (64 * 24 + 24 * 2 * 24) + 64 * (32 + 8) + 32 * 2 * (16 + 16) + 2 * 16 * 64
    dense, moe = 3 * 64 * 128, 64 * 4 + 2 * 3 * 64 * 32 + 3 * 64 * 32  # router, 2 routed experts, shared
    matmul = 2 * (lm_head + 3 * kda + mla + dense + 3 * moe)  # layer 0 dense, layers 1-3 MoE
    kda_chunk = 2 * 2 * (16 * 3 * 16 + 4 * 16 * 16)
    tokens, pairs = 100, 3000
    flops = estimate_model_flops(config, tokens, pairs)
    assert flops["matmul"] == 3 * matmul * tokens
    assert flops["attention"] == 3 * (3 * kda_chunk * tokens + 2 * 2 * (24 + 16) * pairs)


def test_bf16_parameters_with_fp32_gradients(tree_step_path, tmp_path, capsys, monkeypatch):
    import harts.objective.step as step_module

    run_step = step_module.run_step
    seen = []

    def spy(model, *args, **kwargs):
        result = run_step(model, *args, **kwargs)
        matrices = [p for p in model.parameters() if p.dim() >= 2]
        seen.append((matrices[0].dtype, any(p.grad is not None for p in matrices)))
        return result

    monkeypatch.setattr(step_module, "run_step", spy)
    path, step = tree_step_path
    code, records, _ = _speedup(["--trees", path, "--capacity", "80", "--repeats", "1", "--dtype", "bf16",
                                 "--params", "bf16", "--no-breakdown"], tmp_path, capsys)
    assert code == 0, records
    (record,) = records
    assert record["config"]["params"] == "bf16" and record["config"]["dtype"] == "bf16"
    _check_record(record, step, "single", 1)
    # Every step ran on bf16 weights, and their gradients went to the fp32 buffers, not .grad.
    assert seen and all(found == (torch.bfloat16, False) for found in seen)


@pytest.mark.parametrize(("params", "dtype", "parallel", "expected"), [
    (None, "bf16", None, "bf16"), (None, "bf16", "dp2", "fp32"), (None, "fp32", None, "fp32"),
    ("fp32", "bf16", None, "fp32"), ("bf16", "fp32", None, "needs --dtype bf16"),
    ("bf16", "bf16", "dp2", "not implemented with --parallel"),
], ids=["default-bf16", "default-parallel", "default-fp32", "fp32", "bf16-under-fp32", "bf16-parallel"])
def test_parameter_dtype(params, dtype, parallel, expected):
    from harts.bench.speedup import parameter_dtype

    if expected in ("bf16", "fp32"):
        assert parameter_dtype(params, dtype, parallel) == expected
    else:
        with pytest.raises(ValueError, match=expected):
            parameter_dtype(params, dtype, parallel)


def test_experts_backend_overrides_the_model_config(tree_step_path, tmp_path, capsys, monkeypatch):
    """--experts-backend reaches the model both executions run and the record's model config; its choices are
    the model's backends."""
    from harts.args import EXPERT_BACKENDS as CLI_BACKENDS
    from harts.model.moe import EXPERT_BACKENDS, MoE

    assert CLI_BACKENDS == EXPERT_BACKENDS
    backends = []
    monkeypatch.setattr(MoE, "routed_experts", lambda self, x, routing: backends.append(
        self.config.experts_backend) or self.loop_experts(x, routing))
    path, _ = tree_step_path
    code, records, _ = _speedup(["--trees", path, "--capacity", "80", "--repeats", "1", "--no-breakdown",
                                 "--experts-backend", "lean"], tmp_path, capsys)
    assert code == 0 and records[0]["config"]["model_config"]["moe"]["experts_backend"] == "lean"
    assert backends and set(backends) == {"lean"}


def test_variants_run_in_one_process_each_with_its_settings(tree_step_path, tmp_path, capsys, monkeypatch):
    """Every step runs with the run's own settings, then once per `--variant`, on one model (built once), each
    record with the settings its variant gave and its run steps with those settings; a variant that fails is its
    own error row."""
    import harts.model.model as model_module
    import harts.objective.step as step_module

    path, step = tree_step_path
    seen, builds, chunks = [], [], set()
    run_step = step_module.run_step
    init = model_module.HybridModel.__init__

    def recording_run_step(model, step, microbatches, config, **kwargs):
        backends = {m.config.experts_backend for m in model.modules() if isinstance(m, MoE)}
        chunks.add((config.logprob_chunk_rows, tuple(backends)))
        seen.append((config.execution, config.recompute, config.recompute_blocks, config.keep_attention, *backends))
        return run_step(model, step, microbatches, config, **kwargs)

    def counting_init(self, *args, **kwargs):
        builds.append(1)
        init(self, *args, **kwargs)

    monkeypatch.setattr(step_module, "run_step", recording_run_step)
    monkeypatch.setattr(model_module.HybridModel, "__init__", counting_init)
    too_small = int(step.lengths.max()) - 1
    code, records, printed = _speedup(
        ["--trees", path, "--capacity", "80", "--repeats", "1", "--no-breakdown", "--recompute",
         "--variant", "recompute-blocks=1", "--variant", "recompute-blocks=1,keep-attention",
         "--variant", f"capacity={too_small}",
         "--variant", "recompute=no,repeats=2,experts-backend=grouped,logprob-chunk-rows=16"], tmp_path, capsys)
    assert code == 1 and builds == [1] and len(records) == len(printed) == 5
    configs = [r["config"] for r in records]
    assert [(c["recompute"], c["recompute_blocks"], c["keep_attention"], c["capacity"], c["repeats"],
             c["model_config"]["moe"]["experts_backend"]) for c in configs] == [
        (True, None, False, 80, 1, "auto"), (True, 1, False, 80, 1, "auto"), (True, 1, True, 80, 1, "auto"),
        (True, None, False, too_small, 1, "auto"), (False, None, False, 80, 2, "grouped")]
    assert [c["variant"] for c in configs] == [
        None, "recompute-blocks=1", "recompute-blocks=1,keep-attention", f"capacity={too_small}",
        "recompute=no,repeats=2,experts-backend=grouped,logprob-chunk-rows=16"]
    assert [c["logprob_chunk_rows"] for c in configs] == [4096, 4096, 4096, 4096, 16]
    assert chunks == {(4096, ("auto",)), (16, ("grouped",))}
    assert ["error" in r for r in records] == [False, False, False, True, False]
    assert "more than the capacity" in records[3]["error"]
    # Warm-up and timed steps of both executions, per case, with that case's settings.
    expected = [(execution, *settings) for settings, runs in
                [((True, None, False, "auto"), 2), ((True, 1, False, "auto"), 2), ((True, 1, True, "auto"), 2),
                 ((False, None, False, "grouped"), 3)]
                for execution in ("baseline", "compact") for _ in range(runs)]
    assert Counter(seen) == Counter(expected)


def test_a_variant_giving_the_compact_execution_the_baseline_blocks_is_the_same_settings(tree_step_path, tmp_path,
                                                                                         capsys):
    path, _ = tree_step_path
    out = tmp_path / "speedup.json"
    code = main(["bench", "speedup", "--model", "tiny", "--trees", path, "--recompute", "--recompute-blocks", "2",
                 "--variant", "compact-recompute-blocks=2", "--out", str(out)])
    err = capsys.readouterr().err
    assert code != 0 and "the same run settings as the run's own" in err and not out.exists(), err


def test_a_variant_can_give_the_compact_execution_the_baseline_blocks_again(tree_step_path, tmp_path, capsys,
                                                                           monkeypatch):
    """`compact-recompute-blocks=same` undoes the run's own --compact-recompute-blocks: the stricter reading (the
    same blocks in both executions) measured beside the run's in one process."""
    from harts.objective import step as step_module

    seen = []
    run_step = step_module.run_step
    monkeypatch.setattr(step_module, "run_step", lambda model, step, microbatches, config, **k: seen.append(
        (config.execution, config.recompute_blocks)) or run_step(model, step, microbatches, config, **k))
    path, _ = tree_step_path
    code, records, _ = _speedup(["--trees", path, "--capacity", "80", "--repeats", "1", "--no-breakdown",
                                 "--recompute", "--recompute-blocks", "3", "--compact-recompute-blocks", "1",
                                 "--variant", "compact-recompute-blocks=same"], tmp_path, capsys)
    assert code == 0
    assert [(r["config"]["recompute_blocks"], r["config"]["compact_recompute_blocks"]) for r in records] == [
        (3, 1), (3, 3)]
    assert ("compact", 1) in seen and seen[-1] == ("compact", 3)


@pytest.mark.parametrize(
    "variant, message",
    [("recompute-blocks=2,dtype=fp32", "'dtype' is not one of"), ("keep-attention=maybe", "expected yes or no"),
     ("capacity=0", "a positive integer"), ("recompute=no,keep-attention", "--keep-attention needs --recompute"),
     ("recompute=no,recompute-blocks=2", "--recompute-blocks needs --recompute"),
     ("keep-attention,attention-backend=flex", "flex"), ("experts-backend=fast", "invalid choice"),
     ("attention-backend=flsh4", "attention_backend must be one of"), ("kda-backend=cuda", "kda_backend must be"),
     ("attention-backend=", "attention_backend must be one of"),
     ("keep-kda-intermediates", "needs kda_backend 'fla', got 'torch'"),
     ("recompute=no,keep-kda-intermediates,kda-backend=fla", "keep_kda_intermediates needs recompute"),
     ("repeats=3", "the same run settings as the run's own (only repeats differ)"),
     ("recompute", "the same run settings as the run's own"),
     ("recompute=no,compact-recompute-blocks=2", "--compact-recompute-blocks needs --recompute"),
     ("recompute-by-rows", "--recompute-by-rows scales the kept blocks"),
     ("compact-recompute-blocks=same", "the same run settings as the run's own")],
    ids=["not-a-run-flag", "bad-boolean", "bad-number", "keep-without-recompute", "blocks-without-recompute",
         "keep-with-flex", "bad-experts-backend", "bad-attention-backend", "bad-kda-backend", "empty-backend",
         "keep-kda-with-torch-kda", "keep-kda-without-recompute", "only-repeats", "no-change",
         "compact-blocks-without-recompute", "by-rows-without-blocks", "compact-same-as-the-run"],
)
def test_a_bad_variant_is_one_error_line_before_any_model(variant, message, tree_step_path, tmp_path, capsys):
    path, _ = tree_step_path
    out = tmp_path / "speedup.json"
    argv = ["bench", "speedup", "--model", "tiny", "--trees", path, "--recompute", "--variant", variant,
            "--out", str(out)]
    try:
        code = main(argv)
    except SystemExit as exit:  # argparse's own errors
        code = exit.code
    err = capsys.readouterr().err
    assert code != 0 and message in err and variant in err, err
    assert "Traceback" not in err and not out.exists()
