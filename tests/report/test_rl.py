"""harts.report.rl: CSV rows from `harts rl` records, the reward summary (smoothed mean, seed band,
band overlap of the two executions) and the PDF (parsed back with pypdf)."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from harts.report.rl import RL_COLUMNS, checkpoints, reward_summary, rl_rows, smooth, write_rl_report
from harts.tracking.records import make_record

from .helpers import pdf_text, write

NUM_STEPS = 8


def rl_record(execution: str, seed: int, rewards, *, train_s: float = 0.5, name: str = "tiny",
              error: str | None = None, device: str = "cpu", num_steps: int = NUM_STEPS) -> dict:
    """A `harts rl` record of one (seed, execution): step t has reward rewards[t]; the last step has no update."""
    config = {"rl": {"model": "tiny", "device": device, "dtype": "fp32", "rollout": {"tasks_per_step": 2},
                     "num_steps": num_steps, "seeds": [0, 1]},
              "name": name, "seed": seed, "execution": execution, "timing": "sampling outside the step"}
    if error:
        return make_record("rl", config, error=error)
    update = len(rewards) - 1
    steps = [{"step": t, "update": t < update, "reward": float(r), "reward_all": float(r), "tool_calls": 1.5,
              "loss": 0.1 * t, "policy_loss": 0.1 * t, "moe_loss": 0.0, "kl": None if t == 0 else 0.01 * t,
              "grad_norm": 1.0 if t < update else None, "trajectories": 6, "retries": 2, "semantic_tokens": 300,
              "compact_tokens": 100, "compression": 3.0, "rows": 100 if execution == "compact" else 300,
              "seconds": {"train": train_s, "plan": 0.01, "layout": 0.02, "forward": 0.2, "backward": 0.25,
                          "optimizer": train_s - 0.48, "sample": 0.7, "reference": 0.1}}
             for t, r in enumerate(rewards)]
    return make_record("rl", config, {"warm_start": {"steps": 2}, "steps": steps, "summary": {}})


def constant(value: float) -> list[float]:
    return [value] * (NUM_STEPS + 1)


def test_rows_one_per_execution_seed_and_step():
    records = [rl_record("compact", 0, constant(0.25)), rl_record("baseline", 0, constant(0.5), train_s=1.5),
               rl_record("baseline", 1, [], error="ValueError: seed 1, baseline, step 3: the loss is nan")]
    rows = rl_rows(records)
    assert len(rows) == 2 * (NUM_STEPS + 1) + 1 and all(set(r) <= set(RL_COLUMNS) for r in rows)
    assert [(r["execution"], r["seed"], r["step"]) for r in rows[:2]] == [("compact", 0, 0), ("compact", 0, 1)]
    assert rows[NUM_STEPS + 1]["train_seconds"] == 1.5 and rows[NUM_STEPS + 1]["sample_seconds"] == 0.7
    assert rows[-1] == {"name": "tiny", "model": "tiny", "execution": "baseline", "seed": 1,
                        "error": "ValueError: seed 1, baseline, step 3: the loss is nan"}


def test_rows_carry_the_pooled_balance_loss():
    """With `loss.pooled_balance_coeff` > 0 the steps carry `pooled_balance_loss`; the CSV keeps it (empty without)."""
    record = rl_record("compact", 0, constant(0.25))
    for t, step in enumerate(record["results"]["steps"]):
        step["pooled_balance_loss"] = 1.0 + t
    rows = rl_rows([record, rl_record("baseline", 0, constant(0.25))])
    assert [r["pooled_balance_loss"] for r in rows[:NUM_STEPS + 1]] == [1.0 + t for t in range(NUM_STEPS + 1)]
    assert all("pooled_balance_loss" not in r for r in rows[NUM_STEPS + 1:])


def test_smoothing_and_checkpoints():
    assert smooth(np.array([0.0, 0, 0, 9, 0, 0, 0]), window=3).tolist() == [0, 0, 3, 3, 3, 0, 0]
    # The window shrinks at the ends: the first value averages itself and its right neighbour.
    assert smooth(np.array([[2.0, 4.0, 6.0]]), window=3).tolist() == [[3.0, 4.0, 5.0]]
    assert checkpoints(120) == [0, 30, 60, 120] and checkpoints(8) == [0, 2, 4, 8]


@pytest.mark.parametrize("baseline, overlap", [((0.3, 0.5), 1.0), ((0.6, 0.7), 0.0)], ids=["overlapping", "apart"])
def test_reward_summary(baseline, overlap):
    records = [rl_record("compact", 0, constant(0.2)), rl_record("compact", 1, constant(0.4)),
               rl_record("baseline", 0, constant(baseline[0])), rl_record("baseline", 1, constant(baseline[1]))]
    summary = reward_summary(records)
    compact = summary["executions"]["compact"]
    assert compact["seeds"] == 2 and compact["steps"] == [0, 2, 4, 8]
    assert compact["smoothed"] == pytest.approx([0.3] * 4) and compact["raw"] == pytest.approx([0.3] * 4)
    assert compact["low"] == pytest.approx([0.2] * 4) and compact["high"] == pytest.approx([0.4] * 4)
    assert summary["executions"]["baseline"]["smoothed"] == pytest.approx([sum(baseline) / 2] * 4)
    assert summary["band_overlap"] == overlap


def test_band_overlap_counts_steps():
    """A rising baseline crosses the compact band [0.29, 0.36]: smoothed over 9 steps (4 on each side,
    fewer at the ends) 0, 0.1, ..., 0.8 becomes 0.2, 0.25, ..., 0.6, inside the band at steps 2 and 3."""
    rising = np.linspace(0.0, 0.8, NUM_STEPS + 1)
    assert smooth(rising) == pytest.approx(np.linspace(0.2, 0.6, NUM_STEPS + 1))
    records = [rl_record("compact", 0, constant(0.29)), rl_record("compact", 1, constant(0.36)),
               rl_record("baseline", 0, rising), rl_record("baseline", 1, rising)]
    assert reward_summary(records)["band_overlap"] == pytest.approx(2 / (NUM_STEPS + 1))


def test_report_files(tmp_path):
    rising = np.linspace(0.2, 0.6, NUM_STEPS + 1)
    records = [rl_record("compact", 0, rising), rl_record("compact", 1, rising + 0.05),
               rl_record("baseline", 0, rising + 0.02, train_s=1.5), rl_record("baseline", 1, rising, train_s=1.5),
               rl_record("baseline", 2, [], error="ValueError: seed 2, baseline, step 3: the loss is nan")]
    paths = [write(tmp_path, "seed_000.json", records[::2]), write(tmp_path, "seed_001.json", records[1::2])]
    pdf, table = tmp_path / "rl.pdf", tmp_path / "rl.csv"
    rows = write_rl_report(paths, pdf, table)
    with open(table, newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        assert reader.fieldnames == RL_COLUMNS and len(list(reader)) == len(rows) == 4 * (NUM_STEPS + 1) + 1
    pages, text = pdf_text(pdf)
    text = " ".join(text.split())
    assert pages == 3  # reward curves, details, table
    for expected in ("Paper (§5.3, τ³-Bench, first 120 steps)", "similar trend and spread",
                     "HARTS (compact) (2 seeds)", "baseline (per-trajectory) (2 seeds)", "step 8:",
                     "Seed bands overlap at 100% of the steps", "baseline / compact: 3.00x",
                     "sampling outside it", "1 run(s) failed: seed 2 baseline: ValueError", "S/C of the step's trees",
                     "KL to the initial policy"):
        assert expected in text, expected


def test_records_of_two_configs_are_refused(tmp_path):
    path = write(tmp_path, "mixed.json", [rl_record("compact", 0, constant(0.2)),
                                          rl_record("compact", 0, constant(0.2), name="cpu")])
    with pytest.raises(ValueError, match=r"records are of several RL configs \(cpu, tiny\)"):
        write_rl_report([path], tmp_path / "rl.pdf", tmp_path / "rl.csv")


@pytest.mark.parametrize("second, message", [
    (lambda: rl_record("baseline", 1, constant(0.2)[:5], num_steps=4), r"seed 1 \(baseline\) was run with other settings than seed 0: "
                                                          r"rl\.num_steps"),
    (lambda: rl_record("compact", 1, constant(0.2), device="cuda"), r"other settings than seed 0: rl\.device"),
    (lambda: rl_record("compact", 0, constant(0.3)), r"seed 0 \(compact\) appears twice"),
], ids=["fewer-steps", "other-device", "duplicate"])
def test_records_of_other_runs_are_refused(tmp_path, second, message):
    """A --num-steps or --device override keeps the config's name: such records would be averaged with
    the others (the curves cut to the shortest run) without a word."""
    path = write(tmp_path, "mixed.json", [rl_record("compact", 0, constant(0.2)), second()])
    with pytest.raises(ValueError, match=message):
        write_rl_report([path], tmp_path / "rl.pdf", tmp_path / "rl.csv")
