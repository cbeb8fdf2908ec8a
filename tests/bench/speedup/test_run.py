"""`harts bench speedup` end to end (harts.bench.speedup.run, .cli, .measure, .executions) on a small tree step with
the tiny model: a single-process record whose figures agree with each other (F + B = F/B/Grad time, compression =
S / C, the breakdown's terms sum to the excess), a failing case as an error row (capacity below the longest
trajectory, a vocabulary smaller than the tokens), SIGTERM, the profile, each execution flag reaching the executions
it names, and `--variant`."""

import json
from collections import Counter

import pytest
import torch

from harts.bench.speedup.records import HEADLINE_KEYS
from harts.cli.main import main
from harts.model.moe import MoE
from tests.bench.helpers import sigterm_on_call, tiny_with_vocab
from tests.bench.speedup.helpers import check_record, speedup


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
    code, records, printed = speedup(args, tmp_path, capsys)
    assert code == 1 and len(records) == 1 and "results" not in records[0]
    assert expected in records[0]["error"], records[0]["error"]
    assert records[0]["config"]["parallel"] == ("dp2" if parallel else "single")
    assert printed == [{"step": 0, "model": records[0]["config"]["model"], "parallel": records[0]["config"]["parallel"],
                        **dict.fromkeys(HEADLINE_KEYS), "error": records[0]["error"]}]


def test_sigterm_ends_the_run_with_an_error_row_keeping_the_finished_steps(tree_step_path, tmp_path, capsys,
                                                                          monkeypatch):
    import signal

    from harts import engine as engine_module  # the name the engine calls

    path, _ = tree_step_path
    monkeypatch.setattr(engine_module, "run_step", sigterm_on_call(engine_module.run_step, 2))
    before = signal.getsignal(signal.SIGTERM)
    code, records, _ = speedup(["--trees", path, "--capacity", "80", "--repeats", "1"], tmp_path, capsys)
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
    code, records, _ = speedup(["--trees", path, "--capacity", "80", "--repeats", "1"], tmp_path, capsys)
    assert code == 128 + signal.SIGTERM
    assert len(records) == 1 and "error" not in records[0] and records[0]["results"]["fbg_speedup"] > 0


