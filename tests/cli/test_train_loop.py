import json

import pytest
import torch

from harts.cli.main import main
from tests.fixtures import one_thread  # noqa: F401

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
        (["--resume"], "harts: error: harts train: give --config FILE, or --model and --trees"),
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
