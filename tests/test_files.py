"""harts.files: a file is complete under its name or not there (exceptions, full disks, kills, concurrent
writers), and no command writes over one of its inputs.

A full disk is real here, not mocked: a child process with RLIMIT_FSIZE below the file's size gets EFBIG from the
kernel mid-write (SIGXFSZ ignored), as a full disk gives ENOSPC. Kills are SIGKILLs at random moments of a child
writing a large step again and again.
"""

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from harts.files import atomic_open, atomic_path, check_outputs, output_locks, write_text
from harts.tracking.records import write_records
from harts.trees.io import read_step, write_step
from tests.trees.helpers import cli_error, make_step

REPO = Path(__file__).resolve().parents[1]
STEP = REPO / "data/samples/tiny-step.jsonl.gz"


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name)


def test_an_error_mid_write_keeps_the_previous_file(tmp_path):
    path = tmp_path / "out.json"
    write_text(path, "old\n")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_open(path) as handle:
            handle.write("half of the new")
            raise RuntimeError("boom")
    assert path.read_text() == "old\n" and leftovers(tmp_path) == []


def test_an_os_error_names_the_path(tmp_path):
    path = tmp_path / "out.npz"
    with pytest.raises(OSError, match=rf"^{path}: could not write \(No space left on device\)$"):
        with atomic_path(path):
            raise OSError(28, "No space left on device")
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(OSError, match=rf"^{blocked / 'out.json'}: could not create its folder"):
        write_text(blocked / "out.json", "x")


def test_two_writers_never_show_a_reader_half_a_file(tmp_path):
    path = tmp_path / "records.json"
    write_records([{"writer": -1, "n": 0}], path)
    stop, invalid, reads = threading.Event(), [], [0]

    def writer(k):
        for n in range(150):
            write_records([{"writer": k, "n": n, "pad": "x" * 20_000}], path)

    def reader():
        while not stop.is_set():
            try:
                json.loads(path.read_text())
            except json.JSONDecodeError as error:
                invalid.append(str(error))
            reads[0] += 1

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(2)]
    watcher = threading.Thread(target=reader)
    watcher.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stop.set()
    watcher.join()
    assert reads[0] > 0 and invalid == [] and leftovers(tmp_path) == []


FULL_DISK = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), int(sys.argv[1])))
sys.argv = ["harts", *sys.argv[2:]]
from harts.cli.main import main
sys.exit(main())
"""


def _harts_on_a_full_disk(limit: int, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", FULL_DISK, str(limit), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def _big_step(path: Path) -> Path:
    rng = np.random.default_rng(0)
    write_step(make_step([rng.integers(0, 256, 30_000).tolist() for _ in range(8)]), path)
    return path


COMMANDS = {
    # name: (arguments given the output path and a folder to work in, the output)
    "plan-microbatches": lambda out, d: ["plan", "microbatches", str(_big_step(d / "in.npz")), "--capacity",
                                         "65536", "--dp", "1", "--out", str(out)],
    "trees-ingest": lambda out, d: ["trees", "ingest", "--format", "messages", "--tokenizer", "byte",
                                    str(_chat_logs(d / "logs.jsonl")), str(out)],
    "trees-synth": lambda out, d: ["trees", "synth", "--config", "tiny", "--steps", "0", "--format", "npz",
                                   "--out", str(out.parent)],
    # Every bench command's records go through write_records (harts.tracking.records): one of them stands for all.
    "bench-trees": lambda out, d: ["bench", "trees", "--trees", "tiny", "--repeats", "1", "--out", str(out),
                                   "--wandb-mode", "disabled"],
}
OUTPUT_NAMES = {"plan-microbatches": "plan.json", "trees-ingest": "step.npz", "trees-synth": "step_000.npz",
                "bench-trees": "trees.json"}


def _chat_logs(path: Path) -> Path:
    lines = [json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": "word " * 4000},
                                                     {"role": "assistant", "content": f"reply {i} " * 500}]})
             for i in range(6)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("command", COMMANDS)
def test_a_full_disk_leaves_the_previous_output_and_one_line(tmp_path, command):
    work = tmp_path / "work"
    work.mkdir()
    out = tmp_path / "out" / OUTPUT_NAMES[command]
    args = COMMANDS[command](out, work)
    first = _harts_on_a_full_disk(1 << 40, *args, cwd=work)
    assert first.returncode == 0, first.stderr[-2000:]
    before = digest(out)
    size = out.stat().st_size
    assert size > 100
    failed = _harts_on_a_full_disk(size // 2, *args, cwd=work)
    assert failed.returncode == 2, failed.stderr[-2000:]
    lines = [line for line in failed.stderr.splitlines() if line.startswith("harts: error: ")]
    assert lines and lines[-1].startswith(f"harts: error: {out.parent}/") and "could not write" in lines[-1], \
        failed.stderr[-2000:]
    assert "Traceback" not in failed.stderr
    assert digest(out) == before and leftovers(out.parent) == []


KILLED_WRITER = """
import sys
import numpy as np
from harts.trees.io import write_step
from tests.trees.helpers import make_step
rng = np.random.default_rng(int(sys.argv[2]))
step = make_step([rng.integers(0, 256, 200_000).tolist() for _ in range(8)])
print("ready", flush=True)
while True:
    write_step(step, sys.argv[1])