def test_profile_of_the_largest_microbatch(tree_step_path, tmp_path, capsys):
    from harts.bench.speedup.measure import PROFILE_TOP

    path, step = tree_step_path
    code, records, _ = speedup(["--trees", path, "--capacity", "80", "--repeats", "1", "--no-breakdown", "--profile"],
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

    from harts.bench.speedup.executions import step_configs

    args = argparse.Namespace(device="cpu", recompute=True, attention_backend=None, compact_attention_backend="naive",
                              kda_backend="fla", gdn_kernel="kda", logprob_grad_precision="input", recompute_blocks=2,
                              keep_attention=True, keep_kda_intermediates=True, logprob_chunk_rows=1024,
                              compact_recompute_blocks=None, recompute_by_rows=False, planner="harts", capacity=80,
                              experts_backend=None, dtype=None, memory_margin=0.05, mtp_loss_scaling_factor=None,
                              kda_calls="separate")
    configs = step_configs(args, "fp32")
    assert (configs["baseline"].attention_backend, configs["compact"].attention_backend) == ("sdpa", "naive")
    for config in configs.values():
        assert (config.logprob_grad_precision, config.recompute, config.recompute_blocks) == ("input", True, 2)
        assert config.logprob_chunk_rows == 1024
        assert config.keep_attention and config.keep_kda_intermediates and config.kda_backend == "fla"
        assert config.gdn_kernel == "kda"
    path, _ = tree_step_path
    code, records, _ = speedup(["--trees", path, "--capacity", "80", "--repeats", "1", "--no-breakdown",
                                 "--compact-attention-backend", "naive"], tmp_path, capsys)
    assert code == 0 and records[0]["config"]["compact_attention_backend"] == "naive"


def test_recompute_blocks(tree_step_path, tmp_path, capsys):
    """--recompute-blocks reaches both executions' StepConfig and the record; without --recompute it is an error."""
    path, _ = tree_step_path
    code, records, _ = speedup(["--trees", path, "--capacity", "80", "--repeats", "1", "--no-breakdown",
                                 "--recompute", "--recompute-blocks", "1"], tmp_path, capsys)
    assert code == 0 and records[0]["config"]["recompute_blocks"] == 1
    assert records[0]["config"]["keep_attention"] is False
    code = main(["bench", "speedup", "--model", "tiny", "--trees", path, "--recompute-blocks", "1",
                 "--out", str(tmp_path / "bad.json")])
    assert code != 0 and "--recompute-blocks needs --recompute" in capsys.readouterr().err


def test_compact_recompute_blocks_and_recompute_by_rows(tree_step_path, tmp_path, capsys, monkeypatch):
    """--compact-recompute-blocks reaches the compact execution's StepConfig only and --recompute-by-rows both,
    and the record names both; each without what it needs is a one-line error, no record."""
    from harts import engine as engine_module  # the name the engine calls

    seen = []
    run_step = engine_module.run_step
    monkeypatch.setattr(engine_module, "run_step", lambda model, step, microbatches, config, **k: seen.append(
        (config.execution, config.recompute_blocks, config.recompute_by_rows)) or run_step(
        model, step, microbatches, config, **k))
    path, _ = tree_step_path
    code, records, _ = speedup(["--trees", path, "--capacity", "80", "--repeats", "1", "--no-breakdown",
                                 "--recompute", "--recompute-blocks", "2", "--compact-recompute-blocks", "1",
                                 "--recompute-by-rows"], tmp_path, capsys)
    config = records[0]["config"]
    assert code == 0 and (config["recompute_blocks"], config["compact_recompute_blocks"]) == (2, 1)
    assert config["recompute_by_rows"] is True
    assert seen and set(seen) == {("baseline", 2, True), ("compact", 1, True)}
    for flags, message in ((["--compact-recompute-blocks", "1"], "--compact-recompute-blocks needs --recompute"),
                           (["--recompute", "--recompute-by-rows"], "--recompute-by-rows scales the blocks --recompute-blocks keeps")):
        code = main(["bench", "speedup", "--model", "tiny", "--trees", path, *flags,
                     "--out", str(tmp_path / "bad.json")])
        err = capsys.readouterr().err
        assert code != 0 and message in err and "Traceback" not in err
        assert not (tmp_path / "bad.json").exists()


def test_keep_attention(tree_step_path, tmp_path, capsys, monkeypatch):
    """--keep-attention reaches the model's forward in both executions and the record; with a backend whose
    kernels cannot be kept it is an error naming the field, one line, no record."""
    from harts.model.model import HybridModel

    kept = []
    forward = HybridModel.forward
    monkeypatch.setattr(HybridModel, "forward", lambda self, *a, **k: kept.append(k["keep_attention"]) or
                        forward(self, *a, **k))
    path, _ = tree_step_path
    code, records, _ = speedup(["--trees", path, "--capacity", "80", "--repeats", "1", "--no-breakdown",
                                 "--recompute", "--keep-attention"], tmp_path, capsys)
    assert code == 0 and records[0]["config"]["keep_attention"] is True
    assert kept and set(kept) == {True}
    for flags, message in ((["--recompute", "--compact-attention-backend", "flex"],
                            "--keep-attention needs an attention backend among"),
                           ([], "--keep-attention needs --recompute")):
        code = main(["bench", "speedup", "--model", "tiny", "--trees", path, "--keep-attention", *flags,
                     "--out", str(tmp_path / "bad.json")])
        err = capsys.readouterr().err
        assert code != 0 and message in err and "Traceback" not in err
        assert not (tmp_path / "bad.json").exists()


def test_single_process_record(tree_step_path, tmp_path, capsys):
    path, step = tree_step_path
    code, records, printed = speedup(["--trees", path, "--capacity", "80", "--repeats", "1"], tmp_path, capsys)
    assert code == 0, records
    (record,) = records
    check_record(record, step, "single", 1)
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


def test_bf16_parameters_with_fp32_gradients(tree_step_path, tmp_path, capsys, monkeypatch):
    from harts import engine as engine_module  # the name the engine calls

    run_step = engine_module.run_step
    seen = []

    def spy(model, *args, **kwargs):
        result = run_step(model, *args, **kwargs)
        matrices = [p for p in model.parameters() if p.dim() >= 2]
        seen.append((matrices[0].dtype, any(p.grad is not None for p in matrices)))
        return result

    monkeypatch.setattr(engine_module, "run_step", spy)
    path, step = tree_step_path
    code, records, _ = speedup(["--trees", path, "--capacity", "80", "--repeats", "1", "--dtype", "bf16",
                                 "--params", "bf16", "--no-breakdown"], tmp_path, capsys)
    assert code == 0, records
    (record,) = records
    assert record["config"]["params"] == "bf16" and record["config"]["dtype"] == "bf16"
    check_record(record, step, "single", 1)
    # Every step ran on bf16 weights, and their gradients went to the fp32 buffers, not .grad.
    assert seen and all(found == (torch.bfloat16, False) for found in seen)


@pytest.mark.parametrize(("params", "dtype", "parallel", "expected"), [
    (None, "bf16", None, "bf16"), (None, "bf16", "dp2", "fp32"), (None, "fp32", None, "fp32"),
    ("fp32", "bf16", None, "fp32"), ("bf16", "fp32", None, "needs --dtype bf16"),
    ("bf16", "bf16", "dp2", "not implemented with --parallel"),
], ids=["default-bf16", "default-parallel", "default-fp32", "fp32", "bf16-under-fp32", "bf16-parallel"])
def test_parameter_dtype(params, dtype, parallel, expected):
    from harts.bench.speedup.run import parameter_dtype

    if expected in ("bf16", "fp32"):
        assert parameter_dtype(params, dtype, parallel) == expected
    else:
        with pytest.raises(ValueError, match=expected):
            parameter_dtype(params, dtype, parallel)


def test_experts_backend_overrides_the_model_config(tree_step_path, tmp_path, capsys, monkeypatch):
    """--experts-backend reaches the model both executions run and the record's model config."""
    from harts.model.moe import MoE

    backends = []
    monkeypatch.setattr(MoE, "routed_experts", lambda self, x, routing, *rest: backends.append(
        self.config.experts_backend) or self.loop_experts(x, routing).to(x.dtype))
    path, _ = tree_step_path
    code, records, _ = speedup(["--trees", path, "--capacity", "80", "--repeats", "1", "--no-breakdown",
                                 "--experts-backend", "lean"], tmp_path, capsys)
    assert code == 0 and records[0]["config"]["model_config"]["moe"]["experts_backend"] == "lean"
    assert backends and set(backends) == {"lean"}


def test_variants_run_in_one_process_each_with_its_settings(tree_step_path, tmp_path, capsys, monkeypatch):
    """Every step runs with the run's own settings, then once per `--variant`, on one model (built once), each
    record with the settings its variant gave and its run steps with those settings; a variant that fails is its
    own error row."""
    import harts.model.model as model_module
    from harts import engine as engine_module  # the name the engine calls

    path, step = tree_step_path
    seen, builds, chunks = [], [], set()
    run_step = engine_module.run_step
    init = model_module.HybridModel.__init__

    def recording_run_step(model, step, microbatches, config, **kwargs):
        backends = {m.config.experts_backend for m in model.modules() if isinstance(m, MoE)}
        chunks.add((config.logprob_chunk_rows, tuple(backends)))
        seen.append((config.execution, config.recompute, config.recompute_blocks, config.keep_attention, *backends))
        return run_step(model, step, microbatches, config, **kwargs)

    def counting_init(self, *args, **kwargs):
        builds.append(1)
        init(self, *args, **kwargs)

    monkeypatch.setattr(engine_module, "run_step", recording_run_step)
    monkeypatch.setattr(model_module.HybridModel, "__init__", counting_init)
    too_small = int(step.lengths.max()) - 1
    code, records, printed = speedup(
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
    from harts import engine as engine_module  # the name the engine calls

    seen = []
    run_step = engine_module.run_step
    monkeypatch.setattr(engine_module, "run_step", lambda model, step, microbatches, config, **k: seen.append(
        (config.execution, config.recompute_blocks)) or run_step(model, step, microbatches, config, **k))
    path, _ = tree_step_path
    code, records, _ = speedup(["--trees", path, "--capacity", "80", "--repeats", "1", "--no-breakdown",
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
     ("attention-backend=flsh4", "--attention-backend: invalid choice: 'flsh4'"),
     ("kda-backend=cuda", "--kda-backend: invalid choice: 'cuda'"),
     ("attention-backend=", "--attention-backend: invalid choice: ''"),
     ("keep-kda-intermediates", "needs --kda-backend 'fla', got 'torch'"),
     ("recompute=no,keep-kda-intermediates,kda-backend=fla", "--keep-kda-intermediates needs --recompute"),
     ("repeats=3", "the same run settings as the run's own (only repeats differ)"),
     ("recompute", "the same run settings as the run's own"),
     ("recompute=no,compact-recompute-blocks=2", "--compact-recompute-blocks needs --recompute"),
     ("recompute-by-rows", "--recompute-by-rows scales the blocks --recompute-blocks keeps"),
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


def test_a_model_with_mtp_layers_counts_their_rows_and_the_factor_turns_them_off(tree_step_path, tmp_path,
                                                                                  monkeypatch):
    """A model with an MTP layer (tiny's in BailingHybrid's convention with Ling-3.0's one MLA MTP layer): each
    execution's MTP rows and attention pairs are in the record (the baseline's: every trajectory less its first
    token) and in its model FLOPs; --mtp-loss-scaling-factor 0 (a variant here, on the same weights) runs no MTP
    layer, and the record is one without MTP rows."""
    import yaml

    from harts.config import config_to_dict
    from harts.model.config import MTPConfig, load_model_config

    monkeypatch.setenv("WANDB_MODE", "disabled")
    path, step = tree_step_path
    config = load_model_config("bailing-tiny")
    model = tmp_path / "bailing-tiny-mtp.yaml"
    model.write_text(yaml.safe_dump({**config_to_dict(config), "name": "bailing-tiny-mtp",
                                     "mtp": config_to_dict(MTPConfig(num_layers=1, loss_scaling_factor=0.1))}))
    out = tmp_path / "mtp.json"
    code = main(["bench", "speedup", "--model", str(model), "--trees", path, "--capacity", "80", "--repeats", "1",
                 "--no-breakdown", "--variant", "mtp-loss-scaling-factor=0", "--out", str(out)])
    assert code == 0
    with_mtp, without = json.loads(out.read_text())
    check_record(with_mtp, step, "single", 1)
    base, comp = with_mtp["results"]["baseline"], with_mtp["results"]["compact"]
    lengths = step.lengths.astype(int)
    assert base["mtp_rows"] == base["mtp_semantic_tokens"] == [int((lengths - 1).sum())]
    assert base["mtp_attention_pairs"] == [int(((lengths - 1) * lengths // 2).sum())]
    assert comp["mtp_semantic_tokens"] == base["mtp_semantic_tokens"]
    assert comp["mtp_rows"][0] < base["mtp_rows"][0]
    assert comp["mtp_attention_pairs"][0] < base["mtp_attention_pairs"][0]
    assert without["config"]["mtp_loss_scaling_factor"] == 0
    check_record(without, step, "single", 1)
    assert not any(key.startswith("mtp") for key in without["results"]["baseline"])
