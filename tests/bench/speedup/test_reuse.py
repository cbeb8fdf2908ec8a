"""A step's baseline measured once for the variants that change only the compact execution (harts.bench.speedup.reuse,
.measure, .parallel, .run): spies count the baseline's steps, op-time measurements and searches; the reusing record
holds the measuring case's baseline figures (times, samples, peak memory, search record, breakdown and profile
baselines) and names it; a variant changing a baseline flag, `--no-reuse-baseline`, another step and an error row
each mean a baseline measured again, and a variant changing the planner or the memory margin does not (but the margin
where the baseline's blocks are searched); every run flag is changed one at a time to find which reach the
baseline."""

import argparse
import copy
from collections import Counter

import pytest
import torch

from harts import engine as engine_module
from harts.bench.speedup import breakdown as breakdown_module
from harts.bench.speedup.cli import VARIANT_FLAGS, parse_variant
from harts.bench.speedup.executions import requested_blocks, step_configs
from harts.bench.speedup.recompute import SEARCHED
from harts.bench.speedup.reuse import COMPACT_ONLY, THE_RUNS_OWN, baseline_settings
from harts.bench.speedup.run import run_variants
from harts.cli.main import build_parser, main
from harts.config import execution
from harts.config.execution import AUTO, CHOICES
from harts.engine import Engine
from tests.bench.speedup.helpers import check_record, simulated_memory, simulated_probes

def _spy(monkeypatch) -> dict[str, list]:
    """The execution of every step run (warm-up, timed, probe or profile), every op-time measurement of the
    breakdown and every search for the recomputed blocks."""
    calls: dict[str, list] = {"steps": [], "ops": [], "searches": []}
    run_step = engine_module.run_step
    monkeypatch.setattr(engine_module, "run_step", lambda model, step, microbatches, config, **k: calls[
        "steps"].append(config.execution) or run_step(model, step, microbatches, config, **k))
    op_seconds = breakdown_module.execution_op_seconds
    monkeypatch.setattr(breakdown_module, "execution_op_seconds", lambda model, step, microbatches, config, *a: calls[
        "ops"].append(config.execution) or op_seconds(model, step, microbatches, config, *a))
    fit = Engine.fit_recompute_blocks
    monkeypatch.setattr(Engine, "fit_recompute_blocks", lambda self, *a, **k: calls["searches"].append(
        self.config.execution) or fit(self, *a, **k))
    return calls


def _run(args, tmp_path, capsys):
    """`harts bench speedup` on the tiny model: exit code, records, stdout (the table) and stderr (the log)."""
    import json

    out = tmp_path / "speedup.json"
    code = main(["bench", "speedup", "--model", "tiny", *args, "--out", str(out)])
    captured = capsys.readouterr()
    return code, json.loads(out.read_text()), captured.out, captured.err


def _check_reused(record, source_record, source: str) -> None:
    """`record` takes every baseline figure of `source_record` and names `source`; its compact execution and the
    figures against the baseline are its own."""
    results, measured = record["results"], source_record["results"]
    assert results["baseline_reused_from"] == source
    assert results["baseline"] == measured["baseline"]
    assert results["compact"]["samples"] != measured["compact"]["samples"]
    base, comp = results["baseline"], results["compact"]
    assert results["fbg_speedup"] == pytest.approx(base["fbg_s"] / comp["fbg_s"])
    assert results["core_speedup"] == pytest.approx((base["fbg_s"] + base["planning_s"])
                                                    / (comp["fbg_s"] + comp["planning_s"]))
    if "breakdown" in measured:
        breakdown = results["breakdown"]
        assert breakdown["op_seconds"]["baseline"] == measured["breakdown"]["op_seconds"]["baseline"]
        fraction = breakdown["sampled_microbatch_fraction"]
        assert fraction["baseline"] == measured["breakdown"]["sampled_microbatch_fraction"]["baseline"]
        assert breakdown["ideal_compact_fbg_s"] == pytest.approx(base["fbg_s"] / results["compression"])
        assert sum(breakdown["terms_s"].values()) == pytest.approx(breakdown["excess_s"], abs=1e-9)
    if "profile" in measured:
        assert results["profile"]["baseline"] == measured["profile"]["baseline"]


