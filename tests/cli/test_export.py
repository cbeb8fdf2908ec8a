"""`harts export` and `harts train --init-from` end to end, and their one-line refusals.

A kimi-tiny run trained by `harts train` exports (bf16, sharded) to a checkpoint that transformers'
KimiLinearForCausalLM loads strictly and runs to HARTS's logits; `harts train --init-from` starts from it. A run
of the shipped tiny config (a KDA output-gate bias, RoPE MLA) is refused naming both fields and the fix; an output
that is the run or its checkpoint, or a directory holding a checkpoint, is refused before anything is written.
"""

import json

import numpy as np
import pytest
import torch

from harts.cli.main import main
from harts.model.hf import load_hf_checkpoint
from tests.fixtures import one_thread  # noqa: F401
from tests.model.test_hf_reference import TRANSFORMERS_TOLERANCE, harts_logits, load_strict, max_error, padded_logits

TRAIN = ["--trees", "tiny", "--num-steps", "2", "--capacity", "1024", "--lr", "1e-3", "--no-progress", "--json"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run directories of two-step runs of kimi-tiny and of tiny."""
    root = tmp_path_factory.mktemp("runs")
    for model in ("kimi-tiny", "tiny"):
        assert main(["train", "--model", model, *TRAIN, "--out", str(root / model)]) == 0
    return root


def test_export_then_transformers_then_init_from(runs, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    capsys.readouterr()
    out = tmp_path / "hf"
    assert main(["export", "--run", str(runs / "kimi-tiny"), "--out", str(out), "--dtype", "bf16",
                 "--max-shard-bytes", "200000", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["checkpoint"] == str(runs / "kimi-tiny" / "checkpoints" / "step_000002")
    assert "model.safetensors.index.json" in summary["files"] and summary["files"][0] == "config.json"
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"

    model, _ = load_hf_checkpoint(out)
    reference = load_strict(out)
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (70, 37)]
    expected = padded_logits(reference, sequences, None)
    assert max_error(harts_logits(model, sequences), expected) <= TRANSFORMERS_TOLERANCE

    assert main(["train", "--init-from", str(out), *TRAIN, "--out", str(tmp_path / "continued")]) == 0
    continued = json.loads(capsys.readouterr().out)
    assert continued["steps_run"] == 2
    start = json.loads((tmp_path / "continued" / "train.jsonl").read_text().splitlines()[0])
    assert start["config"]["train"]["init_from"] == str(out) and start["config"]["model"]["name"] == "kimi-tiny"


@pytest.mark.parametrize(("argv", "message"), [
    (["export", "--run", "{runs}/tiny", "--out", "{tmp}/hf"],
     "harts: error: model config 'tiny': kda.output_gate_bias: true (g_b_proj has no bias); mla.use_rope: true"),
    (["export", "--run", "{runs}/kimi-tiny", "--out", "{runs}/kimi-tiny"],
     "harts: error: harts export: output {runs}/kimi-tiny is its input {runs}/kimi-tiny"),
    (["export", "--run", "{runs}/kimi-tiny", "--out", "{runs}/kimi-tiny/checkpoints/step_000002"],
     "harts: error: harts export: output {runs}/kimi-tiny/checkpoints/step_000002 is its input"),
    (["export", "--run", "{tmp}", "--out", "{tmp}/hf"],
     "harts: error: {tmp}: neither a checkpoint (no trainer.json) nor a run directory with one"),
    (["export", "--run", "{runs}/kimi-tiny", "--out", "{tmp}/hf", "--max-shard-bytes", "0"],
     "harts: error: export: argument --max-shard-bytes: expected a positive integer"),
    (["train", "--init-from", "{tmp}", *TRAIN, "--out", "{tmp}/run"],
     "harts: error: {tmp}: no config.json (not a Hugging Face checkpoint directory)"),
    (["train", "--init-from", "{tmp}", "--model", "kimi-tiny", *TRAIN, "--out", "{tmp}/run"],
     "harts: error: command line: model ('kimi-tiny') and init_from ('{tmp}') exclude each other"),
], ids=["shipped-tiny", "out-is-the-run", "out-is-the-checkpoint", "no-run", "zero-shard", "init-from-no-config",
        "init-from-and-model"])
def test_refusals_are_one_line(runs, tmp_path, capsys, argv, message):
    before = sorted(p.relative_to(runs) for p in runs.rglob("*"))
    capsys.readouterr()
    try:
        status = main([arg.format(runs=runs, tmp=tmp_path) for arg in argv])
    except SystemExit as exit:  # argparse's usage errors
        status = exit.code
    assert status == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith(message.format(runs=runs, tmp=tmp_path)), line
    assert sorted(p.relative_to(runs) for p in runs.rglob("*")) == before and not (tmp_path / "hf").exists()


def test_export_refuses_a_directory_holding_a_checkpoint(runs, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export", "--run", str(runs / "kimi-tiny"), "--out", str(out)]) == 0
    written = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert main(["export", "--run", str(runs / "kimi-tiny"), "--out", str(out)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"harts: error: {out}: already holds a checkpoint (config.json); save into a new directory"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == written


def test_train_refuses_its_init_checkpoint_as_output(runs, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export", "--run", str(runs / "kimi-tiny"), "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["train", "--init-from", str(out), *TRAIN, "--out", str(out)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"harts: error: harts train: --out {out} is the checkpoint it starts from (--init-from)")
    assert not (out / "train.jsonl").exists() and not (out / "checkpoints").exists()
