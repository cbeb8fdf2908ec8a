"""harts.report.speedup: CSV rows from speedup records, and the PDF (parsed back with pypdf)."""

from __future__ import annotations

import argparse
import csv

import pytest

from harts.report.records import ERROR, NOT_MEASURED, NOT_REPORTED
from harts.report.speedup import SPEEDUP_COLUMNS, display_table, speedup_rows, write_speedup_report

from .helpers import pdf_text, speedup_record, write


def test_rows_carry_the_records_figures_and_the_papers():
    record = speedup_record(semantic=4000, compact=1000, base_fbg=8.0, comp_fbg=2.5)
    rows = speedup_rows([record])
    assert [r["source"] for r in rows] == ["ours", "paper"]
    ours, paper = rows
    assert ours["compression"] == 4.0 and ours["fbg_speedup"] == pytest.approx(3.2)
    assert ours["efficiency"] == pytest.approx(0.8) and ours["baseline_fbg_s"] == 8.0
    assert ours["core_speedup"] == pytest.approx(8.1 / 2.7)
    assert ours["flops_compression"] == pytest.approx(3.6) and ours["flops_efficiency"] == pytest.approx(3.2 / 3.6)
    assert paper["flops_compression"] == paper["flops_efficiency"] == NOT_REPORTED
    assert (paper["compression"], paper["fbg_speedup"]) == (5.62, 4.81)
    assert paper["efficiency"] == pytest.approx(4.81 / 5.62) and paper["core_speedup"] == NOT_REPORTED
    assert set(ours) == set(SPEEDUP_COLUMNS) == set(paper)


def test_error_and_missing_cells_say_so():
    failed = speedup_record(step=1, error="OutOfMemoryError: CUDA out of memory")
    partial = speedup_record(step=2)
    del partial["results"]["core_speedup"]
    rows = speedup_rows([failed, partial])
    assert rows[0]["fbg_speedup"] == ERROR and rows[0]["error"].startswith("OutOfMemoryError")
    assert rows[1]["core_speedup"] == NOT_MEASURED and rows[1]["fbg_speedup"] == pytest.approx(3.2)