@pytest.mark.parametrize("variant", ["compact-attention-backend=naive", "compact-recompute-blocks=1",
                                     "planner=greedy-trie", "memory-margin=0.5", "kda-calls=linked"],
                         ids=["attention-backend", "recompute-blocks", "planner", "memory-margin", "kda-calls"])
def test_a_compact_only_variant_measures_the_baseline_once(variant, tree_step_path, tmp_path, capsys, monkeypatch):
    """A variant of the compact execution's own flags, of the planner (the command plans the baseline per-trajectory
    whatever --planner says) or of the memory margin (the baseline's blocks given) reuses the run's own baseline."""
    import harts.planning.microbatch as microbatch_module

    calls = _spy(monkeypatch)
    planners = []
    plan = microbatch_module.plan
    monkeypatch.setattr(microbatch_module, "plan", lambda *a, planner, **k: planners.append(planner) or plan(
        *a, planner=planner, **k))
    path, step = tree_step_path
    code, records, out, err = _run(["--trees", path, "--capacity", "80", "--repeats", "1", "--recompute",
                                    "--recompute-blocks", "2", "--profile", "--variant", variant], tmp_path, capsys)
    assert code == 0, records
    own, reusing = records
    # The baseline's warm-up, timed step and profile once; the compact execution's in both cases.
    assert Counter(calls["steps"]) == {"baseline": 3, "compact": 6}
    assert Counter(calls["ops"]) == {"baseline": 1, "compact": 2}
    compact_planner = variant.removeprefix("planner=") if variant.startswith("planner=") else "harts"
    assert planners == ["per-trajectory", "harts", "per-trajectory", compact_planner]
    assert own["results"]["baseline_reused_from"] is None
    _check_reused(reusing, own, THE_RUNS_OWN)
    for record in records:
        check_record(record, step, "single", 1)
    assert reusing["config"]["variant"] == variant
    assert (f"step 0 (--variant {variant}): the baseline of the run's own (the same baseline settings), not "
            "measured again") in err
    assert f"baseline reused: step 0, single, --variant {variant}: the baseline of the run's own" in out


@pytest.mark.parametrize(("variant", "flags", "baseline_steps"), [
    ("attention-backend=naive", [], 4), ("capacity=100", [], 4), ("recompute-blocks=1", [], 4),
    ("logprob-chunk-rows=16", [], 4), ("experts-backend=grouped", [], 4),
    ("repeats=2,compact-attention-backend=naive", [], 5),
    ("compact-attention-backend=naive", ["--no-reuse-baseline"], 4),
], ids=["attention-backend", "capacity", "recompute-blocks", "logprob-chunk-rows", "experts-backend", "repeats",
        "no-reuse-baseline"])
def test_a_variant_changing_the_baseline_measures_its_own(variant, flags, baseline_steps, tree_step_path, tmp_path,
                                                          capsys, monkeypatch):
    calls = _spy(monkeypatch)
    path, step = tree_step_path
    code, records, out, _ = _run(["--trees", path, "--capacity", "80", "--repeats", "1", "--no-breakdown",
                                  "--recompute", "--recompute-blocks", "2", *flags, "--variant", variant],
                                 tmp_path, capsys)
    assert code == 0, records
    assert calls["steps"].count("baseline") == baseline_steps
    assert [r["results"]["baseline_reused_from"] for r in records] == [None, None]
    assert records[0]["results"]["baseline"]["samples"] != records[1]["results"]["baseline"]["samples"]
    assert "baseline reused" not in out


