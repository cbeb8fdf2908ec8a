import json

import pytest

from harts.args import non_finite_fields
from harts.cli.main import main

STEP = "data/samples/tiny-step.jsonl.gz"


def test_train_step_both_executions(capsys):
    rows = {}
    for execution in ("baseline", "compact"):
        assert main(["train-step", "--model", "tiny", "--trees", STEP, "--execution", execution,
                     "--capacity", "1024", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["semantic_tokens"] == 1971 and out["microbatches"] >= 1
        rows[execution] = out["rows"]
    assert rows["compact"] < rows["baseline"] == 1971


def test_verify_json(capsys):
    assert main(["verify", "--model", "tiny", "--trees", STEP, "--capacity", "1024", "--on-policy", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["semantic_tokens"] == 1971 and report["compact_tokens"] == 920
    assert report["max_abs_logprob_diff"] <= 1e-5 and report["grad_rel_diff"] <= 1e-4
    assert report["logit_cosine_min"] >= 0.99999


def test_bad_inputs(capsys, tmp_path):
    assert main(["train-step", "--model", "nope", "--trees", STEP, "--execution", "compact"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err
    assert main(["train-step", "--model", "tiny", "--trees", STEP, "--execution", "compact", "--capacity", "100"]) == 2
    assert "more than the capacity T = 100" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["verify"], ["train-step", "--execution", "compact"]], ids=["verify", "train-step"])
def test_non_finite_results_fail_with_the_cause(capsys, command):
    # old_logprobs of -1000 overflow the ratio exp(logprob - old_logprob): the loss is inf and its
    # differences NaN, which JSON cannot carry; this used to print NaN and exit 0.
    bad = "tests/data/bad_inputs/verify-old-logprobs-minus-1000.jsonl"
    assert main([*command, "--model", "tiny", "--trees", bad, "--capacity", "1024", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith("harts: error: ") and "not finite (loss = inf" in line
    assert "old_logprobs go down to -1000" in line


def test_non_finite_fields_found_in_nested_results():
    assert non_finite_fields({"a": 1.0, "b": {"c": float("nan"), "d": [0.5, float("-inf")]}, "e": "inf"}) == [
        "b.c = nan", "b.d.1 = -inf"]
