"""Numeric options of `harts plan`, `harts trees`, `harts bench`, `train-step` and `verify`
(harts/args.py) and the one-line usage errors of the `harts` parser (harts/cli/main.py)."""

import pytest

from tests.trees.helpers import cli_error

STEP = "data/samples/tiny-step.jsonl.gz"
PLAN = ["plan", "microbatches", STEP, "--capacity", "4096", "--dp", "2"]
ORTOOLS = [*PLAN, "--planner", "treetrain-ortools"]

# name: (argv, the command, the message); the stderr line is "harts: error: COMMAND: MESSAGE (see ...)"
BAD_OPTIONS = {
    "time-limit-nan": (
        [*ORTOOLS, "--time-limit", "nan"],
        "plan microbatches", "argument --time-limit: expected a finite number > 0, got 'nan'",
    ),
    "time-limit-inf": (
        [*ORTOOLS, "--time-limit", "inf"],
        "plan microbatches", "argument --time-limit: expected a finite number > 0, got 'inf'",
    ),
    "time-limit-zero": (
        [*ORTOOLS, "--time-limit", "0"],
        "plan microbatches", "argument --time-limit: expected a finite number > 0, got '0'",
    ),
    "time-limit-negative": (
        [*ORTOOLS, "--time-limit", "-3"],
        "plan microbatches", "argument --time-limit: expected a finite number > 0, got '-3'",
    ),
    "time-limit-text": (
        [*ORTOOLS, "--time-limit", "ten"],
        "plan microbatches", "argument --time-limit: expected a finite number > 0, got 'ten'",
    ),
    "capacity-zero": (
        ["plan", "microbatches", STEP, "--capacity", "0", "--dp", "2"],
        "plan microbatches", "argument --capacity: expected a positive integer below 2^62, got '0'",
    ),
    "capacity-negative": (
        ["plan", "microbatches", STEP, "--capacity", "-512", "--dp", "2"],
        "plan microbatches", "argument --capacity: expected a positive integer below 2^62, got '-512'",
    ),
    "dp-zero": (
        ["plan", "microbatches", STEP, "--capacity", "4096", "--dp", "0"],
        "plan microbatches", "argument --dp: expected a positive integer below 2^62, got '0'",
    ),
    "dp-fraction": (
        ["plan", "microbatches", STEP, "--capacity", "4096", "--dp", "1.5"],
        "plan microbatches", "argument --dp: expected a positive integer below 2^62, got '1.5'",
    ),
    "dp-missing": (
        ["plan", "microbatches", STEP, "--capacity", "4096"],
        "plan microbatches", "the following arguments are required: --dp",
    ),
    "vocab-size-zero": (
        ["trees", "validate", STEP, "--vocab-size", "0"],
        "trees validate", "argument --vocab-size: expected a positive integer below 2^62, got '0'",
    ),
    "vocab-size-negative": (
        ["trees", "stats", STEP, "--vocab-size", "-1"],
        "trees stats", "argument --vocab-size: expected a positive integer below 2^62, got '-1'",
    ),
    "seed-negative": (
        ["trees", "synth", "--config", "configs/trees/tiny.yaml", "--seed", "-1", "--out", "{tmp}/synth"],
        "trees synth", "argument --seed: expected a non-negative integer below 2^62, got '-1'",
    ),
    "bench-planning-time-limit-nan": (
        ["bench", "planning", "--trees", "configs/trees/tiny.yaml", "--time-limit", "nan", "--out", "{tmp}/p.json"],
        "bench planning", "argument --time-limit: expected a finite number > 0, got 'nan'",
    ),
    "bench-speedup-repeats-zero": (
        ["bench", "speedup", "--model", "tiny", "--trees", STEP, "--repeats", "0", "--out", "{tmp}/s.json"],
        "bench speedup", "argument --repeats: expected a positive integer below 2^62, got '0'",
    ),
    "bench-fidelity-capacity-negative": (
        ["bench", "fidelity", "--model", "tiny", "--trees", STEP, "--capacity", "-1", "--out", "{tmp}/f.json"],
        "bench fidelity", "argument --capacity: expected a positive integer below 2^62, got '-1'",
    ),
    "verify-capacity-zero": (
        ["verify", "--model", "tiny", "--trees", STEP, "--capacity", "0"],
        "verify", "argument --capacity: expected a positive integer below 2^62, got '0'",
    ),
    "train-step-seed-negative": (
        ["train-step", "--model", "tiny", "--trees", STEP, "--execution", "compact", "--seed", "-2"],
        "train-step", "argument --seed: expected a non-negative integer below 2^62, got '-2'",
    ),
    "train-step-kl-coef-negative": (
        ["train-step", "--model", "tiny", "--trees", STEP, "--execution", "compact", "--kl-coef", "-0.1"],
        "train-step", "argument --kl-coef: expected a finite number >= 0, got '-0.1'",
    ),
    "verify-kl-coef-inf": (
        ["verify", "--model", "tiny", "--trees", STEP, "--kl-coef", "inf"],
        "verify", "argument --kl-coef: expected a finite number >= 0, got 'inf'",
    ),
    "verify-clip-ratio-high-nan": (
        ["verify", "--model", "tiny", "--trees", STEP, "--clip-ratio-high", "nan"],
        "verify", "argument --clip-ratio-high: expected a finite number >= 0, got 'nan'",
    ),
    "verify-clip-ratio-low-text": (
        ["verify", "--model", "tiny", "--trees", STEP, "--clip-ratio-low", "low"],
        "verify", "argument --clip-ratio-low: expected a finite number >= 0, got 'low'",
    ),
    "train-step-dual-clip-inf": (
        ["train-step", "--model", "tiny", "--trees", STEP, "--execution", "compact", "--loss", "ppo",
         "--dual-clip-ratio", "inf"],
        "train-step", "argument --dual-clip-ratio: expected a finite number > 0, got 'inf'",
    ),
    "capacity-beyond-int64": (
        ["plan", "microbatches", STEP, "--capacity", "1" + "0" * 400, "--dp", "2"],
        "plan microbatches", "argument --capacity: expected a positive integer below 2^62, got '1" + "0" * 400 + "'",
    ),
    "bench-speedup-memory-margin-one": (
        ["bench", "speedup", "--model", "tiny", "--trees", STEP, "--memory-margin", "1", "--out", "{tmp}/s.json"],
        "bench speedup", "argument --memory-margin: expected a number >= 0 and < 1, got '1'",
    ),
    "bench-speedup-memory-margin-nan": (
        ["bench", "speedup", "--model", "tiny", "--trees", STEP, "--memory-margin", "nan", "--out", "{tmp}/s.json"],
        "bench speedup", "argument --memory-margin: expected a number >= 0 and < 1, got 'nan'",
    ),
    "train-memory-margin-negative": (
        ["train", "--model", "tiny", "--trees", "tiny", "--out", "{tmp}/run", "--memory-margin", "-0.05"],
        "train", "argument --memory-margin: expected a number >= 0 and < 1, got '-0.05'",
    ),
    "bench-speedup-recompute-blocks-word": (
        ["bench", "speedup", "--model", "tiny", "--trees", STEP, "--recompute-blocks", "most", "--out", "{tmp}/s.json"],
        "bench speedup", "argument --recompute-blocks: expected a non-negative integer below 2^62 or auto, got 'most'",
    ),
    "plan-kda-chunk-beyond-int64": (
        ["plan", "kda", STEP, "--chunk", "9" * 23],
        "plan kda", f"argument --chunk: expected a positive integer below 2^62, got '{'9' * 23}'",
    ),
    "plan-kda-chunk-zero": (
        ["plan", "kda", STEP, "--chunk", "0"],
        "plan kda", "argument --chunk: expected a positive integer below 2^62, got '0'",
    ),
    "unknown-option-of-a-command": (
        ["train-step", "--model", "tiny", "--trees", STEP, "--execution", "compact", "--memory-margin", "0.1"],
        "train-step", "unrecognized arguments: --memory-margin 0.1",
    ),
    "unknown-option-of-a-subcommand": (
        ["plan", "kda", STEP, "--chunk", "64", "--out", "{tmp}/k.json"],
        "plan kda", "unrecognized arguments: --out {tmp}/k.json",
    ),
    "rl-out-not-records": (
        ["rl", "--config", "tiny", "--out", "{tmp}/rl.txt"],
        "rl", "argument --out: expected a records file ending .json or .jsonl, got '{tmp}/rl.txt'",
    ),
    "bench-speedup-out-csv": (
        ["bench", "speedup", "--model", "tiny", "--trees", STEP, "--out", "{tmp}/s.csv"],
        "bench speedup", "argument --out: expected a records file ending .json or .jsonl, got '{tmp}/s.csv'",
    ),
    "no-command": ([], "", "the following arguments are required: COMMAND"),
}