"""


@pytest.mark.parametrize("name", ["step.npz", "step.jsonl.gz"])
def test_a_kill_at_any_moment_leaves_a_whole_file(tmp_path, name):
    path = tmp_path / name
    rng = np.random.default_rng(1)
    rows = np.random.default_rng(99)
    write_step(make_step([rows.integers(0, 256, 200_000).tolist() for _ in range(8)]), path)
    for attempt in range(6):
        child = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(path), str(attempt)], cwd=REPO,
                                 env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE)
        assert child.stdout.readline().strip() == b"ready"
        time.sleep(float(rng.uniform(0.05, 1.0)))
        child.send_signal(signal.SIGKILL)
        child.wait()
        step = read_step(path)  # the previous or the new step, complete
        assert step.num_trajectories == 8 and step.num_semantic_tokens == 8 * 200_000
    # A killed writer leaves at most its hidden temporary, never a partial file under the final name.
    assert all(p.name.startswith(f".{name}.tmp-") for p in tmp_path.iterdir() if p != path)


def test_outputs_that_are_inputs_are_refused(tmp_path):
    step = tmp_path / "step.npz"
    write_step(make_step([[1, 2, 3]]), step)
    (tmp_path / "link.npz").symlink_to(step)
    folder = tmp_path / "steps"
    folder.mkdir()
    write_step(make_step([[1, 2]]), folder / "step_000.npz")
    with pytest.raises(ValueError, match=rf"^harts x: output {step} is its input {step} \(it would be overwritten\)$"):
        check_outputs("harts x", [step], [step])
    with pytest.raises(ValueError, match=rf"output {tmp_path / 'link.npz'} is its input {step}"):
        check_outputs("harts x", [tmp_path / "link.npz"], [step])
    with pytest.raises(ValueError, match=rf"output {folder / 'step_000.npz'} is {folder / 'step_000.npz'}, a file of "
                                         rf"its input {folder}"):
        check_outputs("harts x", [folder / "step_000.npz"], [folder])
    (tmp_path / "records.md").write_text("")
    (tmp_path / "link.md").symlink_to(tmp_path / "records.md")
    with pytest.raises(ValueError, match=rf"^harts x: outputs {tmp_path / 'records.md'} and {tmp_path / 'link.md'} are "
                                         r"one file \(one would overwrite the other\); choose another name$"):
        check_outputs("harts x", [tmp_path / "records.md", tmp_path / "link.md"], [])
    with pytest.raises(ValueError, match=rf"^harts x: output {folder / 'new.json'} is in its input folder {folder} \(a "
                                         r"later read of the folder would take it in\); write it elsewhere$"):
        check_outputs("harts x", [folder / "new.json"], [folder], read_whole=True)
    # New files, other files and config names are fine; a new file in an input folder that is not read whole (a
    # checkpoint's) too.
    check_outputs("harts x", [tmp_path / "new.json", tmp_path / "other.npz", None], [step, "tiny", None, folder],
                  read_whole=True)
    check_outputs("harts x", [folder / "sub" / "new.json"], [folder], read_whole=True)  # a folder of its own inside
    check_outputs("harts x", [folder / "new.json"], [folder])


def test_train_refuses_a_run_folder_in_its_data_folder_before_any_work(tmp_path, capsys):
    """`harts train --trees steps/ --out steps/` would write train.jsonl and checkpoints/ among the steps (a resume
    would then read the log as data); the data path, known once the config is built, is checked like --config."""
    from harts.cli.main import main

    folder = tmp_path / "steps"
    folder.mkdir()
    write_step(make_step([[1, 2, 3]]), folder / "step_000.npz")
    assert main(["train", "--model", "tiny", "--trees", str(folder), "--out", str(folder), "--no-progress"]) == 2
    assert capsys.readouterr().err == (f"harts: error: harts train: output {folder / 'train.jsonl'} is in its input "
                                       f"folder {folder} (a later read of the folder would take it in); write it "
                                       "elsewhere\n")
    assert sorted(p.name for p in folder.iterdir()) == ["step_000.npz"]


@pytest.mark.parametrize("suffix", [".md", ".csv"])
def test_records_named_like_their_own_table_are_refused_before_any_work(tmp_path, capsys, suffix):
    """`bench planning --out x.md` would write its records, then its .md table over them: a records --out must end
    .json or .jsonl (check_outputs also refuses two outputs that are one file: test_outputs_that_are_inputs_...)."""
    out = tmp_path / f"planning{suffix}"
    argv = ["bench", "planning", "--trees", "tiny", "--steps", "0", "--dp", "1", "--out", str(out)]
    assert cli_error(argv, capsys) == (f"harts: error: bench planning: argument --out: expected a records file ending "
                                       f".json or .jsonl, got '{out}' (see 'harts bench planning --help')")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", [
    ["trees", "ingest", "--format", "messages", "--tokenizer", "byte", "{logs}", "{logs}"],
    ["plan", "microbatches", "{step}", "--capacity", "64", "--dp", "1", "--out", "{step}"],
    ["bench", "speedup", "--model", "tiny", "--trees", "{step}", "--out", "{step}"],
    ["bench", "fidelity", "--model", "tiny", "--trees", "{step}", "--out", "{step}"],
    ["rl", "--config", "{config}", "--out", "{config}"],
], ids=["trees-ingest", "plan-microbatches", "bench-speedup", "bench-fidelity", "rl"])
def test_commands_refuse_to_write_over_their_input_before_any_work(tmp_path, argv, capsys):
    from harts.cli.main import main

    # The RL config as JSON (YAML reads it): a records --out must end .json or .jsonl.
    files = {"logs": tmp_path / "logs.jsonl", "step": tmp_path / "step.jsonl", "config": tmp_path / "rl.json"}
    files["logs"].write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    files["step"].write_bytes(STEP.read_bytes())
    files["config"].write_text(json.dumps(yaml.safe_load((REPO / "configs/rl/tiny.yaml").read_text())))
    before = {name: digest(path) for name, path in files.items()}
    argv = [a.format(**files) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"harts: error: harts {argv[0]}") and "(it would be overwritten)" in err
    assert {name: digest(path) for name, path in files.items()} == before


def test_a_second_writer_of_an_output_is_refused_and_the_lock_goes_away(tmp_path, capsys):
    from harts.cli.main import main

    out = tmp_path / "plan.json"
    argv = ["plan", "microbatches", str(STEP), "--capacity", "4096", "--dp", "1", "--out", str(out)]
    with output_locks("harts plan microbatches", [out]):
        assert (tmp_path / ".plan.json.lock").read_text() == f"{os.getpid()}\n"
        assert main(argv) == 2
        assert capsys.readouterr().err == (f"harts: error: harts plan microbatches: {out} is being written by another "
                                           f"harts process (pid {os.getpid()}); wait for it or choose another output\n")
        assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert main(argv) == 0 and sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


@pytest.mark.parametrize("bench", ["speedup", "fidelity"])
def test_a_bench_without_out_checks_and_locks_its_default_records_file(bench, tmp_path, capsys, monkeypatch):
    """Without --out the records go to reports/raw/BENCH/MODEL.json: named before any work, so that it is refused
    as the command's own input and while another harts process writes it, as a given --out is."""
    from harts.cli.main import main

    monkeypatch.chdir(tmp_path)
    default = Path("reports/raw") / bench / "tiny.json"
    default.parent.mkdir(parents=True)
    default.write_bytes(STEP.read_bytes())
    argv = ["bench", bench, "--model", "tiny", "--trees"]
    assert main([*argv, str(default)]) == 2
    assert f"harts bench {bench}: output {default} is its input {default}" in capsys.readouterr().err
    default.unlink()
    with output_locks(f"harts bench {bench}", [default]):
        assert main([*argv, str(STEP)]) == 2
        assert f"{default} is being written by another harts process" in capsys.readouterr().err
    assert not default.exists()