@pytest.mark.parametrize("failing", ["baseline", "compact"])
def test_an_error_row_is_no_baseline_to_reuse(failing, tree_step_path, tmp_path, capsys, monkeypatch):
    """The run's own case runs out of memory in its first step of `failing` (simulated): its error row is no source,
    so the first variant with its baseline settings measures the baseline itself, and the next reuses that one."""
    run_step = engine_module.run_step
    failed = []

    def once_out_of_memory(model, step, microbatches, config, **kwargs):
        if config.execution == failing and not failed:
            failed.append(config.execution)
            raise torch.OutOfMemoryError(f"{failing} (simulated)")
        return run_step(model, step, microbatches, config, **kwargs)

    monkeypatch.setattr(engine_module, "run_step", once_out_of_memory)
    calls = _spy(monkeypatch)
    path, _ = tree_step_path
    first, second = "compact-attention-backend=naive", "compact-recompute-blocks=1"
    code, records, _, _ = _run(["--trees", path, "--capacity", "80", "--repeats", "1", "--no-breakdown",
                                "--recompute", "--recompute-blocks", "2", "--variant", first, "--variant", second],
                               tmp_path, capsys)
    assert code == 1 and failed == [failing]
    own, measuring, reusing = records
    assert "results" not in own and f"{failing} warm-up: OutOfMemoryError" in own["error"]
    assert measuring["results"]["baseline_reused_from"] is None
    _check_reused(reusing, measuring, first)
    # The run's own baseline warm-up (which failed, or before the compact one that failed), then the first
    # variant's warm-up and timed step.
    assert calls["steps"].count("baseline") == 3


def test_each_step_measures_its_own_baseline(tmp_path, capsys, monkeypatch):
    from harts.trees.sources import iter_steps

    calls = _spy(monkeypatch)
    code, records, _, _ = _run(["--trees", "tiny", "--steps", "0,1", "--max-trees", "1", "--capacity", "1024",
                                "--repeats", "1", "--no-breakdown", "--variant", "compact-attention-backend=naive"],
                               tmp_path, capsys)
    assert code == 0, records
    assert [(r["config"]["step"], r["results"]["baseline_reused_from"]) for r in records] == [
        (0, None), (0, THE_RUNS_OWN), (1, None), (1, THE_RUNS_OWN)]
    assert calls["steps"].count("baseline") == 4
    steps = {index: step for index, step, _ in iter_steps("tiny", 0, [0, 1], 1)}
    for record in records:
        check_record(record, steps[record["config"]["step"]], "single", 1)
    _check_reused(records[1], records[0], THE_RUNS_OWN)
    _check_reused(records[3], records[2], THE_RUNS_OWN)


def test_a_searched_baseline_is_reused_with_its_search(tree_step_path, tmp_path, capsys, monkeypatch):
    """After `--recompute-blocks auto` (simulated memory: the baseline fits from 3 blocks, the compact execution
    from 2): a compact-only variant takes the baseline with its search record and searches nothing; a variant giving
    the blocks found takes it without the record (it searched nothing); other blocks are a baseline of their own."""
    ran = simulated_memory(monkeypatch, {"baseline": 3, "compact": 2})
    calls = _spy(monkeypatch)
    path, step = tree_step_path
    code, records, _, _ = _run(["--trees", path, "--capacity", "80", "--repeats", "1", "--no-breakdown",
                                "--recompute", "--recompute-blocks", "auto", "--variant", "compact-recompute-blocks=4",
                                "--variant", "recompute-blocks=3", "--variant", "recompute-blocks=4"], tmp_path, capsys)
    assert code == 0, records
    own, compact_only, found, other = records
    assert calls["searches"] == ["baseline", "compact"]
    # The search's probes at 4 and 3 (2 ran out of memory), then a warm-up and a timed step at 3; at 4 for the last.
    assert [blocks for execution, blocks in ran if execution == "baseline"] == [4, 3, 3, 3, 4, 4]
    search = own["results"]["recompute_search"]
    assert search["baseline"]["recompute_blocks"] == 3 and search["compact"]["recompute_blocks"] == 2
    _check_reused(compact_only, own, THE_RUNS_OWN)
    assert compact_only["results"]["recompute_search"] == {"baseline": search["baseline"]}
    config = compact_only["config"]
    assert (config["recompute_blocks"], config["compact_recompute_blocks"], config["recompute_blocks_auto"]) == (
        3, 4, ["baseline"])
    _check_reused(found, own, THE_RUNS_OWN)
    assert "recompute_search" not in found["results"] and "recompute_blocks_auto" not in found["config"]
    assert (found["config"]["recompute_blocks"], found["config"]["compact_recompute_blocks"]) == (3, 3)
    assert other["results"]["baseline_reused_from"] is None
    for record in records:
        check_record(record, step, "single", 1)


