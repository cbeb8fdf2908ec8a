import json

import pytest
import torch

from harts.cli.main import main
from tests.fixtures import one_thread  # noqa: F401
from tests.trees.helpers import cli_error

# The tiny model on the tiny trees config (two data steps): three steps cross into a second epoch.
TINY = ["--model", "tiny", "--trees", "tiny", "--num-steps", "3", "--capacity", "1024", "--lr", "1e-3",
        "--warmup-steps", "1", "--schedule", "cosine", "--no-progress", "--json"]


def _run(capsys, *argv) -> dict:
    assert main(["train", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def _steps(run_dir) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "train.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "seconds"} for r in lines if r["event"] == "step"]


def test_train_stop_and_resume_end_to_end(capsys, tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    summary = _run(capsys, *TINY, "--out", str(whole))
    assert summary["steps_run"] == 3 and summary["last_step"] == 3
    assert sorted(p.name for p in (whole / "checkpoints").iterdir()) == ["step_000003"]
    assert _run(capsys, *TINY, "--out", str(parts), "--max-steps", "2")["last_step"] == 2
    resumed = _run(capsys, "--out", str(parts), "--resume", "--no-progress", "--json")  # the checkpoint's config
    assert resumed["steps_run"] == 1 and resumed["last"]["loss"] == summary["last"]["loss"]
    assert _steps(parts) == _steps(whole)
    start = json.loads((whole / "train.jsonl").read_text().splitlines()[0])
    assert start["event"] == "start" and start["config"]["train"]["optimizer"]["lr"] == 1e-3
    assert start["config"]["model"]["name"] == "tiny" and start["environment"]["versions"]["torch"]
    record = _steps(whole)[-1]
    assert {"loss", "policy_loss", "moe_loss", "grad_norm", "lr", "clip_fraction", "kl", "semantic_tokens",
            "compact_tokens", "rows"} <= set(record)
    assert record["epoch"] == 1 and record["data_step"] == 0 and record["rows"] < record["semantic_tokens"]


def test_a_full_disk_at_the_first_checkpoint_then_a_bare_resume(capsys, tmp_path, monkeypatch):
    """The first checkpoint cannot be written: one line naming it, no partial checkpoint; `--resume` alone then
    restarts the run from step 0 with the config of its first start."""
    whole, run = tmp_path / "whole", tmp_path / "run"
    _run(capsys, *TINY, "--out", str(whole))

    def full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file")

    monkeypatch.setattr(torch, "save", full)
    assert main(["train", *TINY, "--out", str(run)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (f"harts: error: {run}/checkpoints/step_000003: could not write the checkpoint ([enforce fail at "
                    "inline_container.cc:664] . PytorchStreamWriter failed writing file)")
    assert list((run / "checkpoints").iterdir()) == []
    monkeypatch.undo()
    resumed = _run(capsys, "--out", str(run), "--resume", "--no-progress", "--json")
    assert resumed["steps_run"] == 3 and _steps(run) == _steps(whole)


def test_config_file_with_flag_overrides(capsys, tmp_path):
    config = tmp_path / "train.yaml"
    config.write_text("model: tiny\nnum_steps: 1\ndata: {trees: tiny}\nexecution: {capacity: 1024}\n"
                      "loss: {name: ppo}\noptimizer: {lr: 1.0e-4}\n")
    _run(capsys, "--config", str(config), "--out", str(tmp_path / "run"), "--lr", "2e-4", "--execution", "baseline",
         "--clip-ratio-high", "0.28", "--recompute", "--keep-attention", "--no-progress", "--json")
    resolved = json.loads((tmp_path / "run" / "checkpoints" / "step_000001" / "config.json").read_text())["train"]
    assert resolved["optimizer"]["lr"] == 2e-4 and resolved["execution"]["execution"] == "baseline"
    assert resolved["execution"]["planner"] == "per-trajectory" and resolved["loss"]["ppo"]["clip_ratio_high"] == 0.28
    assert resolved["execution"]["recompute"] and resolved["execution"]["keep_attention"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "tiny"], "harts: error: harts train: give --config FILE, or --model and --trees"),
        (["--config", "{tmp}/bad.yaml"], "harts: error: {tmp}/bad.yaml: unknown key 'optimizer.lrr' (allowed: "),
        (["--model", "tiny", "--trees", "tiny", "--loss", "ppo", "--kl-coef", "0.1"],
         "harts: error: harts train: --kl-coef applies to the grpo loss, not 'ppo'"),
        (["--model", "tiny", "--trees", "tiny", "--lr", "nan"], "harts: error: command line: optimizer.lr must be a finite"),
        (["--resume"], "harts: error: harts train --resume: {tmp}/run holds no run to resume (no checkpoint, no start "
                       "record in train.jsonl); give --config FILE, or --model and --trees, to start one"),
        (["--model", "tiny", "--trees", "tiny", "--accept-changed-data"],
         "harts: error: harts train: --accept-changed-data applies to --resume"),
    ],
    ids=["no-model", "unknown-key", "kl-with-ppo", "nan-lr", "nothing-to-resume", "accept-without-resume"],
)
def test_bad_invocations_fail_in_one_line(capsys, tmp_path, argv, message):
    (tmp_path / "bad.yaml").write_text("model: tiny\ndata: {trees: tiny}\noptimizer: {lrr: 1}\n")
    argv = [arg.format(tmp=tmp_path) for arg in argv]
    assert main(["train", *argv, "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith(message.format(tmp=tmp_path)) and captured.out == ""


def test_loss_flags_reach_the_train_config(tmp_path):
    """Every loss field has its flag under `harts train` (harts.args.LOSS_OPTIONS), set in loss.<name>."""
    from harts.cli.main import build_parser
    from harts.cli.train_loop import build_config

    argv = ["train", "--model", "tiny", "--trees", "tiny", "--out", str(tmp_path / "run"), "--dual-clip-ratio", "3",
            "--log-ratio-clamp", "20", "--kl-coef", "0.001", "--kl-estimator", "low_var_kl", "--entropy-coef", "0.01",
            "--aggregation", "seq-mean-token-sum-norm", "--loss-scale-factor", "4096", "--no-kl-importance-weighted"]
    grpo = build_config(build_parser().parse_args(argv)).loss.grpo
    assert (grpo.dual_clip_ratio, grpo.log_ratio_clamp, grpo.kl_coef, grpo.kl_estimator, grpo.entropy_coef,
            grpo.aggregation, grpo.loss_scale_factor, grpo.kl_importance_weighted) == (
        3.0, 20.0, 0.001, "low_var_kl", 0.01, "seq-mean-token-sum-norm", 4096.0, False)
    ppo = build_config(build_parser().parse_args([*argv[:7], "--loss", "ppo", "--entropy-coef", "0.02"])).loss.ppo
    assert ppo.entropy_coef == 0.02
    with pytest.raises(ValueError, match="harts train: --surrogate applies to the grpo loss, not 'ppo'"):
        build_config(build_parser().parse_args([*argv[:7], "--loss", "ppo", "--surrogate", "cispo"]))


# gdn-tiny: softmax routing whose MoE layers report their statistics (aux_loss_coeff > 0); two microbatches a step.
POOLED = ["--model", "gdn-tiny", "--trees", "tiny", "--num-steps", "2", "--capacity", "512", "--lr", "1e-2",
          "--no-progress", "--json"]


def _start(run_dir) -> dict:
    return json.loads((run_dir / "train.jsonl").read_text().splitlines()[0])


def test_pooled_balance_coeff_reaches_the_loss_and_the_record(capsys, tmp_path):
    """--pooled-balance-coeff c: the first step (the same weights) logs the loss without it plus c × the pooled loss
    (the mean over its microbatches, logged), the policy loss unchanged; the gradient moves the weights otherwise;
    the start record's and the checkpoint's resolved config hold c (0 when not given)."""
    runs = {coeff: tmp_path / f"run-{coeff}" for coeff in ("0", "0.5")}
    for coeff, run in runs.items():
        _run(capsys, *POOLED, "--out", str(run), *(["--pooled-balance-coeff", coeff] if coeff != "0" else []))
    without, with_ = (_steps(runs[coeff]) for coeff in ("0", "0.5"))
    first, first_with = without[0], with_[0]
    assert "pooled_balance_loss" not in first and first_with["microbatches"] == first["microbatches"] > 1
    assert first_with["pooled_balance_loss"] > 2.0  # top-2 routing: 2 when balanced
    assert first_with["policy_loss"] == pytest.approx(first["policy_loss"], rel=1e-6)
    assert first_with["loss"] == pytest.approx(first["loss"] + 0.5 * first_with["pooled_balance_loss"], rel=1e-6)
    assert first_with["moe_loss"] == pytest.approx(first["moe_loss"] + 0.5 * first_with["pooled_balance_loss"],
                                                   rel=1e-6)
    assert first_with["grad_norm"] != first["grad_norm"] and with_[1]["policy_loss"] != without[1]["policy_loss"]
    for coeff, run in runs.items():
        assert _start(run)["config"]["train"]["loss"]["pooled_balance_coeff"] == float(coeff)
        saved = json.loads((run / "checkpoints" / "step_000002" / "config.json").read_text())
        assert saved["train"]["loss"]["pooled_balance_coeff"] == float(coeff)


def test_resume_keeps_the_pooled_balance_coeff(capsys, tmp_path):
    """A run stopped after step 1 and resumed without flags (the checkpoint's config) repeats the uninterrupted run
    with the coefficient; resuming with another coefficient is refused naming the key."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    _run(capsys, *POOLED, "--out", str(whole), "--pooled-balance-coeff", "0.5")
    _run(capsys, *POOLED, "--out", str(parts), "--pooled-balance-coeff", "0.5", "--max-steps", "1")
    resumed = _run(capsys, "--out", str(parts), "--resume", "--no-progress", "--json")
    assert resumed["steps_run"] == 1 and "pooled_balance_loss" in resumed["last"]
    assert _steps(parts) == _steps(whole)
    starts = [record for record in map(json.loads, (parts / "train.jsonl").read_text().splitlines())
              if record["event"] == "start"]
    assert [start["config"]["train"]["loss"]["pooled_balance_coeff"] for start in starts] == [0.5, 0.5]
    line = cli_error(["train", "--out", str(parts), "--resume", "--pooled-balance-coeff", "0", "--no-progress"],
                     capsys)
    assert line == (f"harts: error: {parts}/checkpoints/step_000002/config.json: 'train.loss.pooled_balance_coeff' "
                    "is 0.5 in the checkpoint but 0.0 now; resume with the checkpoint's config")


POOLED_REFUSED = {
    "negative-flag": (["--model", "gdn-tiny", "--pooled-balance-coeff", "-1"],
                      "harts: error: train: argument --pooled-balance-coeff: expected a finite number >= 0, got '-1' "
                      "(see 'harts train --help')"),
    "nan-flag": (["--model", "gdn-tiny", "--pooled-balance-coeff", "nan"],
                 "harts: error: train: argument --pooled-balance-coeff: expected a finite number >= 0, got 'nan' "
                 "(see 'harts train --help')"),
    "negative-key": (["--config", "{tmp}/train.yaml"],
                     "harts: error: {tmp}/train.yaml: loss.pooled_balance_coeff must be a finite number >= 0, "
                     "got -0.5"),
    "nan-key": (["--config", "{tmp}/nan.yaml"],
                "harts: error: {tmp}/nan.yaml: loss.pooled_balance_coeff must be a finite number >= 0, got nan"),
    "sigmoid-model": (["--model", "tiny", "--pooled-balance-coeff", "0.5"],
                      "harts: error: harts train: loss.pooled_balance_coeff 0.5 on model 'tiny': transformers' "
                      "load-balancing loss is the softmax one; the model routes with sigmoid scores"),
    "dense-model": (["--model", "{tmp}/dense.yaml", "--pooled-balance-coeff", "0.5"],
                    "harts: error: harts train: loss.pooled_balance_coeff 0.5 on model 'dense-tiny': the model has "
                    "no MoE layer"),
    "mtp-model": (["--model", "{tmp}/mtp.yaml", "--pooled-balance-coeff", "0.5"],
                  "harts: error: harts train: loss.pooled_balance_coeff 0.5 on model 'softmax-tiny-mtp': its MTP "
                  "layers run in this step and transformers' loss pools the decoder's layers only (set "
                  "mtp_loss_scaling_factor 0)"),
}


def _model_yaml(edits: dict[str, str], extra: str = "") -> str:
    from harts.config import shipped_config_path

    text = shipped_config_path("tiny", "models").read_text()
    for old, new in edits.items():
        assert old in text
        text = text.replace(old, new)
    return text + extra


@pytest.mark.parametrize("case", POOLED_REFUSED)
def test_a_bad_pooled_balance_coeff_or_model_is_refused_in_one_line(capsys, tmp_path, case):
    """Before anything is built or written: no run directory."""
    run = "model: gdn-tiny\ndata: {trees: tiny}\n"
    (tmp_path / "train.yaml").write_text(run + "loss: {pooled_balance_coeff: -0.5}\n")
    (tmp_path / "nan.yaml").write_text(run + "loss: {name: ppo, pooled_balance_coeff: .nan}\n")
    softmax = {"score_function: sigmoid": "score_function: softmax", "expert_bias: true": "expert_bias: false"}
    (tmp_path / "mtp.yaml").write_text(_model_yaml({"name: tiny": "name: softmax-tiny-mtp", **softmax},
                                                   "mtp: {num_layers: 1}\n"))
    (tmp_path / "dense.yaml").write_text(_model_yaml({"name: tiny": "name: dense-tiny",
                                                      "num_dense_layers: 1": "num_dense_layers: 4"}))
    argv, message = POOLED_REFUSED[case]
    argv = [arg.format(tmp=tmp_path) for arg in argv]
    trees = [] if "--config" in argv else ["--trees", "tiny"]
    line = cli_error(["train", *argv, *trees, "--out", str(tmp_path / "run"), "--no-progress"], capsys)
    assert line == message.format(tmp=tmp_path)
    assert not (tmp_path / "run").exists()


def test_an_mtp_model_trains_with_the_pooled_loss_once_its_mtp_loss_is_off(capsys, tmp_path):
    softmax = {"score_function: sigmoid": "score_function: softmax", "expert_bias: true": "expert_bias: false"}
    (tmp_path / "mtp.yaml").write_text(_model_yaml({"name: tiny": "name: softmax-tiny-mtp", **softmax},
                                                   "mtp: {num_layers: 1}\n"))
    summary = _run(capsys, "--model", str(tmp_path / "mtp.yaml"), "--trees", "tiny", "--num-steps", "1",
                   "--pooled-balance-coeff", "0.5", "--mtp-loss-scaling-factor", "0", "--out", str(tmp_path / "run"),
                   "--no-progress", "--json")
    assert summary["last"]["pooled_balance_loss"] > 0 and "mtp_loss" not in summary["last"]


def test_recompute_blocks_auto_and_the_memory_margin_reach_the_train_config(tmp_path):
    """`harts train` takes --recompute-blocks auto (the one command line besides bench speedup's that searches) and
    --memory-margin into its execution section."""
    from harts.cli.main import build_parser
    from harts.cli.train_loop import build_config

    argv = ["train", "--model", "tiny", "--trees", "tiny", "--out", str(tmp_path / "run"), "--device", "cuda",
            "--recompute", "--recompute-blocks", "auto", "--memory-margin", "0.1"]
    execution = build_config(build_parser().parse_args(argv)).execution
    assert (execution.recompute_blocks, execution.memory_margin) == ("auto", 0.1)
    given = build_config(build_parser().parse_args([*argv[:-4], "--recompute-blocks", "3"])).execution
    assert (given.recompute_blocks, given.memory_margin) == (3, 0.05)
