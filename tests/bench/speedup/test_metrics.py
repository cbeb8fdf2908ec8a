"""The speedup record's figures from known timings (harts.bench.speedup.metrics), against values worked out by
hand: speedups, compression and efficiency, the same counted in model FLOPs (MTP rows included; the FLOP formula
itself: tests/model/test_flops.py), per-rank aggregation (the critical path, medians over repeats) and the timing
flags."""

import pytest

from harts.bench.speedup.metrics import (
    H200_BF16_PEAK_FLOPS,
    execution_times,
    flops_metrics,
    mfu_metrics,
    speedup_metrics,
    timing_flags,
)


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


def test_flops_and_mfu_count_the_mtp_rows():
    """With MTP layers that ran, each execution's model FLOPs add its MTP depths' rows and pairs (the record's
    `mtp_rows`, `mtp_attention_pairs`): the FLOPs compression and the baseline's MFU move with them."""
    import types
    from dataclasses import replace

    import numpy as np

    from harts.model.config import MTPConfig, load_model_config
    from harts.model.flops import estimate_model_flops

    config = replace(load_model_config("tiny"), mtp=MTPConfig(num_layers=1))
    # Six trajectories of 1,000 tokens: the baseline's pairs 6 x 1000 x 1001 / 2, its MTP depth's 6 x 999 x 1000 / 2.
    base = {"rows": 6000, "attention_pairs": 3_003_000, "fbg_s": 8.0, "mtp_rows": [5994],
            "mtp_attention_pairs": [2_997_000]}
    comp = {"rows": 1500, "attention_pairs": 1_200_000, "fbg_s": 2.5, "mtp_rows": [1495],
            "mtp_attention_pairs": [1_195_000]}

    def total(execution, mtp):
        flops = estimate_model_flops(config, execution["rows"], execution["attention_pairs"],
                                     *((execution["mtp_rows"], execution["mtp_attention_pairs"]) if mtp else ()))
        return flops["matmul"] + flops["attention"]

    metrics = flops_metrics(config, base, comp)
    assert metrics["flops_compression"] == pytest.approx(total(base, True) / total(comp, True), rel=1e-12)
    assert metrics["flops_compression"] != pytest.approx(total(base, False) / total(comp, False), rel=1e-6)

    step = types.SimpleNamespace(lengths=np.array([1000] * 6), num_semantic_tokens=6000)
    mfu = mfu_metrics(config, step, base, num_devices=1)
    assert mfu["baseline_model_flops"] == pytest.approx(total(base, True), rel=1e-12)
    assert mfu["baseline_mfu"] == pytest.approx(total(base, True) / (8.0 * H200_BF16_PEAK_FLOPS), rel=1e-12)
    without = mfu_metrics(config, step, {k: v for k, v in base.items() if not k.startswith("mtp")}, num_devices=1)
    assert without["baseline_model_flops"] == pytest.approx(total(base, False), rel=1e-12)