@pytest.mark.parametrize(("blocks", "reused", "searches"), [
    (["--recompute-blocks", "auto"], False, ["baseline", "compact"] * 2),
    (["--recompute-blocks", "2", "--compact-recompute-blocks", "auto"], True, ["compact"] * 2),
], ids=["baseline-searched", "compact-searched"])
def test_a_memory_margin_variant_reuses_a_baseline_whose_blocks_were_given(blocks, reused, searches, tree_step_path,
                                                                           tmp_path, capsys, monkeypatch):
    """The memory margin reaches a search of the recomputed blocks alone (simulated memory): a variant changing it
    measures the baseline again where the baseline's blocks are searched, and reuses it where they are given (its
    compact execution searched with its own margin)."""
    simulated_memory(monkeypatch, {"baseline": 2, "compact": 2})
    calls = _spy(monkeypatch)
    path, step = tree_step_path
    code, records, _, _ = _run(["--trees", path, "--capacity", "80", "--repeats", "1", "--no-breakdown",
                                "--recompute", *blocks, "--variant", "memory-margin=0.5"], tmp_path, capsys)
    assert code == 0, records
    own, variant = records
    assert calls["searches"] == searches
    assert variant["results"]["recompute_search"]["compact"]["memory_margin"] == 0.5
    assert own["results"]["recompute_search"]["compact"]["memory_margin"] == execution.DEFAULT_MEMORY_MARGIN
    if reused:
        _check_reused(variant, own, THE_RUNS_OWN)
    else:
        assert variant["results"]["baseline_reused_from"] is None
        assert variant["results"]["recompute_search"]["baseline"]["memory_margin"] == 0.5
    for record in records:
        check_record(record, step, "single", 1)


@pytest.mark.parametrize(("baseline_flag", "fewest", "peaks", "probed", "limit", "found"), [
    # The reused baseline's search measured its peak at the blocks found (3): no probe of the baseline again.
    ("auto", {"baseline": 3, "compact": 1},
     {"baseline": {4: 80, 3: 95, 2: 120, 1: 150}, "compact": {4: 60, 3: 90, 2: 96, 1: 99}},
     [("baseline", 4), ("baseline", 1), ("baseline", 2), ("baseline", 3), ("compact", 4), ("compact", 1),
      ("compact", 2), ("compact", 3)], 95, 3),
    # Given blocks: no search record, so one untimed probe of the baseline's peak, as without a reused baseline.
    ("2", {"baseline": 1, "compact": 1}, {"baseline": {2: 100}, "compact": {4: 60, 3: 100, 2: 110, 1: 130}},
     [("baseline", 2), ("compact", 4), ("compact", 1), ("compact", 2), ("compact", 3)], 100, 3),
], ids=["searched-baseline", "given-baseline-blocks"])
def test_within_baseline_against_a_reused_baseline(baseline_flag, fewest, peaks, probed, limit, found, tree_step_path,
                                                   tmp_path, capsys, monkeypatch):
    probes = simulated_probes(monkeypatch, fewest, peaks)
    calls = _spy(monkeypatch)
    path, _ = tree_step_path
    code, records, _, _ = _run(["--trees", path, "--capacity", "80", "--repeats", "1", "--no-breakdown",
                                "--recompute", "--recompute-blocks", baseline_flag, "--compact-recompute-blocks", "4",
                                "--variant", "compact-recompute-blocks=within-baseline"], tmp_path, capsys)
    assert code == 0, records
    own, within = records
    assert probes == probed
    assert calls["steps"].count("baseline") == 2  # a warm-up and a timed step, of the run's own
    _check_reused(within, own, THE_RUNS_OWN)
    search = within["results"]["recompute_search"]
    assert within["config"]["compact_recompute_blocks"] == found
    assert search["compact"]["within_peak_memory_bytes"] == limit
    if baseline_flag == "auto":
        assert search["baseline"] == own["results"]["recompute_search"]["baseline"]
        assert search["compact"]["baseline_probe"] is None
    else:
        assert "baseline" not in search and search["compact"]["baseline_probe"]["recompute_blocks"] == 2