def test_two_harts_train_on_one_run_folder(tmp_path):
    """The second `harts train --out R` is refused while the first runs; the log has one start."""
    run = tmp_path / "run"
    config = REPO / "tests/training/micro-trees.yaml"
    args = [sys.executable, "-m", "harts", "train", "--out", str(run), "--model", "tiny", "--trees", str(config),
            "--num-steps", "40", "--capacity", "1024", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    first = subprocess.Popen(args, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (run / "train.jsonl").exists() and time.time() < deadline:
        time.sleep(0.05)
    second = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert second.returncode == 2, second.stderr
    assert second.stderr.endswith(f"{run / 'train.jsonl'} is being written by another harts process (pid "
                                  f"{first.pid}); wait for it or choose another output\n"), second.stderr
    starts = [json.loads(line) for line in (run / "train.jsonl").read_text().splitlines() if '"start"' in line]
    assert len(starts) == 1


def test_harts_train_on_a_full_disk_names_its_log_and_resumes(tmp_path):
    """The append-only train.jsonl on a full disk: one line naming it; a resume drops the torn line and goes on."""
    run = tmp_path / "run"
    args = ["train", "--out", str(run), "--model", "tiny", "--trees", str(REPO / "tests/training/micro-trees.yaml"),
            "--num-steps", "60", "--capacity", "1024", "--no-progress", "--checkpoint-every", "1000"]
    failed = _harts_on_a_full_disk(30_000, *args, cwd=tmp_path)
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr[-2000:]
    assert failed.stderr.splitlines()[-1] == f"harts: error: {run / 'train.jsonl'}: could not write (File too large)"
    resumed = _harts_on_a_full_disk(1 << 40, "train", "--out", str(run), "--resume", "--no-progress", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "the torn last line of train.jsonl removed" in resumed.stderr
    records = [json.loads(line) for line in (run / "train.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "step"] == list(range(1, 61))
