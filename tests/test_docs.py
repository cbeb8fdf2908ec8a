"""The documentation holds: README.md's library example runs and prints what the README says it prints, its quick
start is the two commands of .ci/, every relative link of README.md and docs/*.md reaches an existing file (and, for
`.md#anchor`, a heading with that GitHub slug), every `docs/NAME.md "Heading"` that code, configs, workflow or scripts
name exists, and docs/execution.md's knob table names exactly the flags and keys the commands, configs and pipeline
schema take.
"""

import argparse
import dataclasses
import re
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)\)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+\1")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the Markdown text outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def section(text: str, heading: str) -> str:
    """The body of the `## heading` section, up to the next heading of level 1 or 2 outside code blocks."""
    lines = text.splitlines()
    prose = prose_lines(text)
    start = next(number for number, line in prose if line == f"## {heading}")
    end = next((number for number, line in prose if number > start and re.match(r"^#{1,2} ", line)), len(lines) + 1)
    return "\n".join(lines[start:end - 1]) + "\n"


def github_slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text without Markdown, lower case, with every character but letters, digits,
    `_`, `-` and spaces removed and spaces turned into `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "")
    kept = "".join(c for c in text.lower() if c in "-_ " or unicodedata.category(c)[0] in "LNM")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, repeated slugs numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    result = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        match = re.match(r"^#{1,6} +(.+?) *#* *$", line)
        if match:
            slug = github_slug(match.group(1))
            result.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return result


def broken_links(path: Path) -> list[str]:
    """The relative links of a Markdown file that reach no file, or no heading of the .md file they name."""
    problems = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        for target in LINK.findall(CODE_SPAN.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(REPO)}:{number}: {target}"
            if not linked.exists() or REPO not in (linked, *linked.parents):
                problems.append(f"{where}: no such file in the repository")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                problems.append(f"{where}: no heading with anchor #{anchor} in {linked.relative_to(REPO)}")
    return problems


@pytest.mark.parametrize("path", PAGES, ids=[p.relative_to(REPO).as_posix() for p in PAGES])
def test_every_relative_link_reaches_a_file_and_heading(path):
    assert broken_links(path) == []


def test_a_broken_link_or_anchor_is_found(tmp_path, monkeypatch):
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Two words: `x` & y\n", encoding="utf-8")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/a.md#two-words-x--y) [gone](docs/b.md) [anchor](docs/a.md#two-words)\n"
                    "`[code](docs/c.md)`\n```\n[fenced](docs/d.md)\n```\n", encoding="utf-8")
    assert [problem.split(": ", 2)[1] for problem in broken_links(page)] == ["docs/b.md", "docs/a.md#two-words"]


@pytest.mark.parametrize("heading, slug", [
    ("Weights & Biases", "weights--biases"),
    ("Trees larger than T: the `paper` workload", "trees-larger-than-t-the-paper-workload"),
    ("2. Microbatch planning (paper §3.2)", "2-microbatch-planning-paper-32"),
    ("The paper's model shape on one H200", "the-papers-model-shape-on-one-h200"),
], ids=["ampersand", "code", "section-sign", "apostrophe"])
def test_github_slug(heading, slug):
    assert github_slug(heading) == slug


def test_every_docs_page_is_in_the_index():
    index = (REPO / "docs" / "README.md").read_text(encoding="utf-8")
    listed = set(LINK.findall(index))
    assert {p.name for p in PAGES if p.parent.name == "docs" and p.name != "README.md"} <= listed


# Code, configs, the workflow and the scripts name docs pages as `docs/NAME.md "Heading"` (or with single quotes).
REFERENCING = ["harts", "tests", "workflows", "configs", "profiles", ".ci", "Snakefile", "pyproject.toml"]
DOCS_REFERENCE = re.compile(r"docs/([\w-]+\.md)(?: [\"']([^\"'\n]+)[\"'])?")


def docs_references() -> list[tuple[str, str, str | None]]:
    found = []
    for name in REFERENCING:
        root = REPO / name
        for path in [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()):
            if path.suffix in (".pyc", ".lock", ".gz", ".npz") or path == Path(__file__):
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            found += [(path.relative_to(REPO).as_posix(), page, heading)
                      for page, heading in DOCS_REFERENCE.findall(text)]
    return found


def test_every_docs_page_and_heading_the_code_names_exists():
    references = docs_references()
    assert len({where for where, _, _ in references}) >= 10  # the search itself works
    problems = []
    for where, page, heading in references:
        path = REPO / "docs" / page
        if not path.exists():
            problems.append(f"{where}: docs/{page} does not exist")
        elif heading and github_slug(heading) not in anchors(path):
            problems.append(f"{where}: docs/{page} has no heading {heading!r}")
    assert problems == []


def test_readme_quick_start_is_the_two_ci_commands():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    (block,) = re.findall(r"```bash\n(.*?)```", section(text, "Quick start"), flags=re.S)
    commands = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    assert commands == ["bash .ci/main", "bash .ci/run"]
    assert (REPO / ".ci" / "main").is_file() and (REPO / ".ci" / "run").is_file()


def test_readme_library_example_runs_and_prints_what_the_readme_says(capsys):
    text = (REPO / "README.md").read_text(encoding="utf-8")
    body = section(text, "The library in ten lines")
    (code,) = re.findall(r"```python\n(.*?)```", body, flags=re.S)
    exec(compile(code, "README.md (The library in ten lines)", "exec"), {})
    printed = re.search(r"(\d+) rows computed for (\d+) tokens", capsys.readouterr().out).groups()
    claimed = re.search(r"It prints `(\d+) rows computed for (\d+) tokens`", body).groups()
    assert printed == claimed
    rows, tokens = map(int, printed)
    assert rows < tokens  # the shared prompt ran once


# ---------------------------------------------------------------------------------------------
# docs/execution.md's knob table: generated from the execution config, and bench speedup's additions

NOT_KNOBS = {"-h", "--help", "--model", "--trees", "--steps", "--seed", "--max-trees", "--model-seed", "--repeats",
             "--variant", "--no-breakdown", "--profile", "--out", "--json", "--wandb-project", "--wandb-group",
             "--wandb-mode", "--device", "--preset", "--no-reuse-baseline"}
"""`harts bench speedup` options that choose what to measure, where or where to write it, not how a step executes."""


def command_options(*words: str) -> set[str]:
    from harts.cli.main import build_parser

    parser = build_parser()
    for word in words:
        (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = subparsers.choices[word]
    return {option for action in parser._actions for option in action.option_strings}


def test_the_knob_table_is_the_one_the_config_generates():
    from harts.config.execution import markdown_table

    text = section((REPO / "docs" / "execution.md").read_text(encoding="utf-8"), "Every execution knob")
    assert markdown_table() in text


def test_bench_speedups_additions_are_its_flags_and_pipeline_keys():
    from harts.config.execution import FIELDS, flag

    from harts.workflow.config import load_schema

    schema = load_schema(REPO / "workflows/schemas/pipeline.schema.yaml")
    pipeline_keys = set(schema["properties"]["speedup"]["properties"])
    text = section((REPO / "docs" / "execution.md").read_text(encoding="utf-8"), "Every execution knob")
    rows = [line for line in text.split("`harts bench speedup` adds")[1].splitlines() if line.startswith("| `")]
    options = command_options("bench", "speedup")
    def first_word(cell: str) -> str:
        return re.findall(r"`([^`]+)`", cell)[0].split(":")[0].split()[0]

    named = set()
    for row in rows:
        flag_cell, key_cell = [cell.strip() for cell in row.split("|")[1:3]]
        named.add(first_word(flag_cell))
        assert first_word(flag_cell) in options, row
        assert key_cell == "—" or first_word(key_cell) in pipeline_keys, row
    own = options - {flag(name) for name in FIELDS} - NOT_KNOBS
    assert own <= named, f"bench speedup options missing from the table: {sorted(own - named)}"


def test_the_presets_table_is_the_configs():
    from harts.config.execution import PRESETS

    text = section((REPO / "docs" / "execution.md").read_text(encoding="utf-8"), "Every execution knob")
    rows = {cells[0].strip("` "): cells[1] for line in text.split("Presets:")[1].split("`harts bench speedup` adds")[0]
            .splitlines() if line.startswith("| `") for cells in [[c.strip() for c in line.split("|")[1:-1]]]}
    assert set(rows) == set(PRESETS)
    for name, knobs in PRESETS.items():
        listed = dict(item.strip("` ").split(": ") for item in rows[name].split(", "))
        assert listed == {key: str(value).lower() for key, value in knobs.items()}, name