@pytest.mark.parametrize("case", BAD_OPTIONS)
def test_bad_option_is_refused_in_one_line(case, tmp_path, capsys):
    argv, command, message = BAD_OPTIONS[case]
    out = tmp_path / "plan.json"
    with_out = argv[:2] == ["plan", "microbatches"]
    argv = [arg.format(tmp=tmp_path) for arg in argv] + (["--out", str(out)] if with_out else [])
    prefix, prog = (f"{command}: ", f"harts {command}") if command else ("", "harts")
    message = message.format(tmp=tmp_path)
    assert cli_error(argv, capsys) == f"harts: error: {prefix}{message} (see '{prog} --help')"
    assert not out.exists() and not (tmp_path / "synth").exists()
    assert not any(tmp_path.glob("?.json"))


def test_an_error_line_is_one_write(monkeypatch):
    """Ranks under torchrun share stderr: each error line goes out in one write (print's two writes let another
    rank's line land inside it; CI, stop 29)."""
    import io
    import sys

    from harts.args import print_error

    writes = []

    class Recording(io.StringIO):
        def write(self, text):
            writes.append(text)
            return len(text)

    monkeypatch.setattr(sys, "stderr", Recording())
    print_error("parallel config 'dp2-tp2-sp' needs 4 ranks")
    assert writes == ["harts: error: parallel config 'dp2-tp2-sp' needs 4 ranks\n"]
