"""The op-level breakdown (harts.bench.speedup.breakdown): its terms from known op times sum to the excess, a sample
of microbatches is scaled to the whole step by each op's own work, and the one-call KDA variants run the rows they
claim to."""

import numpy as np
import pytest

from harts.bench.speedup import breakdown as breakdown_module
from harts.bench.speedup.breakdown import breakdown_terms
from harts.bench.speedup.executions import EXECUTIONS
from harts.trees.trie import PrefixIndex


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


def test_op_times_one_call_rows(monkeypatch):
    """The breakdown's one-call KDA variants run the compact layout's KDA rows as one call (every
    planned sequence), and without replay exactly the computed rows of each sequence."""
    import torch

    import harts.ops.kda.packed as packed
    from harts.bench.speedup.breakdown import op_times
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

    from harts.bench.speedup.breakdown import OP_WORK, breakdown, op_work
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
    configs = {name: StepConfig(execution=name) for name in EXECUTIONS}
    per_unit = {"kda": 1e-3, "kda_one_call": 9e-4, "kda_one_call_no_replay": 8e-4, "mla": 1e-5, "lm_head": 2e-3}

    def proportional(model, layout, device, dtype, grad_precision="fp32"):
        work = op_work(layout)
        return {key: per_unit[key] * work[OP_WORK[key]] for key in per_unit}

    monkeypatch.setattr(breakdown_module, "op_times", proportional)
    monkeypatch.setattr(breakdown_module, "BREAKDOWN_MICROBATCHES", 2)
    execution = {"fbg_s": 1.0, "layout_s": 0.0, "attention_pairs": 1}
    result = breakdown(model, step, microbatches, configs, index, torch.device("cpu"), None, execution, execution, 2.0)
    assert result["sampled_microbatch_fraction"] == {"baseline": 2 / 12, "compact": 2 / 4}
    for name in EXECUTIONS:
        layouts = [build_layout(step, m, model, configs[name], index) for m in microbatches[name]]
        whole = {key: sum(proportional(model, layout, None, None)[key] for layout in layouts) for key in per_unit}
        measured = result["op_seconds"][name]
        assert measured.keys() == whole.keys()
        for key in per_unit:
            assert measured[key] == pytest.approx(whole[key], rel=1e-9), (name, key)
