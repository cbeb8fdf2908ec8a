import json

import pytest

from harts.cli.main import main
from harts.trees.stats import STATS_KEYS, step_stats

from .helpers import make_step


def test_hand_built_stats():
    step = make_step([[1, 2], [1, 3], [1, 2, 4], [1, 2, 5], [9, 9, 9, 9]], trees=["a", "a", "a", "b", "c"])
    stats = step_stats(step)
    assert tuple(stats) == STATS_KEYS
    assert stats["trajectories"] == 5 and stats["trees"] == 3
    assert stats["semantic_tokens"] == 14 and stats["compact_tokens"] == 9
    assert stats["compression"] == pytest.approx(14 / 9)
    assert stats["segments"] == 6 and stats["forks"] == 2
    assert stats["max_fork_depth"] == 2
    assert stats["length_percentiles"] == {"p0": 2, "p50": 3, "p90": 4, "p99": 4, "p100": 4}


def test_cli_json_has_exactly_the_keys(tmp_path, capsys):
    out = tmp_path / "steps"
    assert main(["trees", "synth", "--config", "configs/trees/tiny.yaml", "--seed", "1", "--steps", "1", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["step_001.npz", "synth.json"]
    capsys.readouterr()
    assert main(["trees", "stats", "--json", str(out / "step_001.npz")]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert tuple(stats) == STATS_KEYS
    assert stats["semantic_tokens"] > stats["compact_tokens"] > 0


def test_cli_errors(tmp_path, capsys):
    assert main(["trees", "synth", "--config", "configs/trees/tiny.yaml", "--steps", "5", "--out", str(tmp_path)]) == 2
    assert "step 5 is beyond num_steps = 2" in capsys.readouterr().err
    assert main(["trees", "stats", str(tmp_path / "nothing.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_steps: 1\nmystery: 3\n")
    assert main(["trees", "synth", "--config", str(bad), "--out", str(tmp_path)]) == 2
    assert "unknown key 'mystery'" in capsys.readouterr().err
