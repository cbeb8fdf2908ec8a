"""harts.workflow.devices: jobs of a local multi-GPU pipeline get disjoint devices, wait while none are free,
get them back from a holder that ended (also a killed one), and see them as CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from harts.workflow import devices
from harts.workflow.devices import main, pool, take

POOLS = {
    "count": ({}, 3, ["0", "1", "2"]),
    "visible-devices": ({"CUDA_VISIBLE_DEVICES": "4,5, 6,7"}, 3, ["4", "5", "6"]),
}


@pytest.mark.parametrize("case", list(POOLS), ids=list(POOLS))
def test_pool(case):
    environ, size, expected = POOLS[case]
    assert pool(size, environ) == expected


def test_pool_larger_than_the_visible_devices():
    with pytest.raises(ValueError, match="gpu=3: CUDA_VISIBLE_DEVICES lists only 2 devices"):
        pool(3, {"CUDA_VISIBLE_DEVICES": "0,1"})


def test_holders_get_disjoint_devices_and_the_lowest_free(tmp_path):
    ids = ["0", "1", "2", "3"]
    with take(2, ids, tmp_path) as first, take(1, ids, tmp_path) as second:
        assert (first, second) == (["0", "1"], ["2"])
        with take(1, ids, tmp_path) as third:
            assert third == ["3"]
    with take(4, ids, tmp_path) as everything:
        assert everything == ids, "all devices were given back"


def test_a_holder_waits_until_a_device_is_free(tmp_path, capsys):
    ids = ["0", "1"]
    released = []

    def hold():
        with take(2, ids, tmp_path):
            holding.set()
            time.sleep(0.5)
            released.append(time.monotonic())

    holding = threading.Event()
    thread = threading.Thread(target=hold)
    thread.start()
    holding.wait()
    with take(1, ids, tmp_path, poll_s=0.05) as got:
        taken = time.monotonic()
    thread.join()
    assert got == ["0"] and taken >= released[0]
    assert "waiting for 1 free GPUs of 0,1" in capsys.readouterr().err


def test_a_waiting_job_holds_no_device(tmp_path):
    """A job waiting for 2 of devices 0 and 1 while 1 is taken must not sit on 0: two pipelines on one host
    that each held part of what the other waits for would wait forever."""
    ids = ["0", "1"]
    release_one = threading.Event()
    got: dict[str, list[str]] = {}

    def hold_one():
        with take(1, ["1"], tmp_path):
            one_held.set()
            release_one.wait()

    def wait_for_two():
        with take(2, ids, tmp_path, poll_s=0.02) as devices:
            got["two"] = devices

    def take_zero():
        with take(1, ["0"], tmp_path, poll_s=0.02) as devices:
            got["zero"] = devices

    one_held = threading.Event()
    holder = threading.Thread(target=hold_one)
    holder.start()
    one_held.wait()
    waiter = threading.Thread(target=wait_for_two, daemon=True)
    waiter.start()
    time.sleep(0.2)
    other = threading.Thread(target=take_zero, daemon=True)
    other.start()
    other.join(timeout=5)
    assert got.get("zero") == ["0"], "the waiting job kept device 0"
    release_one.set()
    holder.join()
    waiter.join(timeout=5)
    assert got.get("two") == ids


def test_a_killed_holder_leaves_no_stale_claim(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from harts.workflow.devices import take\n"
                               f"with take(1, ['0'], Path({str(tmp_path)!r})):\n"
                               "    print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait()
    with take(1, ["0"], tmp_path, poll_s=60) as got:  # a stale claim would wait a minute
        assert got == ["0"]


def test_the_command_sees_its_devices_and_its_status_is_returned(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("HARTS_DEVICE_LOCKS", str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,5")
    script = "import os, sys; print('child sees', os.environ['CUDA_VISIBLE_DEVICES']); sys.exit(3)"
    with take(1, ["2", "3", "5"], tmp_path):  # another job holds device 2
        code = main(["--take", "2", "--pool", "3", "--", sys.executable, "-c", script])
    out, err = capfd.readouterr()
    assert code == 3 and "child sees 3,5" in out and "CUDA_VISIBLE_DEVICES=3,5" in err


@pytest.mark.parametrize("take_, pool_", [(0, 4), (2, 0)], ids=["cpu-job", "no-pool"])
def test_no_assignment_runs_the_command_unchanged(take_, pool_, monkeypatch, capfd):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    monkeypatch.setattr(devices, "take", None)  # taking a device would fail
    script = "import os; print('child sees', os.environ['CUDA_VISIBLE_DEVICES'])"
    assert main(["--take", str(take_), "--pool", str(pool_), "--", sys.executable, "-c", script]) == 0
    assert "child sees 7" in capfd.readouterr().out


def test_more_devices_than_the_pool_is_an_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HARTS_DEVICE_LOCKS", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert main(["--take", "4", "--pool", "2", "--", "true"]) == 2
    assert capsys.readouterr().err == "harts: error: a job asks for 4 GPUs, the pool holds 2 (0,1)\n"


def test_a_signal_to_the_wrapper_reaches_the_command(tmp_path):
    """Snakemake stops a job with SIGTERM to the wrapper: the command gets it (and ends while its devices are
    still held), and the wrapper returns the command's status."""
    child = ("import signal, sys, time\n"
             "signal.signal(signal.SIGTERM, lambda *a: (print('command got SIGTERM', flush=True), sys.exit(3)))\n"
             "print('ready', flush=True)\n"
             "time.sleep(30)\n")
    wrapper = subprocess.Popen(
        [sys.executable, "-m", "harts.workflow.devices", "--take", "1", "--pool", "1", "--", sys.executable, "-c",
         child],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "HARTS_DEVICE_LOCKS": str(tmp_path)})
    assert wrapper.stdout.readline() == "ready\n"
    wrapper.terminate()
    out, _ = wrapper.communicate(timeout=20)
    assert wrapper.returncode == 3 and "command got SIGTERM" in out


@pytest.mark.parametrize("case", ["open-to-others", "a-link", "other-owner"])
def test_a_lock_folder_others_could_control_is_refused(tmp_path, case, monkeypatch):
    folder = tmp_path / "locks"
    if case == "open-to-others":
        folder.mkdir()
        folder.chmod(0o777)
        message = r"can be written by others \(mode 777\)"
    elif case == "a-link":
        (tmp_path / "elsewhere").mkdir()
        folder.symlink_to(tmp_path / "elsewhere")
        message = "is not a folder"
    else:
        folder.mkdir(mode=0o700)
        monkeypatch.setattr(devices.os, "getuid", lambda: os.stat(folder).st_uid + 1)
        message = "belongs to uid"
    with pytest.raises(ValueError, match=message):
        with devices.take(1, ["0"], folder):
            pass


def test_a_new_lock_folder_is_private(tmp_path):
    folder = tmp_path / "locks"
    with devices.take(1, ["0", "1"], folder) as held:
        assert held == ["0"]
    assert folder.stat().st_mode & 0o777 == 0o700
