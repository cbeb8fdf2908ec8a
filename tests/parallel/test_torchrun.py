"""The `--parallel` commands started by torchrun (gloo on CPU): every rank runs the command, rank 0 alone
prints and writes records, the others exit 0 quietly.

One node (`--standalone --nproc-per-node 2`): `harts bench speedup` over two steps and a variant (four launches
in one process: the process group is kept between them; the variant's reuse the step's baseline), `harts verify` (its JSON once, meeting the
thresholds), a rank that fails (one line per rank, one error record), and a world that does not fit
(no --parallel). Two nodes simulated on this machine: two torchrun processes with `--nnodes 2
--nproc-per-node 1` meeting at a c10d rendezvous on a free local port (c10d gives the ranks in
arrival order, so either process may be rank 0). Slow (17 s and 5 s here, and their paths are the ones
above: a rank-0 record, the other ranks quiet): `harts bench fidelity` and `harts train-step` with
expert parallelism.
"""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from harts.trees.io import read_step
from harts.trees.trie import PrefixIndex

REPO = Path(__file__).resolve().parents[2]
STEP = str(REPO / "data/samples/tiny-step.jsonl.gz")
TINY_TREES = str(REPO / "configs/trees/tiny.yaml")
TIMEOUT_S = 300


def _torchrun_command(*launcher: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "harts"]


def _start(command: list[str], cwd: Path) -> subprocess.Popen:
    # A session of its own, so that a timeout also stops torchrun's workers; W&B off (records only).
    env = {**os.environ, "WANDB_MODE": "disabled"}
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _finish(process: subprocess.Popen) -> tuple[int, str, str]:
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    return process.returncode, stdout, stderr


def _one_node(cwd: Path, *args: str) -> tuple[int, str, str]:
    return _finish(_start([*_torchrun_command("--standalone", "--nproc-per-node", "2"), *args], cwd))


def _json_lines(stdout: str) -> list:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith(("{", "["))]


def _harts_lines(stderr: str) -> list[str]:
    """harts's error and warning lines (its notes, `harts: step 0: ...`, are expected)."""
    return [line for line in stderr.splitlines() if line.startswith(("harts: error: ", "harts: warning: "))]


def test_speedup_writes_the_records_once(tmp_path):
    """Two steps, each with a variant that changes only the compact execution: its baseline is the step's first
    case's on every rank (rank 0 decides; the ranks' program runs on its arguments)."""
    out = tmp_path / "speedup.json"
    code, stdout, stderr = _one_node(tmp_path, "bench", "speedup", "--model", "tiny", "--trees", TINY_TREES,
                                     "--steps", "0,1", "--repeats", "1", "--capacity", "1024", "--parallel", "dp2",
                                     "--variant", "compact-attention-backend=naive", "--out", str(out), "--json")
    assert code == 0, stderr[-3000:]
    records = json.loads(out.read_text())
    assert [(r["config"]["step"], r["config"]["variant"]) for r in records] == [
        (0, None), (0, "compact-attention-backend=naive"), (1, None), (1, "compact-attention-backend=naive")]
    for record in records:
        assert "error" not in record, record["error"]
        config, results = record["config"], record["results"]
        assert (config["parallel"], config["world_size"], results["world_size"]) == ("dp2", 2, 2)
        assert results["compression"] == pytest.approx(results["semantic_tokens"] / results["compact_tokens"])
        for execution in ("baseline", "compact"):
            assert [len(ranks) for ranks in results[execution]["samples"]] == [2]  # one repeat, both ranks
    for own, variant in (records[:2], records[2:]):
        assert (own["results"]["baseline_reused_from"], variant["results"]["baseline_reused_from"]) == (
            None, "the run's own")
        assert variant["results"]["baseline"] == own["results"]["baseline"]
        assert variant["results"]["compact"]["samples"] != own["results"]["compact"]["samples"]
    (headlines,) = _json_lines(stdout)  # printed by rank 0 alone
    assert [h["semantic_tokens"] for h in headlines] == [r["results"]["semantic_tokens"] for r in records]
    assert stdout.count("| paper |") == 1 and stderr.count("wrote 4 record(s)") == 1
    assert stderr.count("step 0: ") == 1 and not _harts_lines(stderr)


def _check_verify(report: dict) -> None:
    assert (report["parallel"], report["world_size"]) == ("dp2", 2)
    assert report["compact_tokens"] == PrefixIndex.from_step(read_step(STEP)).segment_tree().num_compact_tokens
    for execution in ("baseline", "compact"):
        result = report[execution]
        assert result["logit_cosine_min"] >= 0.99999 and result["loss_rel_diff"] <= 1e-6, result
        assert result["grad_rel_diff"] <= 1e-4 and result["max_abs_logprob_diff"] <= 1e-5, result


VERIFY = ("verify", "--model", "tiny", "--trees", STEP, "--capacity", "1024", "--on-policy", "--json",
          "--parallel", "dp2")


