"""`harts rl`: records of both executions per seed (config, the environment as the run started, results),
a failed run as an error record with exit status 1, bad input (options, device cuda without a GPU, a KDA
backend the model cannot run) as one line with exit status 2."""

import json

import pytest
import torch

import harts.rl.loop
import harts.tracking.records
from harts.cli.main import main
from harts.tracking.records import environment, git_state
from tests.fixtures import one_thread  # noqa: F401
from tests.rl.test_loop import TINY


def test_records_of_both_executions(capsys, tmp_path, monkeypatch):
    out = tmp_path / "rl.json"
    run_seed, at_start = harts.rl.loop.run_seed, git_state()

    def run_then_commit(*args, **kwargs):
        result = run_seed(*args, **kwargs)
        monkeypatch.setattr(harts.tracking.records, "git_state", lambda: {"sha": "committed later", "dirty": False})
        return result

    # The records give the environment as the run started (the code that ran), not as they are written.
    monkeypatch.setattr(harts.rl.loop, "run_seed", run_then_commit)
    assert main(["rl", "--config", str(TINY), "--out", str(out), "--seeds", "1", "--num-steps", "1", "--no-progress",
                 "--json"]) == 0
    summaries = json.loads(capsys.readouterr().out)
    records = json.loads(out.read_text())
    assert [(r["benchmark"], r["config"]["seed"], r["config"]["execution"]) for r in records] == [
        ("rl", 1, "compact"), ("rl", 1, "baseline")]
    assert environment()["git"]["sha"] == "committed later"
    for record, summary in zip(records, summaries):
        assert record["environment"]["git"] == at_start and record["environment"]["hardware"]["cpu_count"]
        assert record["config"]["rl"]["num_steps"] == 1 and record["config"]["model"]["name"] == "tiny"
        assert "outside" in record["config"]["timing"]
        results = record["results"]
        assert [s["step"] for s in results["steps"]] == [0, 1] and results["warm_start"]["steps"] == 2
        assert summary == {"seed": 1, "execution": record["config"]["execution"], **results["summary"]}
        assert results["summary"]["reward_first"] == results["steps"][0]["reward"]


def test_a_failed_run_is_an_error_record(capsys, tmp_path, monkeypatch):
    def fail(config, seed, **kwargs):
        raise ValueError(f"seed {seed}, compact, step 1: the loss is nan")

    monkeypatch.setattr(harts.rl.loop, "run_seed", fail)
    out = tmp_path / "rl.jsonl"
    assert main(["rl", "--config", str(TINY), "--out", str(out), "--no-progress"]) == 1
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["config"]["seed"], r["config"]["execution"]) for r in records] == [
        (0, "compact"), (0, "baseline"), (1, "compact"), (1, "baseline")]
    assert all(r["error"] == "ValueError: seed %d, compact, step 1: the loss is nan" % r["config"]["seed"]
               for r in records)
    assert "seed 0 compact: error: ValueError" in capsys.readouterr().out


def test_a_crash_keeps_the_finished_seeds_and_fails_the_wandb_run(capsys, tmp_path, monkeypatch):
    """A seed that raises anything but a ValueError (a bug, CUDA out of memory) propagates, but the seeds
    finished before it are on disk and its W&B run is closed as failed."""
    from harts.rl.tracking import RLTracker

    finished = []
    monkeypatch.setattr(RLTracker, "start", classmethod(lambda cls, record, options=None, **kwargs: cls(options)))
    monkeypatch.setattr(RLTracker, "finish", lambda self, failed: finished.append(failed))
    run_seed = harts.rl.loop.run_seed

    def crash_on_seed_1(config, seed, **kwargs):
        if seed == 1:
            raise RuntimeError("CUDA out of memory")
        return run_seed(config, seed, **kwargs)

    monkeypatch.setattr(harts.rl.loop, "run_seed", crash_on_seed_1)
    out = tmp_path / "rl.json"
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        main(["rl", "--config", str(TINY), "--out", str(out), "--seeds", "0,1", "--num-steps", "1", "--no-progress",
              "--wandb"])
    assert finished == [False, True]
    records = json.loads(out.read_text())
    assert [(r["config"]["seed"], r["config"]["execution"]) for r in records] == [(0, "compact"), (0, "baseline")]


def test_wandb_files_go_beside_the_records(tmp_path, monkeypatch):
    """Not under the working directory's reports/wandb: the records' folder."""
    import sys

    from tests.training.test_tracking import WANDB_VARIABLES, fake_wandb

    for name in WANDB_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    calls: list = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    out = tmp_path / "records" / "rl.json"
    assert main(["rl", "--config", str(TINY), "--out", str(out), "--seeds", "0", "--num-steps", "1", "--no-progress",
                 "--wandb"]) == 0
    (run,) = [call[1] for call in calls if call[0] == "init"]
    assert run.kwargs["dir"] == str(out.parent) and "id" not in run.kwargs
    assert not any(elsewhere.iterdir())


def test_repeated_seeds_are_refused(capsys, tmp_path):
    assert main(["rl", "--config", str(TINY), "--out", str(tmp_path / "x.json"), "--seeds", "0,0"]) == 2
    assert capsys.readouterr().err == "harts: error: harts rl: --seeds 0,0: a seed is repeated\n"


def test_a_missing_config_is_one_line(capsys, tmp_path):
    assert main(["rl", "--config", "no/such.yaml", "--out", str(tmp_path / "x.json")]) == 2
    assert capsys.readouterr().err == "harts: error: no/such.yaml: no such config file\n"


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "-1"], "harts: error: rl: argument --seeds: expected non-negative"),
    (["--num-steps", "0"], "harts: error: rl: argument --num-steps: expected a positive"),
], ids=["negative-seed", "no-steps"])
def test_bad_options_are_one_line(capsys, tmp_path, argv, message):
    with pytest.raises(SystemExit) as stop:
        main(["rl", "--config", str(TINY), *argv, "--out", str(tmp_path / "x.json")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith(message) and err.count("\n") == 1


def test_cuda_without_a_gpu_is_one_line(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is available")
    config = tmp_path / "gpu.yaml"
    text = TINY.read_text(encoding="utf-8").replace("model: tiny", "model: cpu-small")
    config.write_text(text + "device: cuda\n", encoding="utf-8")
    assert main(["rl", "--config", str(config), "--out", str(tmp_path / "x.json")]) == 2
    assert capsys.readouterr().err == f"harts: error: {config}: device cuda: no CUDA device is available\n"
    assert not (tmp_path / "x.json").exists()


def test_device_override_takes_the_devices_defaults(capsys, tmp_path):
    """`--device cuda` on a CPU config: bf16 and fla by default, which the tiny model (chunks of 16) cannot run."""
    assert main(["rl", "--config", str(TINY), "--device", "cuda", "--out", str(tmp_path / "x.json")]) == 2
    assert capsys.readouterr().err == (f"harts: error: {TINY}: execution.kda_backend fla needs the model's KDA "
                                       "chunk_size 64, model tiny has 16; set execution.kda_backend: torch\n")

