"""harts.extras: every optional package's extra is the one pyproject declares, and a missing one is one clear line."""

import sys
import tomllib
from pathlib import Path

import pytest

from harts.cli.main import main
from harts.extras import EXTRAS, MissingExtra, require

REPO = Path(__file__).resolve().parents[1]
STEP = REPO / "data/samples/tiny-step.jsonl.gz"


def extra_packages(extra: str, extras: dict[str, list[str]]) -> set[str]:
    """Distribution names an extra installs, its `harts[...]` references followed."""
    names = set()
    for requirement in extras[extra]:
        name = requirement.split(";")[0].split("[")[0]
        for stop in "<>=!~ ":
            name = name.split(stop)[0]
        if name == "harts":
            for inner in requirement.split("[")[1].split("]")[0].split(","):
                names |= extra_packages(inner.strip(), extras)
        else:
            names.add(name.lower())
    return names


def test_each_optional_package_is_in_its_extra_and_not_in_the_core():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = {requirement.split(">")[0].split("=")[0].split("<")[0].lower() for requirement in project["dependencies"]}
    extras = project["optional-dependencies"]
    for package, extra in EXTRAS.items():
        assert package in extra_packages(extra, extras), (package, extra)
        assert package not in core, package
        assert package in extra_packages("test", extras), package


def test_require_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ModuleNotFoundError
    expected = r"W&B logging needs wandb, which is not installed: pip install 'harts\[wandb\]'"
    with pytest.raises(MissingExtra, match=expected):
        require("wandb", "W&B logging")


def test_a_missing_dependency_of_the_package_itself_is_not_reported_as_the_extra(monkeypatch):
    def broken(name):
        raise ModuleNotFoundError("No module named 'kiwisolver'", name="kiwisolver")

    monkeypatch.setattr("harts.extras.importlib.import_module", broken)
    with pytest.raises(ModuleNotFoundError) as raised:
        require("matplotlib", "rendering")
    assert type(raised.value) is ModuleNotFoundError and raised.value.name == "kiwisolver"


def test_cli_without_ortools_is_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "ortools", None)
    monkeypatch.setitem(sys.modules, "ortools.sat.python.cp_model", None)
    status = main(["plan", "microbatches", str(STEP), "--capacity", "4096", "--dp", "1", "--planner",
                   "treetrain-ortools"])
    err = capsys.readouterr().err
    assert status == 2
    assert err == ("harts: error: the TreeTrain planner (CP-SAT) needs ortools, which is not installed: "
                   "pip install 'harts[bench]'\n")
