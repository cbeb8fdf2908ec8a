"""The headline figures `--json` prints of results and of error rows, and the printed table's lines naming the
records whose baseline is an earlier case's (harts.bench.speedup.records)."""

from harts.bench.speedup.records import HEADLINE_KEYS, headline


def _record(results=None, error=None, parallel="dp2"):
    record = {"config": {"step": 3, "model": "tiny", "parallel": parallel}}
    if error is not None:
        record["error"] = error
    else:
        record["results"] = results
    return record


def test_headline_of_results_and_error_rows():
    results = {key: float(i + 1) for i, key in enumerate(HEADLINE_KEYS)}
    assert headline(_record(results)) == {"step": 3, "model": "tiny", "parallel": "dp2", **results}
    row = headline(_record(error="ValueError: boom"))
    assert row == {"step": 3, "model": "tiny", "parallel": "dp2", **dict.fromkeys(HEADLINE_KEYS),
                   "error": "ValueError: boom"}


def test_the_table_names_the_reused_baselines():
    from harts.bench.speedup.records import format_table

    execution = {"fbg_s": 2.0, "planning_s": 0.0}
    results = {"semantic_tokens": 10, "compact_tokens": 5, "compression": 2.0, "fbg_speedup": 1.5,
               "core_speedup": 1.5, "efficiency": 0.75, "baseline": execution, "compact": execution,
               "timing_flags": []}
    records = [{"config": {"step": 0, "parallel": "single", "variant": variant},
                "results": {**results, "baseline_reused_from": source}}
               for variant, source in ((None, None), ("compact-attention-backend=naive", "the run's own"),
                                       ("capacity=8", None), ("capacity=8,compact-recompute-blocks=2", "capacity=8"))]
    lines = [line for line in format_table(records).splitlines() if line.startswith("baseline reused")]
    assert lines == [
        "baseline reused: step 0, single, --variant compact-attention-backend=naive: the baseline of the run's own, "
        "not measured again",
        "baseline reused: step 0, single, --variant capacity=8,compact-recompute-blocks=2: the baseline of --variant "
        "capacity=8, not measured again"]