def test_parallel_variants_reuse_the_baseline_on_every_rank(tree_step_path, tmp_path, capsys, monkeypatch):
    """Under --parallel dp2 the ranks of a compact-only variant run the compact execution alone."""
    import harts.parallel.launch as launch_module

    launched = []
    launch = launch_module.launch

    def spy(fn, config, *args, **kwargs):
        launched.append(args[-1])  # the executions the ranks measure
        return launch(fn, config, *args, **kwargs)

    monkeypatch.setattr(launch_module, "launch", spy)
    path, step = tree_step_path
    code, records, out, _ = _run(["--trees", path, "--capacity", "80", "--repeats", "1", "--parallel", "dp2",
                                  "--variant", "compact-attention-backend=naive"], tmp_path, capsys)
    assert code == 0, records
    assert launched == [("baseline", "compact"), ("compact",)]
    own, reusing = records
    for record in records:
        check_record(record, step, "dp2", 2)
    _check_reused(reusing, own, THE_RUNS_OWN)
    assert "baseline reused: step 0, dp2, --variant compact-attention-backend=naive" in out


# Each run flag is changed alone, from each of these run settings, to every value its `--variant` flag takes among
# these (and its choices): a variant the command refuses is skipped (the CPU may search the recomputed blocks here).
BASES = ([], ["--recompute"], ["--recompute", "--recompute-blocks", "2"], ["--recompute", "--kda-backend", "fla"],
         ["--recompute", "--recompute-blocks", "auto"])
VALUES = ("yes", "no", "1", "2", "3", "16", "0", "0.1", "0.5", "auto", "all", "same", "within-baseline",
          *sorted({choice for choices in CHOICES.values() for choice in choices}))
MEASUREMENT_FLAGS = {"repeats": "the baseline's timed steps"}
"""The run flags that reach neither execution's StepConfig, and what of the baseline's measurement each changes: a
new one is refused below until it is named here or in `COMPACT_ONLY`."""
READ_BY_THE_BASELINE_WHEN = {
    "planner": lambda run_args: False,  # the baseline is planned per-trajectory whatever --planner says
    "kda_calls": lambda run_args: False,  # the baseline's KDA is one packed call
    "memory_margin": lambda run_args: requested_blocks(run_args)["baseline"] == AUTO,  # read by a search alone
}
"""The run flags that reach the baseline's StepConfig but not always its measurement, and when they do (of the run's
settings): a change of one changes `baseline_settings` exactly then."""


def _requested(run_args, name):
    return requested_blocks(run_args)[name]


def _config(run_args, name):
    """An execution's StepConfig with its blocks as requested (a search's stands as one block) and those blocks."""
    blocks = {k: 1 if v in SEARCHED else v for k, v in requested_blocks(run_args).items()}
    return step_configs(run_args, "fp32", blocks, names=(name,))[name], _requested(run_args, name)


