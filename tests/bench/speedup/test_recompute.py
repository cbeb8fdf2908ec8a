"""The search for the fewest recomputed blocks (harts.engine_memory, harts.engine): bisection against every threshold,
a probe's answer on out of memory, and `harts bench speedup --recompute-blocks auto` and
`--compact-recompute-blocks within-baseline` against simulated memory on the CPU (harts.config.execution's
`SEARCH_DEVICES` widened, the device's total memory simulated), with the memory margin and their errors."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from harts import engine as engine_module
from harts.cli.main import main
from harts.config import execution
from harts.engine import Engine
from harts.engine_memory import fewest_recomputed_blocks
from tests.bench.speedup.helpers import simulated_memory, simulated_probes, speedup


@pytest.mark.parametrize("num_blocks", [1, 2, 4, 24])
def test_fewest_recomputed_blocks_bisects_from_every_block(num_blocks):
    """Against every threshold k (n fits when n >= k, 0 included: no recomputation): the answer is k, the first
    try is every block, and the tries are at most 1 + ceil(log2(num_blocks + 1)); with k above num_blocks nothing
    fits, a ValueError."""
    for k in range(num_blocks + 2):
        tried = []
        fits = lambda n: tried.append(n) or n >= k  # noqa: E731
        if k > num_blocks:
            with pytest.raises(ValueError, match=f"even with every block \\({num_blocks}\\) recomputed"):
                fewest_recomputed_blocks(fits, num_blocks)
            assert tried == [num_blocks]
            continue
        assert fewest_recomputed_blocks(fits, num_blocks) == k, (k, tried)
        assert tried[0] == num_blocks and len(tried) <= 1 + math.ceil(math.log2(num_blocks + 1))
        assert all(0 <= n <= num_blocks for n in tried)


def test_a_probe_answers_no_on_out_of_memory_and_frees_the_gradients(tree_step_path, monkeypatch):
    """An out-of-memory error in the step is the answer "does not fit" (the gradients it left freed); a step that
    runs fits, at the blocks asked and not the engine's; another error is raised."""
    from harts.model.config import load_model_config
    from harts.model.model import HybridModel
    from harts.objective.step import StepConfig

    _, step = tree_step_path
    model = HybridModel(load_model_config("tiny"))
    model.init_weights(0)
    engine = Engine(model, StepConfig(execution="baseline", planner="per-trajectory", recompute=True,
                                      recompute_blocks=4))
    planned = engine.plan(step)
    run_step = engine_module.run_step
    blocks = []

    def out_of_memory(model, step, microbatches, config, **kwargs):
        run_step(model, step, microbatches, config, **kwargs)  # leaves gradients, as a backward that failed late
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(engine_module, "run_step", lambda *a, **k: blocks.append(a[3].recompute_blocks) or run_step(
        *a, **k))
    answer = engine.probe(step, planned, 2)
    assert answer["fits"] is True and answer["recompute_blocks"] == 2 and answer["seconds"] > 0
    assert blocks == [2] and engine.config.recompute_blocks == 4
    monkeypatch.setattr(engine_module, "run_step", out_of_memory)
    answer = engine.probe(step, planned, 2)
    assert answer["fits"] is False and all(p.grad is None for p in model.parameters())
    monkeypatch.setattr(engine_module, "run_step", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("other")))
    with pytest.raises(RuntimeError, match="other"):
        engine.probe(step, planned, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_probe_on_cuda_recovers_from_a_real_out_of_memory():
    """With the GPU's memory taken but for less than a step needs beyond the weights, the step runs out of memory:
    the answer is no, nothing it allocated stays, and the same step fits again once the memory is given back."""
    from harts.model.config import load_model_config
    from harts.model.model import HybridModel
    from harts.objective.step import StepConfig
    from harts.trees.io import read_step

    step = read_step(Path(__file__).parents[3] / "data/samples/tiny-step.jsonl.gz")
    device = torch.device("cuda", torch.cuda.current_device())
    with device:
        model = HybridModel(load_model_config("tiny"))
    model.init_weights(0)
    config = StepConfig(execution="baseline", planner="per-trajectory", recompute=True, recompute_blocks=2,
                        dtype="bf16", kda_backend="torch")
    engine = Engine(model, config)
    planned = engine.plan(step)
    assert engine.probe(step, planned, 2)["fits"] is True
    weights = torch.cuda.memory_allocated(device)
    answer = engine.probe(step, planned, 2)
    assert answer["fits"] is True and torch.cuda.memory_allocated(device) == weights
    assert answer["peak_memory_bytes"] - weights > 8 << 20, "the step must need more than the 2 MB pieces left"
    # Take every byte the allocator can get: one large piece, then 2 MB pieces until none is left.
    taken = [torch.empty(torch.cuda.mem_get_info(device)[0] - (64 << 20), dtype=torch.uint8, device=device)]
    try:
        while True:
            taken.append(torch.empty(2 << 20, dtype=torch.uint8, device=device))
    except torch.OutOfMemoryError:
        pass
    answer = engine.probe(step, planned, 2)
    del taken
    torch.cuda.empty_cache()
    assert answer["fits"] is False and torch.cuda.memory_allocated(device) == weights
    assert engine.probe(step, planned, 2)["fits"] is True


def test_recompute_blocks_auto_finds_each_executions_fewest(tree_step_path, tmp_path, capsys, monkeypatch):
    """`auto` searches each execution for itself (the tiny model's 4 blocks, 0 among the answers): the timed steps
    run the blocks found, the record's config holds them and names the executions searched, and results keep every
    probe."""
    ran = simulated_memory(monkeypatch, {"baseline": 3, "compact": 0})
    path, _ = tree_step_path
    code, records, _ = speedup(["--trees", path, "--capacity", "80", "--repeats", "2", "--no-breakdown",
                                 "--recompute", "--recompute-blocks", "auto", "--recompute-by-rows"], tmp_path, capsys)
    assert code == 0, records
    config, search = records[0]["config"], records[0]["results"]["recompute_search"]
    assert (config["recompute_blocks"], config["compact_recompute_blocks"]) == (3, 0)
    assert config["recompute_blocks_auto"] == ["baseline", "compact"]
    for name, found, tries in (("baseline", 3, [(4, True), (1, False), (2, False), (3, True)]),
                               ("compact", 0, [(4, True), (1, True), (0, True)])):
        assert search[name]["recompute_blocks"] == found
        assert [(p["recompute_blocks"], p["fits"]) for p in search[name]["probes"]] == tries
        assert (search[name]["memory_margin"], search[name]["device_memory_bytes"]) == (0.05, 1 << 50)
        assert search[name]["memory_limit_bytes"] == (1 << 50) - math.ceil((1 << 50) / 20)
    assert config["memory_margin"] == 0.05 and records[0]["results"]["device_memory_bytes"] == 1 << 50
    # After the search: one warm-up and two timed steps of each execution, with the blocks found.
    assert ran[-6:] == [("baseline", 3), ("compact", 0)] + [("baseline", 3), ("compact", 0)] * 2


def test_recompute_blocks_auto_beside_given_blocks_and_when_nothing_fits(tree_step_path, tmp_path, capsys,
                                                                         monkeypatch):
    """A given --compact-recompute-blocks is kept while the baseline's are searched; an execution that does not fit
    with every block recomputed is an error row that says so."""
    fewest = {"baseline": 3, "compact": 1}
    simulated_memory(monkeypatch, fewest)
    path, _ = tree_step_path
    flags = ["--trees", path, "--capacity", "80", "--repeats", "1", "--no-breakdown", "--recompute",
             "--recompute-blocks", "auto", "--compact-recompute-blocks", "4"]
    code, records, _ = speedup(flags, tmp_path, capsys)
    config = records[0]["config"]
    assert code == 0 and (config["recompute_blocks"], config["compact_recompute_blocks"]) == (3, 4)
    assert config["recompute_blocks_auto"] == ["baseline"]
    assert list(records[0]["results"]["recompute_search"]) == ["baseline"]
    fewest["baseline"] = 5
    code = main(["bench", "speedup", "--model", "tiny", *flags, "--out", str(tmp_path / "none.json")])
    (record,) = json.loads((tmp_path / "none.json").read_text())
    assert code != 0 and record["config"]["recompute_blocks"] == "auto"
    assert ("--recompute-blocks auto: the baseline execution: the step does not fit in 1069604.91 GB (the device's "
            "1125899.91 GB less memory_margin 0.05) even with every block (4) recomputed: with every block it ran out "
            "of memory") in record["error"]


@pytest.mark.parametrize(("baseline_flag", "fewest", "peaks", "found", "limit", "probed"), [
    # Memory alone would take 1 compact block; only 3 and 4 peak at or below the given baseline's 100 (3: equal).
    ("2", {"baseline": 1, "compact": 1}, {"baseline": {2: 100}, "compact": {4: 60, 3: 100, 2: 110, 1: 130}},
     3, 100, [("baseline", 2), ("compact", 4), ("compact", 1), ("compact", 2), ("compact", 3)]),
    # The baseline searched first (3 blocks): the limit is its probe at 3, not its first probe at 4.
    ("auto", {"baseline": 3, "compact": 1},
     {"baseline": {4: 80, 3: 95, 2: 120, 1: 150}, "compact": {4: 60, 3: 90, 2: 96, 1: 99}},
     3, 95, [("baseline", 4), ("baseline", 1), ("baseline", 2), ("baseline", 3), ("compact", 4), ("compact", 1),
             ("compact", 2), ("compact", 3)]),
], ids=["given-baseline-blocks", "searched-baseline-blocks"])
def test_compact_recompute_blocks_within_baseline(baseline_flag, fewest, peaks, found, limit, probed, tree_step_path,
                                                  tmp_path, capsys, monkeypatch):
    """within-baseline: the fewest compact blocks whose step fits and peaks no higher than a baseline step at the
    baseline's own blocks (a probe of its own when the baseline's blocks are given)."""
    probes = simulated_probes(monkeypatch, fewest, peaks)
    path, _ = tree_step_path
    code, records, _ = speedup(["--trees", path, "--capacity", "80", "--repeats", "1", "--no-breakdown",
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


@pytest.mark.parametrize(("margin", "found", "limit"), [
    ("0.1", 3, 900),  # 2 blocks peak at 901: one byte over
    ("0.05", 2, 950),  # 1 block peaks at 960
    ("0", 1, 1000),  # 0 blocks ran, but peaks at 1,001
], ids=["margin-binds-at-3", "margin-binds-at-2", "no-margin"])
def test_recompute_blocks_auto_leaves_the_memory_margin(margin, found, limit, tree_step_path, tmp_path, capsys,
                                                        monkeypatch):
    """auto takes the fewest blocks whose step peaks at most the device's total (1,000 bytes here) less
    --memory-margin of it (a probe that ran is refused above that); the record holds the margin, the device's total
    and the limit."""
    peaks = {"compact": {4: 700, 2: 901, 3: 900, 1: 960, 0: 1001}}
    simulated_probes(monkeypatch, {"compact": 0}, peaks, total=1000)
    path, _ = tree_step_path
    code, records, _ = speedup(["--trees", path, "--capacity", "80", "--repeats", "1", "--no-breakdown",
                                 "--recompute", "--recompute-blocks", "2", "--compact-recompute-blocks", "auto",
                                 "--memory-margin", margin], tmp_path, capsys)
    assert code == 0, records
    config, results = records[0]["config"], records[0]["results"]
    search = results["recompute_search"]["compact"]
    assert config["compact_recompute_blocks"] == found and config["memory_margin"] == float(margin)
    assert (search["memory_margin"], search["device_memory_bytes"], search["memory_limit_bytes"]) == (
        float(margin), 1000, limit)
    assert results["device_memory_bytes"] == 1000


def test_compact_recompute_blocks_within_baseline_when_nothing_is(tree_step_path, tmp_path, capsys, monkeypatch):
    simulated_probes(monkeypatch, {"baseline": 1, "compact": 1}, {"baseline": {2: 50}, "compact": {4: 60}})
    path, _ = tree_step_path
    code, records, _ = speedup(["--trees", path, "--capacity", "80", "--repeats", "1", "--no-breakdown",
                                 "--recompute", "--recompute-blocks", "2",
                                 "--compact-recompute-blocks", "within-baseline"], tmp_path, capsys)
    (record,) = records
    assert code != 0 and record["config"]["compact_recompute_blocks"] == "within-baseline"
    assert ("--compact-recompute-blocks within-baseline: the compact execution: the step does not fit in "
            "1069604.91 GB (the device's 1125899.91 GB less memory_margin 0.05) and within the baseline's peak "
            "(0.00 GB) even with every block (4) recomputed: with every block it peaked at 0.00 GB") in record["error"]


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
    monkeypatch.setattr(execution, "SEARCH_DEVICES", ("cpu", "cuda"))
    path, _ = tree_step_path
    code = main(["bench", "speedup", "--model", "tiny", "--trees", path, "--recompute", "--recompute-blocks",
                 "auto", "--parallel", "dp2", "--out", str(tmp_path / "bad.json")])
    err = capsys.readouterr().err
    assert code != 0 and "needs --device cuda and no --parallel" in err and "Traceback" not in err
