"""Every entry point takes the Gated DeltaNet family's tiny model where it takes `tiny`: `harts verify --model
gdn-tiny` (compact = per-trajectory), `bench speedup` (a record with the model's FLOPs and the op breakdown),
`bench fidelity` (the replay ablation by hand-off depth: replay at the rerun's float noise, no-replay far above it),
`train` (steps logged) and `rl --config gdn-tiny` (both executions' records), on the sample step, on the CPU;
`--gdn-kernel` reaches every packed GDN call of the baseline (`train-step`, `bench speedup` and its record)."""

import json

import pytest

from harts.cli.main import main
from tests.fixtures import one_thread, packed_gdn_kernels  # noqa: F401

STEP = "data/samples/tiny-step.jsonl.gz"


def test_verify(capsys):
    assert main(["verify", "--model", "gdn-tiny", "--trees", STEP, "--capacity", "1024", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["candidate_rows"] < report["reference_rows"]
    assert report["max_abs_logprob_diff"] <= 1e-5 and report["grad_rel_diff"] <= 1e-4, report


@pytest.mark.parametrize("kernel", ["gdn", "kda"])
def test_train_step_passes_the_gdn_kernel_to_the_baseline(capsys, packed_gdn_kernels, kernel):
    assert main(["train-step", "--model", "gdn-tiny", "--trees", STEP, "--execution", "baseline", "--capacity",
                 "1024", "--gdn-kernel", kernel, "--json"]) == 0
    assert packed_gdn_kernels and set(packed_gdn_kernels) == {kernel}


def test_bench_speedup(tmp_path, monkeypatch, packed_gdn_kernels):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = tmp_path / "speedup.json"
    assert main(["bench", "speedup", "--model", "gdn-tiny", "--trees", STEP, "--capacity", "1024", "--repeats", "1",
                 "--gdn-kernel", "kda", "--out", str(out)]) == 0
    (record,) = json.loads(out.read_text())
    assert record["config"]["model_config"]["gdn"]["num_value_heads"] == 4
    assert record["config"]["gdn_kernel"] == "kda" and packed_gdn_kernels and set(packed_gdn_kernels) == {"kda"}
    results = record["results"]
    assert results["compression"] > 1 and results["flops_compression"] > 1
    assert set(results["breakdown"]["op_seconds"]["compact"]) >= {"kda", "kda_one_call", "mla", "lm_head"}


def test_bench_fidelity_replay_ablation(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = tmp_path / "fidelity.json"
    assert main(["bench", "fidelity", "--model", "gdn-tiny", "--trees", STEP, "--capacity", "1024", "--no-gradients",
                 "--out", str(out)]) == 0
    (record,) = json.loads(out.read_text())
    layers = record["results"]["block_distance"]
    assert {layer["kind"] for layer in layers.values()} == {"gdn", "gqa"}
    handed = [paths for layer in layers.values() for depth, paths in layer.items() if depth not in ("kind", "0")]
    # Replay is exact up to float noise (the attention layers' differently packed calls round differently, by CPU).
    assert handed and all(paths["replay"] <= 1e-5 for paths in handed)
    assert all(paths["no-replay"] > 1e-4 for paths in handed)


def test_train(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = tmp_path / "train"
    assert main(["train", "--model", "gdn-tiny", "--trees", STEP, "--num-steps", "2", "--capacity", "1024",
                 "--out", str(out), "--no-progress"]) == 0
    lines = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if line["event"] == "step"] == [1, 2]
    assert lines[0]["config"]["train"]["model"] == "gdn-tiny"


def test_rl(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = tmp_path / "rl.json"
    assert main(["rl", "--config", "gdn-tiny", "--out", str(out), "--seeds", "0", "--num-steps", "1",
                 "--no-progress"]) == 0
    records = json.loads(out.read_text())
    assert [(r["config"]["model"]["name"], r["config"]["execution"]) for r in records] == [
        ("gdn-tiny", "compact"), ("gdn-tiny", "baseline")]