def test_report_files(tmp_path):
    single = write(tmp_path, "single.json", [speedup_record(step=0), speedup_record(step=1, base_fbg=9.0)])
    dp2 = write(tmp_path, "dp2.json", [speedup_record(parallel="dp2", breakdown=False),
                                       speedup_record(parallel="dp2", step=1, error="RuntimeError: rank 1 failed")])
    pdf, table = tmp_path / "speedup.pdf", tmp_path / "speedup.csv"
    write_speedup_report([single, dp2], pdf, table)
    with open(table, newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        rows = list(reader)
    assert reader.fieldnames == SPEEDUP_COLUMNS
    assert [(r["source"], r["parallel"], r["step"]) for r in rows] == [
        ("ours", "single", "0"), ("ours", "single", "1"), ("ours", "dp2", "0"), ("ours", "dp2", "1"),
        ("paper", "8 GPUs", "all")]
    assert float(rows[1]["fbg_speedup"]) == pytest.approx(3.6) and rows[3]["fbg_speedup"] == ERROR
    pages, text = pdf_text(pdf)
    assert pages == 4  # speedup, step time, breakdown, table
    for expected in ("Speedup of compact execution", "5.62x", "4.81x", "tiny / single / harts", "tiny / dp2 / harts",
                     "Step time by phase", "beyond the ideal", "Speedup per step", "RuntimeError: rank 1 failed",
                     "not reported"):
        assert expected in text, expected


def test_flagged_timings_are_marked(tmp_path):
    flag = "efficiency 2.86 > 1.05: faster than the compression allows"
    flagged = speedup_record(step=0, timing_flags=[flag, "baseline F+B+G varies by 20% over 3 repeats"])
    old = speedup_record(step=1)
    del old["results"]["timing_flags"]
    rows = speedup_rows([flagged, old, speedup_record(step=2), speedup_record(step=3, error="RuntimeError: x")])
    assert rows[0]["timing_flags"] == flag + "; baseline F+B+G varies by 20% over 3 repeats"
    assert [r["timing_flags"] for r in rows[1:]] == [NOT_MEASURED, "", ERROR, NOT_REPORTED]
    path = write(tmp_path, "r.json", [flagged, speedup_record(step=2)])
    write_speedup_report([path], tmp_path / "s.pdf", tmp_path / "s.csv")
    _, text = pdf_text(tmp_path / "s.pdf")
    assert text.count("(flagged)") == 1 and "timing flagged: efficiency 2.86" in text


def test_same_records_same_pdf(tmp_path):
    records = write(tmp_path, "r.json", [speedup_record()])
    write_speedup_report([records], tmp_path / "a.pdf", tmp_path / "a.csv")
    write_speedup_report([records], tmp_path / "b.pdf", tmp_path / "b.csv")
    assert (tmp_path / "a.pdf").read_bytes() == (tmp_path / "b.pdf").read_bytes()


def test_no_records_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no records"):
        write_speedup_report([write(tmp_path, "empty.json", [])], tmp_path / "x.pdf", tmp_path / "x.csv")


def _report_text(tmp_path, records) -> str:
    """The PDF text of the speedup report of `records` (one records file)."""
    path = write(tmp_path, "single.json", records)
    write_speedup_report([path], tmp_path / "speedup.pdf", tmp_path / "speedup.csv")
    return pdf_text(tmp_path / "speedup.pdf")[1]

def test_attention_backends_are_configurations_of_their_own(tmp_path):
    """Records that differ only in the MLA backend are not merged (their own CSV columns, summary, labels in
    every figure); the bench's default is the device's backend (sdpa on CPU), the same configuration as naming it."""
    default = speedup_record(step=0)
    named = speedup_record(step=1)
    named["config"].update(attention_backend="sdpa")
    flash4 = speedup_record(step=0, base_fbg=6.0)
    flash4["config"].update(attention_backend="flash4")
    mixed = speedup_record(step=0, base_fbg=7.0)
    mixed["config"].update(attention_backend="varlen", compact_attention_backend="flex")
    rows = speedup_rows([default, named, flash4, mixed])
    assert [(r["attention_backend"], r["compact_attention_backend"]) for r in rows] == [
        ("sdpa", "sdpa"), ("sdpa", "sdpa"), ("flash4", "flash4"), ("varlen", "flex"), (NOT_REPORTED, NOT_REPORTED)]
    header, table = display_table(rows)
    column = header.index("device / dtype")
    assert [line[column] for line in table] == [
        "cpu fp32 T=512 sdpa", "cpu fp32 T=512 sdpa", "cpu fp32 T=512 flash4", "cpu fp32 T=512 varlen/flex", "cuda bf16 rc"]
    text = _report_text(tmp_path, [default, named, flash4, mixed])
    assert "cpu fp32, T = 512, flash4" in text and "cpu fp32, T = 512, varlen/flex" in text
    assert "tiny / single / harts T=512 flash4: compact" in text  # the step-time figure's labels
    assert text.count("tiny / single / harts T=512 sdpa (ideal") == 1  # default and named sdpa: one breakdown bar


def test_experts_backends_are_configurations_of_their_own(tmp_path):
    """Records that differ only in the MoE experts backend are not merged; the model config's "auto" is the
    device's backend (loop on CPU), the same configuration as naming it; lean is labelled."""
    default = speedup_record(step=0)
    named = speedup_record(step=1)
    named["config"]["model_config"] = {"moe": {"experts_backend": "loop"}}
    lean = speedup_record(step=0, base_fbg=6.0)
    lean["config"]["model_config"] = {"moe": {"experts_backend": "lean"}}
    grouped = speedup_record(step=0, base_fbg=7.0)
    grouped["config"]["model_config"] = {"moe": {"experts_backend": "grouped"}}
    rows = speedup_rows([default, named, lean, grouped])
    assert [r["experts_backend"] for r in rows] == ["loop", "loop", "lean", "grouped", NOT_REPORTED]
    header, table = display_table(rows)
    assert [line[header.index("device / dtype")] for line in table[:4]] == [
        "cpu fp32 T=512 sdpa", "cpu fp32 T=512 sdpa", "cpu fp32 T=512 sdpa lean experts", "cpu fp32 T=512 sdpa grouped experts"]
    text = _report_text(tmp_path, [default, named, lean])
    assert "cpu fp32, T = 512, sdpa, lean experts" in text
    assert text.count("tiny / single / harts T=512 sdpa (ideal") == 1  # auto and named loop: one configuration


def test_kept_attention_is_a_configuration_of_its_own(tmp_path):
    """Records that differ only in keep_attention are not merged (older records have no key: not kept); the
    labels say where the attention was kept."""
    old = speedup_record(step=0)
    old["config"].update(recompute=True, recompute_blocks=2)
    plain = speedup_record(step=1)
    plain["config"].update(recompute=True, recompute_blocks=2, keep_attention=False)
    kept = speedup_record(step=0, base_fbg=7.0)
    kept["config"].update(recompute=True, recompute_blocks=2, keep_attention=True)
    rows = speedup_rows([old, plain, kept])
    assert [r["keep_attention"] for r in rows] == [False, False, True, NOT_REPORTED]
    header, table = display_table(rows)
    assert [line[header.index("device / dtype")] for line in table[:3]] == [
        "cpu fp32 T=512 rc 2 blocks sdpa", "cpu fp32 T=512 rc 2 blocks sdpa", "cpu fp32 T=512 rc 2 blocks attn kept sdpa"]
    text = _report_text(tmp_path, [old, plain, kept])
    assert "T = 512, recompute 2 blocks, attention kept" in text
    assert text.count("tiny / single / harts T=512 rc 2 blocks sdpa (ideal") == 1  # old and plain: one configuration


def test_kept_kda_intermediates_are_a_configuration_of_their_own(tmp_path):
    """Records that differ only in keep_kda_intermediates are not merged; the labels and the CSV say where they
    were kept."""
    plain = speedup_record(step=0)
    plain["config"].update(recompute=True, kda_backend="fla")
    kept = speedup_record(step=0, base_fbg=7.0)
    kept["config"].update(recompute=True, kda_backend="fla", keep_kda_intermediates=True)
    rows = speedup_rows([plain, kept])
    assert [r["keep_kda_intermediates"] for r in rows] == [False, True, NOT_REPORTED]
    header, table = display_table(rows)
    assert [line[header.index("device / dtype")] for line in table[:2]] == [
        "cpu fp32 T=512 rc sdpa fla KDA", "cpu fp32 T=512 rc KDA interm. kept sdpa fla KDA"]
    text = _report_text(tmp_path, [plain, kept])
    assert "T = 512, recompute, KDA intermediates kept, sdpa, fla KDA" in text


def test_linked_kda_calls_are_a_configuration_of_their_own(tmp_path):
    """Records that differ only in kda_calls (the calls one by one, also a record from before the knob, against
    the linked launch) are not merged; the labels and the CSV say where the calls were linked."""
    old = speedup_record(step=0)
    old["config"].update(kda_backend="fla")
    separate = speedup_record(step=1)
    separate["config"].update(kda_backend="fla", kda_calls="separate")
    linked = speedup_record(step=0, base_fbg=7.0)
    linked["config"].update(kda_backend="fla", kda_calls="linked")
    rows = speedup_rows([old, separate, linked])
    assert [r["kda_calls"] for r in rows] == ["separate", "separate", "linked", NOT_REPORTED]
    header, table = display_table(rows)
    assert [line[header.index("device / dtype")] for line in table[:3]] == [
        "cpu fp32 T=512 sdpa fla KDA", "cpu fp32 T=512 sdpa fla KDA", "cpu fp32 T=512 sdpa fla KDA linked KDA"]
    text = _report_text(tmp_path, [old, separate, linked])
    assert "T = 512, sdpa, fla KDA, KDA calls linked" in text
    assert text.count("tiny / single / harts T=512 sdpa fla KDA (ideal") == 1  # old and separate: one


def test_compact_recompute_blocks_and_by_rows_are_configurations_of_their_own(tmp_path):
    """Records that differ only in the compact execution's recomputed blocks or in recompute_by_rows are not
    merged; the labels give the compact blocks after the baseline's; a record from before the compact blocks
    were recorded is one with the baseline's."""
    old = speedup_record(step=0)
    old["config"].update(recompute=True, recompute_blocks=2)
    same = speedup_record(step=1)
    same["config"].update(recompute=True, recompute_blocks=2, compact_recompute_blocks=2, recompute_by_rows=False)
    fewer = speedup_record(step=0, base_fbg=7.0)
    fewer["config"].update(recompute=True, recompute_blocks=2, compact_recompute_blocks=1)
    by_rows = speedup_record(step=0, base_fbg=6.0)
    by_rows["config"].update(recompute=True, recompute_blocks=2, compact_recompute_blocks=1, recompute_by_rows=True)
    rows = speedup_rows([old, same, fewer, by_rows])
    assert [r["compact_recompute_blocks"] for r in rows[:4]] == [2, 2, 1, 1]
    header, table = display_table(rows)
    assert [line[header.index("device / dtype")] for line in table[:4]] == [
        "cpu fp32 T=512 rc 2 blocks sdpa", "cpu fp32 T=512 rc 2 blocks sdpa", "cpu fp32 T=512 rc 2/1 blocks sdpa",
        "cpu fp32 T=512 rc 2/1 blocks by rows sdpa"]
    text = _report_text(tmp_path, [old, same, fewer, by_rows])
    assert "T = 512, recompute 2/1 blocks, by rows, sdpa" in text
    assert text.count("tiny / single / harts T=512 rc 2 blocks sdpa (ideal") == 1  # old and same: one configuration


def test_kda_backends_and_capacities_are_configurations_of_their_own(tmp_path):
    """Records that differ only in the KDA backend or the capacity T (e.g. `bench speedup --variant`) are not
    merged; the bench's default KDA backend (torch on CPU) and T = 65,536 are not labelled."""
    default = speedup_record(step=0)
    default["config"]["capacity"] = 65536
    named = speedup_record(step=1)
    named["config"].update(capacity=65536, kda_backend="torch")
    fla = speedup_record(step=0, base_fbg=6.0)
    fla["config"].update(capacity=65536, kda_backend="fla")
    smaller = speedup_record(step=0, base_fbg=7.0)
    smaller["config"]["capacity"] = 32768
    rows = speedup_rows([default, named, fla, smaller])
    assert [(r["kda_backend"], r["capacity"]) for r in rows[:4]] == [
        ("torch", 65536), ("torch", 65536), ("fla", 65536), ("torch", 32768)]
    header, table = display_table(rows)
    assert [line[header.index("device / dtype")] for line in table[:4]] == [
        "cpu fp32 sdpa", "cpu fp32 sdpa", "cpu fp32 sdpa fla KDA", "cpu fp32 T=32,768 sdpa"]
    path = write(tmp_path, "single.json", [default, named, fla, smaller])
    write_speedup_report([path], tmp_path / "speedup.pdf", tmp_path / "speedup.csv")
    _, text = pdf_text(tmp_path / "speedup.pdf")
    assert "cpu fp32, sdpa, fla KDA" in text and "cpu fp32, T = 32,768, sdpa" in text
    assert text.count("tiny / single / harts sdpa (ideal") == 1  # default and named torch: one configuration


def test_the_lm_head_chunk_is_a_configuration_of_its_own(tmp_path):
    """Records that differ only in the LM head's chunk rows are not merged; older records (no key) and the
    default 4,096 are one configuration, not labelled."""
    from harts.bench.speedup.cli import register
    from harts.config.execution import DEFAULT_LOGPROB_CHUNK_ROWS
    from harts.objective.step import StepConfig

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    bench_default = parser.parse_args(["speedup", "--model", "m", "--trees", "t"]).logprob_chunk_rows
    assert bench_default == DEFAULT_LOGPROB_CHUNK_ROWS == StepConfig().logprob_chunk_rows
    old = speedup_record(step=0)
    named = speedup_record(step=1)
    named["config"]["logprob_chunk_rows"] = 4096
    smaller = speedup_record(step=0, base_fbg=6.0)
    smaller["config"]["logprob_chunk_rows"] = 2048
    rows = speedup_rows([old, named, smaller])
    assert [r["logprob_chunk_rows"] for r in rows[:3]] == [4096, 4096, 2048]
    header, table = display_table(rows)
    assert [line[header.index("device / dtype")] for line in table[:3]] == [
        "cpu fp32 T=512 sdpa", "cpu fp32 T=512 sdpa", "cpu fp32 T=512 LM-head chunks 2,048 sdpa"]
    path = write(tmp_path, "single.json", [old, named, smaller])
    write_speedup_report([path], tmp_path / "speedup.pdf", tmp_path / "speedup.csv")
    _, text = pdf_text(tmp_path / "speedup.pdf")
    assert "LM-head chunks 2,048" in text
    assert text.count("tiny / single / harts T=512 sdpa (ideal") == 1  # old and named: one configuration


def test_the_gdn_baselines_kernel_is_a_configuration_of_its_own(tmp_path):
    """A Gated DeltaNet model's records on fla that differ only in the baseline's GDN kernel are not merged; fla's
    GDN kernel (the default, and a record from before the knob) is not labelled, the KDA kernels are; where no fla
    GDN call ran (a KDA model, the torch backend) the kernel is no setting."""
    gdn = {"gdn": {"num_key_heads": 2}}

    def record(step, base_fbg, **config):
        made = speedup_record(step=step, base_fbg=base_fbg)
        made["config"].update(config)
        return made

    old = record(0, 8.0, kda_backend="fla", model_config=gdn)
    named = record(1, 8.0, kda_backend="fla", model_config=gdn, gdn_kernel="gdn")
    kda = record(0, 6.0, kda_backend="fla", model_config=gdn, gdn_kernel="kda")
    on_torch = record(0, 7.0, model_config=gdn, gdn_kernel="kda")
    kda_model = record(0, 5.0, kda_backend="fla", gdn_kernel="kda")
    rows = speedup_rows([old, named, kda, on_torch, kda_model])
    assert [r["gdn_kernel"] for r in rows] == ["gdn", "gdn", "kda", None, None, NOT_REPORTED]
    header, table = display_table(rows)
    assert [line[header.index("device / dtype")] for line in table[:5]] == [
        "cpu fp32 T=512 sdpa fla KDA", "cpu fp32 T=512 sdpa fla KDA", "cpu fp32 T=512 sdpa fla KDA GDN on KDA",
        "cpu fp32 T=512 sdpa", "cpu fp32 T=512 sdpa fla KDA"]
    path = write(tmp_path, "single.json", [old, named, kda])
    write_speedup_report([path], tmp_path / "speedup.pdf", tmp_path / "speedup.csv")
    _, text = pdf_text(tmp_path / "speedup.pdf")
    assert "T = 512, sdpa, fla KDA, GDN baseline on KDA kernels" in text
    assert text.count("tiny / single / harts T=512 sdpa fla KDA (ideal") == 1  # old and named: one configuration
