"""Reports from benchmark records: PDF figures and tables, CSV and markdown, with the paper's figures beside ours.

Modules: `records` (loading and checking records, provenance), `render` (pages, tables, CSV),
`speedup`, `planning`, `fidelity` (one report each: `write_*_report(record_paths, pdf, csv)`)
and `summary` (reports/summary.md: every table, hardware, versions, config, git sha). A report
only reads records; every number it prints was measured by a `harts bench ...` run, and a cell
that was not measured says so.
"""
