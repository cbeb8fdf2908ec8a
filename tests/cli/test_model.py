"""`harts model`: the parameter counts of a shipped config, of a YAML path and of a Hugging Face checkpoint's
config.json; a bad name is a one-line error with exit status 2."""

import json

from harts.cli.main import main
from harts.model.config import load_model_config
from harts.model.counts import parameter_counts
from harts.model.hf import hf_config_from_model


def test_prints_the_counts(capsys):
    assert main(["model", "--model", "ling3-tiny", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    counts = parameter_counts(load_model_config("ling3-tiny"))
    assert summary == {"model": "ling3-tiny", "hf_layout": "bailing_hybrid", "total": counts.total,
                       "active": counts.active, "active_non_embedding": counts.active_non_embedding,
                       "embedding": counts.embedding, "head": counts.head}
    assert main(["model", "--model", "ling3-tiny"]) == 0
    assert "7,893,389,856 parameters (7.89B), 1,381,732,896 active per token (1.38B" in capsys.readouterr().out


def test_reads_a_checkpoint_config(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_model(load_model_config("bailing-tiny"))))
    assert main(["model", "--hf", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total"] == parameter_counts(load_model_config("bailing-tiny")).total


def test_unknown_model_is_a_one_line_error(capsys):
    assert main(["model", "--model", "nope"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("harts: error: unknown model 'nope'") and error.count("\n") == 1
