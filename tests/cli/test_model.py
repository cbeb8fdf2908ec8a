"""`harts model`: the parameter counts of a shipped config (with and without its MTP layers), of a YAML path and of a
Hugging Face checkpoint's config.json; a bad name is a one-line error with exit status 2."""

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
                       "embedding": counts.embedding, "head": counts.head, "mtp": 0, "mtp_active": 0}
    assert main(["model", "--model", "ling3-tiny"]) == 0
    printed = capsys.readouterr().out
    assert "7,893,389,856 parameters (7.89B), 1,381,732,896 active per token (1.38B" in printed
    assert "MTP" not in printed


def test_prints_the_counts_with_and_without_the_mtp_layers(capsys):
    """ling3-tiny-mtp: the counts with its MTP layer, then without it (the card's convention): ling3-tiny's."""
    assert main(["model", "--model", "ling3-tiny-mtp"]) == 0
    first, second = capsys.readouterr().out.strip().splitlines()
    assert "8,209,994,528 parameters (8.21B), 1,415,222,048 active per token (1.42B" in first
    assert second == ("without its 1 MTP layer (316,604,672 parameters, 33,489,152 active), as model cards count: "
                      "7,893,389,856 parameters (7.89B), 1,381,732,896 active per token (1.38B)")
    assert main(["model", "--model", "ling3-tiny-mtp", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["total"] - summary["mtp"], summary["mtp_active"]) == (7_893_389_856, 33_489_152)


def test_reads_a_checkpoint_config(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_model(load_model_config("bailing-tiny"))))
    assert main(["model", "--hf", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total"] == parameter_counts(load_model_config("bailing-tiny")).total


def test_unknown_model_is_a_one_line_error(capsys):
    assert main(["model", "--model", "nope"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("harts: error: unknown model 'nope'") and error.count("\n") == 1
