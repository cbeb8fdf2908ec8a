"""The speedup record's figures from known timings (harts.bench.speedup.metrics), against values worked out by
hand: speedups, compression and efficiency, the same counted in model FLOPs, per-rank aggregation (the critical path,
medians over repeats) and the timing flags."""

import pytest

from harts.bench.speedup.metrics import execution_times, flops_metrics, speedup_metrics, timing_flags


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


def test_model_flops_both_ways_on_the_tiny_config():
    """Each term written out for configs/models/tiny.yaml (hidden 64, vocabulary 256, layers KDA, KDA,
    KDA, MLA, the first dense): per token, 2 × in × out of every weight product, 3 × for forward +
    backward; attention: the KDA chunk terms per token and MLA's per causal pair."""
    from harts.bench.speedup.metrics import estimate_model_flops
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


def test_model_flops_both_ways_on_the_gdn_tiny_config():
    """Each term written out for configs/models/gdn-tiny.yaml (hidden 64, vocabulary 256, layers GDN, GDN, GDN,
    gated GQA, the first dense): GDN's projection to q, k (2 × 2 heads × 16), v, z (2 × 4 heads × 8), b, a (2 × 4)
    and its output projection; GQA's doubled query (4 heads × 16 × 2), k and v (2 KV heads × 16) and output; the
    MoE's router, 2 routed experts, shared expert and its gate; attention: GDN's chunk terms per value head and
    token, GQA's scores and values per causal pair."""
    from harts.bench.speedup.metrics import estimate_model_flops
    from harts.model.config import load_model_config

    config = load_model_config("gdn-tiny")
    lm_head = 64 * 256
    gdn = 64 * (2 * 2 * 16 + 2 * 4 * 8 + 2 * 4) + 4 * 8 * 64
    gqa = 64 * (4 * 16 * 2 + 2 * 2 * 16) + 4 * 16 * 64
    dense, moe = 3 * 64 * 128, 64 * 4 + 2 * 3 * 64 * 32 + 3 * 64 * 32 + 64
    matmul = 2 * (lm_head + 3 * gdn + gqa + dense + 3 * moe)
    gdn_chunk = 2 * 4 * (16 * (2 * 16 + 8) + 4 * 16 * 8)
    tokens, pairs = 100, 3000
    flops = estimate_model_flops(config, tokens, pairs)
    assert flops["matmul"] == 3 * matmul * tokens
    assert flops["attention"] == 3 * (3 * gdn_chunk * tokens + 2 * 4 * (16 + 16) * pairs)
