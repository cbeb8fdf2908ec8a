"""Page rendering for the PDF reports: matplotlib (Agg) pages of A4 landscape, tables, CSV and markdown.

`page(title)` starts a page, `table_pages(title, header, rows, notes)` lays a table out over as
many pages as it needs, `footer(fig, lines)` prints the provenance under a page, and
`save_pdf(figures, path)` writes the pages (fonts embedded as TrueType, so the text stays
selectable and a PDF parser can read it back; no creation date, so an unchanged input gives the
same file). `write_csv` and `markdown_table` write the same rows as the PDF tables.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from harts.extras import require
from harts.files import atomic_open, atomic_path

PAGE_SIZE_IN = (11.69, 8.27)
FONT_SIZE = 10
TABLE_FONT_SIZE = 8.5
ROWS_PER_PAGE = 24


def _pyplot():
    matplotlib = require("matplotlib", "rendering a report")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({
        "font.size": FONT_SIZE, "axes.titlesize": FONT_SIZE + 1, "axes.labelsize": FONT_SIZE,
        "legend.fontsize": FONT_SIZE - 1, "xtick.labelsize": FONT_SIZE - 1, "ytick.labelsize": FONT_SIZE - 1,
        "pdf.fonttype": 42, "svg.hashsalt": "harts",
    })
    return plt


def page(title: str, subtitle: str | None = None):
    plt = _pyplot()
    fig = plt.figure(figsize=PAGE_SIZE_IN)
    fig.suptitle(title, fontsize=FONT_SIZE + 4, fontweight="bold", y=0.975)
    if subtitle:
        fig.text(0.5, 0.925, subtitle, ha="center", va="top", fontsize=FONT_SIZE)
    return fig


def footer(fig, lines: list[str]) -> None:
    fig.text(0.02, 0.012, "\n".join(lines), ha="left", va="bottom", fontsize=FONT_SIZE - 2.5, color="0.25",
             wrap=True)


def table_pages(title: str, header: list[str], rows: list[list[str]], notes: list[str] | None = None,
                footer_lines: list[str] | None = None) -> list:
    """One or more pages holding the table (ROWS_PER_PAGE rows each), notes under the last one (which
    holds two rows fewer per note line, so that the table stays above them)."""
    last_capacity = ROWS_PER_PAGE - 2 * (len(notes) + 1) if notes else ROWS_PER_PAGE
    chunks, rest = [], list(rows)
    while len(rest) > last_capacity:
        take = ROWS_PER_PAGE if len(rest) > ROWS_PER_PAGE else len(rest) - last_capacity
        chunks.append(rest[:take])
        rest = rest[take:]
    chunks.append(rest)
    widths = _column_widths(header, rows)
    figures = []
    for number, chunk in enumerate(chunks):
        suffix = f" ({number + 1}/{len(chunks)})" if len(chunks) > 1 else ""
        fig = page(title + suffix)
        last = number == len(chunks) - 1
        note_height = 0.035 * (len(notes) + 1) if notes and last else 0.0
        bottom = 0.09 + note_height
        ax = fig.add_axes((0.02, bottom, 0.96, 0.86 - bottom))
        ax.axis("off")
        table = ax.table(cellText=chunk or [["(no rows)"] + [""] * (len(header) - 1)], colLabels=header,
                         colWidths=widths, loc="upper center", cellLoc="center")
        table.auto_set_font_size(False)
        table.set_fontsize(TABLE_FONT_SIZE)
        table.scale(1.0, 1.45)
        for (row, _), cell in table.get_celld().items():
            cell.set_edgecolor("0.7")
            if row == 0:
                cell.set_facecolor("0.9")
                cell.set_text_props(fontweight="bold")
                cell.set_height(cell.get_height() * 1.6)
        if notes and last:
            fig.text(0.02, 0.085, "\n".join(notes), ha="left", va="bottom", fontsize=FONT_SIZE - 1, wrap=True)
        if footer_lines:
            footer(fig, footer_lines)
        figures.append(fig)
    return figures


def _column_widths(header: list[str], rows: list[list[str]]) -> list[float]:
    lengths = [max([len(line) for line in h.splitlines() or [""]] + [len(str(r[i])) for r in rows]) + 2
               for i, h in enumerate(header)]
    total = sum(lengths)
    return [n / total for n in lengths]


def wrap_header(header: list[str], width: int = 14) -> list[str]:
    import textwrap

    return ["\n".join(textwrap.wrap(h, width)) or h for h in header]


def save_pdf(figures: list, path: str | Path) -> None:
    from matplotlib.backends.backend_pdf import PdfPages

    plt = _pyplot()
    with atomic_path(path) as tmp, PdfPages(tmp, metadata={"Creator": "harts report", "Producer": "matplotlib",
                                                           "CreationDate": None}) as pdf:
        for fig in figures:
            pdf.savefig(fig)
            plt.close(fig)


def write_csv(path: str | Path, columns: list[str], rows: list[dict[str, Any]]) -> None:
    """rows: dicts keyed by `columns` (a missing key is an empty cell); floats in full precision."""
    with atomic_open(path, newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="raise")
        writer.writeheader()
        for row in rows:
            writer.writerow({key: "" if row.get(key) is None else row[key] for key in columns})


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    def escape(text: str) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(escape(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(escape(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