@pytest.mark.parametrize("flag", VARIANT_FLAGS)
def test_every_run_flag_but_the_compact_ones_reaches_the_baseline(flag, monkeypatch):
    """A variant changing only a flag of `COMPACT_ONLY` changes the compact execution and never `baseline_settings`;
    one changing a `READ_BY_THE_BASELINE_WHEN` flag changes them exactly where the baseline reads it; one changing
    any other flag changes `baseline_settings` whenever it changes the baseline's StepConfig, and a flag that changes
    neither StepConfig must be a `MEASUREMENT_FLAGS` one, which changes them every time."""
    monkeypatch.setattr(execution, "SEARCH_DEVICES", ("cpu", "cuda"))
    name = flag.replace("-", "_")
    changes = {"baseline_config": 0, "baseline_settings": 0, "compact_config": 0}
    tried = 0
    for base in BASES:
        (own,) = run_variants(build_parser().parse_args(["bench", "speedup", "--model", "tiny", "--trees", "t",
                                                         *base]))
        for value in VALUES:
            try:
                variant = argparse.Namespace(**{**vars(own), **parse_variant(f"{flag}={value}")})
                # The command's checks of a variant's settings (not its refusal of a variant differing only in
                # repeats: that one reaches the baseline here).
                run_variants(argparse.Namespace(**{**vars(variant), "variant": None}))
            except (argparse.ArgumentTypeError, ValueError):
                continue  # not a value of this flag, or settings the command refuses
            if {**vars(variant), "variant": None} == vars(own):
                continue  # the run's own value
            tried += 1
            baseline_config = _config(own, "baseline") != _config(variant, "baseline")
            settings = baseline_settings(own, "fp32") != baseline_settings(variant, "fp32")
            if name in READ_BY_THE_BASELINE_WHEN:
                assert settings == (baseline_config and READ_BY_THE_BASELINE_WHEN[name](own)), (base, value)
            else:
                assert settings or not baseline_config, (base, value)
            changes["baseline_config"] += baseline_config
            changes["baseline_settings"] += settings
            changes["compact_config"] += _config(own, "compact") != _config(variant, "compact")
    assert tried, f"--variant {flag}: no value among VALUES is taken: add one"
    if name in COMPACT_ONLY:
        assert changes["baseline_settings"] == 0 and changes["compact_config"] > 0, changes
    elif name in READ_BY_THE_BASELINE_WHEN:
        # Some change of the baseline's config leaves its measurement as it was (else the flag is a plain one).
        assert changes["baseline_settings"] < changes["baseline_config"] and changes["compact_config"] > 0, changes
    elif changes["baseline_config"] == 0:
        assert name in MEASUREMENT_FLAGS, (f"--variant {flag} changes neither execution's StepConfig: say how the "
                                           "baseline's measurement depends on it (MEASUREMENT_FLAGS) or that it "
                                           "reaches the compact execution alone (COMPACT_ONLY)")
        assert changes["baseline_settings"] == tried, changes
    else:
        assert changes["baseline_settings"] > 0 and name not in MEASUREMENT_FLAGS, changes


def test_the_flag_lists_name_run_flags():
    names = {flag.replace("-", "_") for flag in VARIANT_FLAGS}
    assert set(COMPACT_ONLY) <= names and set(MEASUREMENT_FLAGS) <= names and set(READ_BY_THE_BASELINE_WHEN) <= names


def test_a_case_that_reused_is_no_new_source():
    """A case that took a baseline keeps nothing of its own: a later case with the same settings takes the one
    measured (the source names stay the first measuring case's)."""
    from harts.bench.speedup.reuse import BaselineReuse

    args = build_parser().parse_args(["bench", "speedup", "--model", "tiny", "--trees", "t", "--variant",
                                      "compact-attention-backend=naive", "--variant",
                                      "compact-attention-backend=sdpa"])
    own, first, second = run_variants(args)
    results = {"baseline": {"fbg_s": 1.0}, "compact": {}}
    reuse = BaselineReuse(True, "fp32")
    assert reuse.find(0, own) is None
    reuse.keep(0, own, results)
    assert reuse.find(0, first).source == THE_RUNS_OWN
    reuse.keep(0, first, copy.deepcopy(results))
    assert reuse.find(0, second).source == THE_RUNS_OWN
    assert reuse.find(1, second) is None  # another step
    assert BaselineReuse(False, "fp32").find(0, own) is None
