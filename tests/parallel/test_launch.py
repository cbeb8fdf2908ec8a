"""Launching ranks: results come back from rank 0, failures are one line and never hang, and the CLI.

`harts train-step/verify --parallel NAME` on the shipped tiny sample step: JSON from rank 0, bad
configs as one-line errors (exit 2), a failing rank as one line (exit 1). Slow: `harts verify
--parallel` meets the fidelity thresholds. The commands under torchrun: tests/parallel/test_torchrun.py.
"""

import json
import os
import signal
import time

import pytest
import torch.distributed as dist

from harts.cli.main import main
from harts.parallel.config import ParallelConfig, load_parallel_config
from harts.parallel.launch import RankFailed, launch, resolve_backend
from harts.trees.io import read_step
from harts.trees.trie import PrefixIndex

STEP = "data/samples/tiny-step.jsonl.gz"
TWO_RANKS = ParallelConfig(name="two-ranks", dp=2, timeout_s=120.0)


def _raise_on_rank_one(groups):
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    dist.barrier()
    return "rank 0 must not get past the barrier"


def _exit_on_rank_one(groups):
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def test_failing_rank_is_one_line_and_does_not_hang():
    start = time.perf_counter()
    with pytest.raises(RankFailed, match=r"^rank 1: ValueError: boom on purpose$"):
        launch(_raise_on_rank_one, TWO_RANKS)
    assert time.perf_counter() - start < TWO_RANKS.timeout_s


@pytest.mark.slow
def test_dead_rank_is_reported():
    with pytest.raises(RankFailed, match=r"^rank 1: exited with code 3$"):
        launch(_exit_on_rank_one, TWO_RANKS)


def _write_pid_and_sleep(groups, directory):
    # Written aside and renamed: a rank's .pid file appears only with its pid in it (the caller
    # is interrupted as soon as both files exist).
    path = os.path.join(directory, f"rank{dist.get_rank()}.pid")
    with open(path + ".tmp", "w") as handle:
        handle.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    time.sleep(600)


def test_interrupted_caller_stops_its_ranks(tmp_path):
    import threading

    from harts.tracking.records import Terminated, sigterm_raises

    def terminate_when_both_ranks_run():
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.pid"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate_when_both_ranks_run, daemon=True).start()
    started = time.monotonic()
    with pytest.raises(Terminated), sigterm_raises():
        launch(_write_pid_and_sleep, ParallelConfig(name="dp2", dp=2), str(tmp_path))
    assert time.monotonic() - started < 120
    for path in tmp_path.glob("*.pid"):
        with pytest.raises(ProcessLookupError):
            os.kill(int(path.read_text()), 0)


def test_backend_resolution():
    assert resolve_backend(load_parallel_config("dp2"), "cpu") == "gloo"
    assert resolve_backend(load_parallel_config("dp2"), "cuda") == "nccl"
    with pytest.raises(ValueError, match="backend nccl needs --device cuda"):
        resolve_backend(ParallelConfig(name="x", dp=2, backend="nccl"), "cpu")


def test_cli_train_step(capsys):
    args = ["train-step", "--model", "tiny", "--trees", STEP, "--capacity", "1024", "--json", "--parallel", "dp2"]
    assert main([*args, "--execution", "compact"]) == 0
    out = json.loads(capsys.readouterr().out)
    semantic_tokens = read_step(STEP).num_semantic_tokens
    assert (out["parallel"], out["world_size"], out["semantic_tokens"]) == ("dp2", 2, semantic_tokens)
    assert out["microbatches"] % 2 == 0 and out["rows"] < semantic_tokens
    assert out["loss"] == pytest.approx(out["policy_loss"] + out["moe_loss"])
    assert set(out["seconds"]) == {"layout", "forward", "backward", "grad_reduce", "total"}


def test_cli_errors(capsys, tmp_path):
    common = ["--model", "tiny", "--trees", STEP, "--capacity", "1024"]
    assert main(["verify", *common, "--parallel", "nope"]) == 2
    assert "unknown parallel config 'nope'" in capsys.readouterr().err
    config = tmp_path / "tp4.yaml"
    config.write_text("name: tp4\ntp: 4\n")
    assert main(["verify", *common, "--parallel", str(config)]) == 2
    assert "kda.num_heads (2) not divisible by tp (4)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:  # a bad knob is refused before any rank starts
        main(["train-step", *common, "--execution", "compact", "--parallel", "tp2", "--attention-backend", "bogus"])
    assert refused.value.code == 2 and "invalid choice: 'bogus'" in capsys.readouterr().err
    # A failure inside the ranks (fla's KDA takes no chunks of 16, the tiny model's) is one line naming a rank.
    assert main(["train-step", *common, "--execution", "compact", "--parallel", "tp2", "--kda-backend", "fla"]) == 1
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("harts:")]
    assert len(err) == 1 and err[0].startswith("harts: error: rank ") and "chunk_size 32 or 64, got 16" in err[0]


@pytest.mark.slow
def test_cli_verify_meets_the_thresholds(capsys):
    assert main(["verify", "--model", "tiny", "--trees", STEP, "--capacity", "1024", "--on-policy", "--json",
                 "--recompute", "--parallel", "tp2-sp"]) == 0
    out = json.loads(capsys.readouterr().out)
    step = read_step(STEP)
    assert out["compact_tokens"] == PrefixIndex.from_step(step).segment_tree().num_compact_tokens
    for execution in ("baseline", "compact"):
        report = out[execution]
        assert report["recompute"] is True
        assert report["logit_cosine_min"] >= 0.99999 and report["loss_rel_diff"] <= 1e-6, report
        assert report["grad_rel_diff"] <= 1e-4 and report["max_abs_logprob_diff"] <= 1e-5, report