def test_verify_prints_once(tmp_path):
    code, stdout, stderr = _one_node(tmp_path, *VERIFY)
    assert code == 0, stderr[-3000:]
    (report,) = _json_lines(stdout)
    _check_verify(report)
    assert not _harts_lines(stderr)


def test_failing_ranks_are_one_line_each_and_one_error_record(tmp_path):
    out = tmp_path / "speedup.json"
    code, _, stderr = _one_node(tmp_path, "bench", "speedup", "--model", "tiny", "--trees", TINY_TREES,
                                "--steps", "0,1", "--repeats", "1", "--capacity", "1024", "--parallel", "dp2",
                                "--kda-backend", "fla", "--out", str(out))
    assert code != 0
    # Rank 0's line (its error is also in its record) and rank 1's, unless torchrun stopped rank 1 first: rank
    # 0's exit ends the others, and on a loaded machine that can come before rank 1 has printed. Never a
    # traceback from harts itself, never another line. (fla's KDA does not run the tiny model's chunks of 16:
    # each rank's first layout refuses it, inside the step.)
    lines = _harts_lines(stderr)
    refused = "ValueError: packed_kda: fla's chunk_kda uses chunks of 64"
    expected = (f"harts: error: --parallel dp2: RankFailed: rank 0: {refused}", f"harts: error: rank 1: {refused}")
    assert [sum(line.startswith(e) for line in lines) for e in expected] in ([1, 0], [1, 1]) and len(lines) <= 2, lines
    assert f"{os.sep}harts{os.sep}" not in "".join(line for line in stderr.splitlines() if line.startswith("  File"))
    (record,) = json.loads(out.read_text())
    assert "error" in record and record["config"]["step"] == 0


@pytest.mark.parametrize(
    "extra, message",
    [((), "torchrun started 2 ranks: give --parallel NAME, a config of 2 ranks"),
     (("--parallel", "dp2-tp2-sp"), "parallel config 'dp2-tp2-sp' needs 4 ranks, torchrun started 2")],
    ids=["no-parallel", "world-mismatch"],
)
def test_a_world_that_does_not_fit_is_refused(tmp_path, extra, message):
    code, stdout, stderr = _one_node(tmp_path, "verify", "--model", "tiny", "--trees", STEP, "--json", *extra)
    assert code != 0 and not _json_lines(stdout)
    # Every rank refuses, one line each; the first rank to exit makes torchrun stop the other, which on a
    # loaded machine can come before that one has printed (CI, stop 29). At least one line, never another.
    lines = _harts_lines(stderr)
    assert 1 <= len(lines) <= 2 and set(lines) == {f"harts: error: {message}"}, lines


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_two_nodes(tmp_path):
    endpoint = f"127.0.0.1:{_free_port()}"
    processes = [
        _start([*_torchrun_command("--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                                   "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "harts-test"),
                *VERIFY], tmp_path)
        for node in (0, 1)
    ]
    finished = [_finish(process) for process in processes]
    for code, _, stderr in finished:
        assert code == 0, stderr[-3000:]
        assert not _harts_lines(stderr)
    reports = [report for _, stdout, _ in finished for report in _json_lines(stdout)]
    assert len(reports) == 1  # from global rank 0, whichever node it was given
    _check_verify(reports[0])


@pytest.mark.slow
def test_train_step_with_expert_parallelism(tmp_path):
    code, stdout, stderr = _one_node(tmp_path, "train-step", "--model", "tiny", "--trees", STEP, "--capacity", "1024",
                                     "--execution", "compact", "--json", "--parallel", "dp2-ep2")
    assert code == 0, stderr[-3000:]
    (summary,) = _json_lines(stdout)
    assert (summary["parallel"], summary["world_size"]) == ("dp2-ep2", 2)
    assert summary["semantic_tokens"] == read_step(STEP).num_semantic_tokens


@pytest.mark.slow
def test_fidelity_writes_the_record_once(tmp_path):
    out = tmp_path / "fidelity.json"
    code, stdout, stderr = _one_node(tmp_path, "bench", "fidelity", "--model", "tiny", "--trees", TINY_TREES,
                                     "--capacity", "1024", "--parallel", "dp2", "--out", str(out))
    assert code == 0, stderr[-3000:]
    (record,) = json.loads(out.read_text())
    assert (record["config"]["parallel"], record["results"]["world_size"]) == ("dp2", 2)
    rows = record["results"]["parallel_fidelity"]
    for execution in ("baseline", "compact"):
        for setting in ("no-recompute", "recompute"):
            row = rows[execution][setting]
            assert row["logit_cosine_min"] >= 0.99999 and row["grad_rel_diff"] <= 1e-4, row
    assert stdout.count("| paper |") == 1 and stderr.count("fidelity --parallel dp2:") == 1
