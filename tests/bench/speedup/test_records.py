"""The headline figures `--json` prints of results and of error rows (harts.bench.speedup.records)."""

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
