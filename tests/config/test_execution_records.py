"""Records and JSON outputs written through the one execution config have the fields and values they had before it
(tests/data/records/*.json: written at 4782eda, before harts.config.execution existed, by `harts bench speedup`,
`harts train-step --json` and `harts verify --json` on the tiny model and the sample step): the same config, the
same result fields, the same sizes, and the same losses and differences within float noise. Timings are compared
as fields only; the differences between two executions (verify's `*_diff`, the logit cosines) are float noise
that depends on the CPU's kernels, compared within an absolute 1e-5 (a wrong execution puts them near 1e-2).
Added to the bench record since, on purpose (issue 44's memory margin): `config.memory_margin` (0.05, the default)
and `results.device_memory_bytes` (null on the CPU); the model config's `mtp` (null: no MTP layers);
`config.mtp_loss_scaling_factor` (null: the model's); `config.gdn_kernel` ("gdn", the default: the kernel of a Gated
DeltaNet baseline, none here); `results.baseline_reused_from` (null: the run's own case measured its baseline). Changed on purpose: `results.flops_compression` 2.10496 ->
2.10556, the model FLOPs recounted (harts.model.flops: the chunked KDA's products as the kernel forms them and the
short convs, docs/flops.md);
the model config's `moe.balance_statistics` (false: the pooled load-balancing reading's statistics off). Added to
train-step's and verify's `loss_config`, on purpose: `pooled_balance_coeff` (0.0, the default: no pooled
load-balancing loss)."""

import json
import math
from pathlib import Path

import pytest

from harts.cli.main import main
from tests.fixtures import one_thread  # noqa: F401

GOLDEN = Path(__file__).parents[1] / "data" / "records"
STEP = "data/samples/tiny-step.jsonl.gz"
TIMINGS = {"plan_seconds", "seconds"}
NOISE = {"grad_rel_diff", "loss_rel_diff", "max_abs_logprob_diff", "moe_loss_abs_diff",
         "tokens_per_expert_max_abs_diff", "logit_cosine_mean", "logit_cosine_min"}


def _fields(value):
    return {k: _fields(v) for k, v in value.items()} if isinstance(value, dict) else None


def _same(got, expected, where=""):
    if isinstance(expected, dict):
        assert set(got) == set(expected), f"{where}: fields {sorted(set(got) ^ set(expected))}"
        for key in expected:
            if key in NOISE:
                assert abs(got[key] - expected[key]) <= 1e-5, f"{where}.{key}: {got[key]} != {expected[key]}"
            elif key not in TIMINGS:
                _same(got[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, float) and not isinstance(got, bool):
        assert math.isclose(got, expected, rel_tol=1e-5, abs_tol=1e-9), f"{where}: {got} != {expected}"
    else:
        assert got == expected, f"{where}: {got!r} != {expected!r}"


@pytest.mark.parametrize("command", ["train-step", "verify"])
def test_train_step_and_verify_print_what_they_printed(command, capsys):
    extra = ["--execution", "compact"] if command == "train-step" else []
    assert main([command, "--model", "tiny", "--trees", STEP, *extra, "--capacity", "1024", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    _same(got, json.loads((GOLDEN / "train-step-tiny.json").read_text())[command], command)


def test_bench_speedup_writes_the_record_it_wrote(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = tmp_path / "speedup.json"
    assert main(["bench", "speedup", "--model", "tiny", "--trees", STEP, "--capacity", "1024", "--repeats", "1",
                 "--no-breakdown", "--out", str(out)]) == 0
    (record,) = json.loads(out.read_text())
    golden = json.loads((GOLDEN / "bench-speedup-tiny.json").read_text())
    _same(record["config"], golden["config"], "config")
    assert _fields(record["results"]) == golden["results_fields"]
    _same({key: record["results"][key] for key in golden["results"]}, golden["results"], "results")
