"""harts.report.fidelity: the long-form rows of single-process and --parallel records, and the PDF."""

from __future__ import annotations

import csv

import pytest

from harts.report.fidelity import FIDELITY_COLUMNS, UNDEFINED, fidelity_rows, write_fidelity_report
from harts.report.records import ERROR

from .helpers import fidelity_record, pdf_text, write


def _value(rows, **match):
    found = [r["value"] for r in rows if all(r[k] == v for k, v in match.items())]
    assert len(found) == 1, (match, found)
    return found[0]


def test_single_process_rows():
    rows = fidelity_rows([fidelity_record()])
    assert _value(rows, source="ours", section="ablation", depth="2", path="no-replay",
                  metric="symkl_excess_over_rerun") == pytest.approx(0.4)
    assert _value(rows, source="ours", section="ablation", depth="2", path="no-replay",
                  metric="symkl_excess_over_split_rerun") == pytest.approx(-0.3)
    assert _value(rows, source="ours", section="ablation", depth="0", path="split-rerun", metric="abs_dnll") == 0.02
    assert _value(rows, source="ours", section="ablation", depth="1", path="", metric="positions") == 101
    assert _value(rows, source="ours", section="logits", path="replay", metric="cosine_min") == 0.9998
    assert _value(rows, source="ours", section="loss", path="compact", recompute="yes", metric="grad_cosine") == 0.99998
    assert _value(rows, source="ours", section="block_distance", depth="2", path="no-replay",
                  metric="layer 1 mla") == pytest.approx(2e-3)
    assert _value(rows, source="ours", section="block_distance", depth="0", path="replay", metric="layer 0 kda") == 0.0
    assert _value(rows, source="paper", metric="symkl_excess_over_rerun") == "0.324-0.361"
    assert _value(rows, source="paper", metric="abs_dloss") == "< 1e-08"
    assert all(set(r) == set(FIDELITY_COLUMNS) for r in rows)


def test_zero_rerun_noise_makes_the_excess_undefined():
    rows = fidelity_rows([fidelity_record(rerun_zero=True)])
    assert _value(rows, source="ours", depth="0", path="replay", metric="symkl_excess_over_rerun") == UNDEFINED
    assert _value(rows, source="ours", depth="1", path="no-replay", metric="abs_dnll_excess_over_split_rerun") == UNDEFINED


def test_parallel_and_error_records():
    rows = fidelity_rows([fidelity_record(parallel="dp2"), fidelity_record(parallel="tp2", error="ValueError: heads")])
    assert _value(rows, parallel="dp2", section="loss", path="compact", recompute="no", metric="grad_rel_diff") == 1e-4
    assert _value(rows, parallel="dp2", section="logits", path="baseline", recompute="yes",
                  metric="cosine_mean") == 0.99999
    assert _value(rows, parallel="tp2", section=ERROR) == "ValueError: heads"
    assert not [r for r in rows if r["parallel"] in ("dp2", "tp2") and r["section"] == "ablation"]


def test_report_files(tmp_path):
    single = write(tmp_path, "single.json", [fidelity_record(rerun_zero=True)])
    dp2 = write(tmp_path, "dp2.json", [fidelity_record(parallel="dp2")])
    pdf, table = tmp_path / "fidelity.pdf", tmp_path / "fidelity.csv"
    rows = write_fidelity_report([single, dp2], pdf, table)
    with open(table, newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        assert reader.fieldnames == FIDELITY_COLUMNS and len(list(reader)) == len(rows)
    pages, text = pdf_text(pdf)
    assert pages == 5  # ablation, logit fidelity, three tables
    for expected in ("Replay ablation by handoff depth", "undefined at depth 0, 1, 2", "Logit fidelity per configuration",
                     "Where a path departs from the baseline", "layer 1 mla",
                     "compact execution on the ranks", "+32.4-36.1%", "> 0.9997"):
        assert expected in text, expected
