"""harts.report.fidelity: the long-form rows of single-process and --parallel records, and the PDF."""

from __future__ import annotations

import csv

import pytest

from harts.report.fidelity import FIDELITY_COLUMNS, UNDEFINED, ablation_table, fidelity_rows, write_fidelity_report
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
    assert _value(rows, source="ours", section="ablation", depth="2", path="", metric="target_positions") == 92
    assert _value(rows, source="ours", section="logits", path="replay", metric="cosine_min") == 0.9998
    assert _value(rows, source="ours", section="loss", path="compact", recompute="yes", metric="grad_cosine") == 0.99998
    assert _value(rows, source="ours", section="block_distance", depth="2", path="no-replay",
                  metric="layer 1 mla") == pytest.approx(2e-3)
    assert _value(rows, source="ours", section="block_distance", depth="0", path="replay", metric="layer 0 kda") == 0.0
    assert _value(rows, source="paper", path="no-replay", metric="symkl_excess_over_rerun") == "0.324-0.361"
    assert _value(rows, source="paper", metric="abs_dloss") == "< 1e-08"
    assert all(set(r) == set(FIDELITY_COLUMNS) for r in rows)


def test_zero_rerun_noise_makes_the_excess_undefined():
    rows = fidelity_rows([fidelity_record(rerun_zero=True)])
    assert _value(rows, source="ours", depth="0", path="replay", metric="symkl_excess_over_rerun") == UNDEFINED
    assert _value(rows, source="ours", depth="1", path="no-replay", metric="abs_dnll_excess_over_split_rerun") == UNDEFINED


@pytest.mark.parametrize("depths, zero_depths", [
    pytest.param(3, ["3", "4", "5"], id="shallow"),
    pytest.param(5, ["5"], id="depth-4"),
    pytest.param(6, [], id="depth-5"),
    pytest.param(8, [], id="beyond"),
])
def test_every_depth_to_the_papers_has_its_positions(depths, zero_depths):
    """Each depth the record bins, with its positions and target positions; the paper's depths 4 and 5 that
    it does not reach, with 0; nothing else."""
    rows = fidelity_rows([fidelity_record(depths=depths)])
    ours = [r for r in rows if r["source"] == "ours" and r["section"] == "ablation"]
    for metric, count in (("positions", 100), ("target_positions", 90)):
        found = {r["depth"]: r["value"] for r in ours if r["metric"] == metric}
        assert len(found) == len([r for r in ours if r["metric"] == metric]), "a depth twice"
        assert found == {**{str(d): count + d for d in range(depths)}, **{d: 0 for d in zero_depths}}
    assert {r["depth"] for r in ours if r["path"]} == {str(d) for d in range(depths)}


def test_the_papers_band_rows():
    rows = fidelity_rows([fidelity_record()])
    band = [r for r in rows if r["source"] == "paper" and r["section"] == "ablation"]
    assert {r["depth"] for r in band} == {"4-5"}
    paper = {(r["path"], r["metric"]): r["value"] for r in band}
    assert paper == {
        ("replay", "symkl_excess_over_rerun"): "at the noise floor",
        ("replay", "abs_dnll_excess_over_rerun"): "at the noise floor",
        ("no-replay", "symkl_excess_over_rerun"): "0.324-0.361",
        ("no-replay", "abs_dnll_excess_over_rerun"): "0.170-0.187",
    }


def test_ablation_table_puts_the_papers_band_after_each_record():
    """Each record's depths up to 5 ("not reached" beyond its largest), then the paper's row with the floor
    it is measured over named."""
    rows = fidelity_rows([fidelity_record(depths=3), fidelity_record(depths=7, model="small", rerun_zero=True)])
    header, table = ablation_table(rows)
    column = {name: header.index(name) for name in ("source", "model", "handoff depth", "positions")}
    listed = [(row[column["source"]], row[column["model"]], row[column["handoff depth"]], row[column["positions"]])
              for row in table]
    paper = ("paper", "Ling-3.0-tiny", "4-5", "-")
    assert listed == [
        ("ours", "tiny", "0", "100"), ("ours", "tiny", "1", "101"), ("ours", "tiny", "2", "102"),
        ("ours", "tiny", "3", "0 (not reached)"), ("ours", "tiny", "4", "0 (not reached)"),
        ("ours", "tiny", "5", "0 (not reached)"), paper,
        *[("ours", "small", str(d), str(100 + d)) for d in range(7)], paper,
    ]
    paper_row = table[6]
    excess = [i for i, name in enumerate(header) if name == "no-replay excess"]
    assert [paper_row[i] for i in excess] == ["+32.4-36.1% (rerun)", "+17.0-18.7% (rerun)"]
    replay = [i for i, name in enumerate(header) if name == "replay excess"]
    assert [paper_row[i] for i in replay] == ["at the noise floor (rerun)"] * 2
    # Ours over both floors: the rerun's, then the split rerun's (+20% and -40% at depth 1).
    assert table[1][excess[0]] == "+20.0% / -40.0%"
    assert table[8][excess[0]] == "undef.* / undef.*"


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
                     "compact execution on the ranks", "+32.4-36.1%", "> 0.9997", "0 (not reached)",
                     "replay stays at the noise floor"):
        assert expected in text, expected


def test_ablation_figure_labels_every_depth_with_its_positions(tmp_path):
    """The figure's depth axis: each depth's positions, "not reached" for the paper's depths beyond the record's."""
    from harts.report.fidelity import _ablation_figure
    from harts.report.render import save_pdf

    pdf = tmp_path / "ablation.pdf"
    save_pdf([_ablation_figure(fidelity_record(depths=4), [])], pdf)
    _, figure = pdf_text(pdf)
    assert "Replay ablation by handoff depth: tiny" in figure and "depth 4-5 (shaded)" in figure
    axis = "0\n100\n1\n101\n2\n102\n3\n103\n4\nnot reached\n5\nnot reached\nhandoff depth, positions"
    assert figure.count(axis) == 4, figure  # each of the four panels


@pytest.mark.parametrize("excess, scale", [pytest.param(0.4, "linear", id="near-the-band"),
                                           pytest.param(1e5, "symlog", id="floor-near-zero")])
def test_a_huge_excess_keeps_the_papers_band_visible(excess, scale):
    """The SymKL excess axis turns symlog when a bar dwarfs the paper's band (the |dNLL| one stays linear)."""
    from harts.report.fidelity import _ablation_figure

    record = fidelity_record()
    record["results"]["ablation"]["1"]["no-replay"]["symkl_excess_over_split_rerun"] = excess
    figure = _ablation_figure(record, [])
    symkl_excess, dnll_excess = figure.axes[1], figure.axes[3]
    assert "SymKL: excess" in symkl_excess.get_title() and "dNLL|: excess" in dnll_excess.get_title()
    assert symkl_excess.get_yscale() == scale and dnll_excess.get_yscale() == "linear"
