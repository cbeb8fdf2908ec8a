"""Entry points run through the engine: outside the few modules listed in `GUARDED`, no module of harts/ uses the
building blocks of a step (a layout, a microbatch's forward and loss, a step in one process or on the ranks); the
command lines, the benchmarks, harts.api and the integrations reach them through `harts.engine.Engine`.

A use is an import of the name from its module (`from m import name [as x]`, relative too, or `*`) or an attribute of
the module (`m.name` after `import m [as x]` or `from parent import m [as x]`), anywhere in a file (module level or
in a function). A function of the same name in another module (harts.model.hf's checkpoint `build_layout`) is not
one. Beside tests/test_imports.py (which layer may import which), whose module walk this reuses.

The check is tested on small packages written into a temporary folder: a from-import, an aliased one, a relative
one, a star import, a module's attribute (module imported from its parent, under an alias, or by its dotted name) and
a guarded name used by a listed module that is listed for other names only all fail, naming file, line, module and
name; a same-named function elsewhere passes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.test_imports import PACKAGE_DIR, import_source, module_files, write_package

ENGINE = "harts.engine"

GUARDED = {
    "harts.objective.step": {
        "build_layout": ("harts.objective.step", "harts.objective.verify", "harts.parallel.step",
                         "harts.parallel.verify", ENGINE),
        "build_mtp_layouts": ("harts.objective.step",),
        "microbatch_logprobs": ("harts.objective.step", ENGINE),
        "microbatch_loss": ("harts.objective.step", "harts.parallel.step"),
        "run_step": ("harts.objective.step", "harts.objective.verify", "harts.parallel.verify", ENGINE),
    },
    "harts.parallel.step": {
        "run_parallel_step": ("harts.parallel.step", "harts.parallel.verify", ENGINE),
    },
}
"""Module -> guarded name -> the modules that may use it: its own, the single-process and parallel references that
check the step against itself (harts.objective.verify, harts.parallel.verify: `harts verify`, `harts bench fidelity
--parallel`), the parallel step (a layout and a microbatch's loss per rank) and the engine."""


def _dotted(node: ast.expr) -> str | None:
    """`a.b.c` of an attribute chain over a name, None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return None if inner is None else f"{inner}.{node.attr}"
    return None


def uses(module: str, path: Path, guarded=GUARDED) -> list[tuple[int, str, str]]:
    """(line, guarded module, name) of every use of a guarded name in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    bound: dict[str, str] = {}  # a local name or dotted chain -> the guarded module it stands for
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in guarded:
                    bound[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom):
            source = import_source(module, path, node)
            for alias in node.names:
                if source in guarded and (alias.name == "*" or alias.name in guarded[source]):
                    names = guarded[source] if alias.name == "*" else [alias.name]
                    found += [(node.lineno, source, name) for name in names]
                elif f"{source}.{alias.name}" in guarded:
                    bound[alias.asname or alias.name] = f"{source}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            target = bound.get(_dotted(node.value) or "")
            if target is not None and node.attr in guarded[target]:
                found.append((node.lineno, target, node.attr))
    return sorted(set(found))


def check_engine_bypass(package_dir: Path, guarded=GUARDED) -> list[str]:
    """One line per use of a guarded name by a module not allowed it."""
    problems = []
    for module, path in module_files(package_dir).items():
        for line, source, name in uses(module, path, guarded):
            allowed = guarded[source][name]
            if module not in allowed:
                problems.append(f"{path.relative_to(package_dir.parent)}:{line}: {module} uses {source}.{name} "
                                f"around the engine (only {', '.join(allowed)} may: go through {ENGINE}.Engine)")
    return problems


def test_entry_points_run_through_the_engine():
    problems = check_engine_bypass(PACKAGE_DIR)
    assert not problems, "\n".join(problems)


def test_the_table_names_what_exists():
    """Every guarded name is a function of its module, and every allowed module exists (a renamed function or
    module would leave the check guarding nothing)."""
    modules = module_files(PACKAGE_DIR)
    for source, names in GUARDED.items():
        tree = ast.parse(modules[source].read_text(encoding="utf-8"))
        defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        for name, allowed in names.items():
            assert name in defined, (source, name)
            assert source in allowed and all(module in modules for module in allowed), (name, allowed)


# A small package under a folder named `harts`: file -> source.
_STEP = "def build_layout():\n    pass\n\n\ndef run_step():\n    build_layout()\n"
_CLEAN = {
    "__init__.py": "",
    "objective/__init__.py": "",
    "objective/step.py": _STEP,
    "parallel/__init__.py": "",
    "parallel/step.py": "from harts.objective.step import build_layout\n\n\ndef run_parallel_step():\n"
                        "    build_layout()\n",
    "engine.py": "from harts.objective import step\nfrom harts.parallel.step import run_parallel_step\n\n\n"
                 "def run():\n    step.run_step()\n    run_parallel_step()\n",
    "model/__init__.py": "",
    "model/hf.py": "def build_layout(config):\n    return {}\n",
    "api.py": "from harts.engine import run\nfrom harts.model import hf\n\n\ndef f():\n    hf.build_layout(None)\n"
              "    run()\n",
}
_SMALL = {
    "harts.objective.step": {"build_layout": ("harts.objective.step", "harts.parallel.step", ENGINE),
                             "run_step": ("harts.objective.step", ENGINE)},
    "harts.parallel.step": {"run_parallel_step": ("harts.parallel.step", ENGINE)},
}
_PLANTED = {
    "from-import": ({"api.py": "def f():\n    from harts.objective.step import build_layout\n"},
                    "harts/api.py:2: harts.api uses harts.objective.step.build_layout around the engine"),
    "aliased": ({"api.py": "from harts.parallel.step import run_parallel_step as parallel_step\n"},
                "harts/api.py:1: harts.api uses harts.parallel.step.run_parallel_step"),
    "relative": ({"bench/__init__.py": "", "bench/speedup.py": "from ..objective.step import run_step\n"},
                 "harts/bench/speedup.py:1: harts.bench.speedup uses harts.objective.step.run_step"),
    "star": ({"api.py": "from harts.parallel.step import *\n"},
             "harts/api.py:1: harts.api uses harts.parallel.step.run_parallel_step"),
    "module-from-parent": ({"api.py": "from harts.objective import step as objective_step\n\n\ndef f():\n"
                                      "    return objective_step.run_step()\n"},
                           "harts/api.py:5: harts.api uses harts.objective.step.run_step"),
    "module-alias": ({"api.py": "import harts.parallel.step as ps\n\nps.run_parallel_step()\n"},
                     "harts/api.py:3: harts.api uses harts.parallel.step.run_parallel_step"),
    "dotted-module": ({"api.py": "import harts.objective.step\n\nharts.objective.step.build_layout()\n"},
                      "harts/api.py:3: harts.api uses harts.objective.step.build_layout"),
    "listed-for-another-name": ({"parallel/step.py": "from harts.objective.step import build_layout, run_step\n"},
                                "harts/parallel/step.py:1: harts.parallel.step uses harts.objective.step.run_step"),
}


def _package(tmp_path: Path, changes: dict[str, str]) -> Path:
    return write_package(tmp_path, {**_CLEAN, **changes})


def test_check_passes_a_clean_package(tmp_path):
    assert check_engine_bypass(_package(tmp_path, {}), _SMALL) == []


@pytest.mark.parametrize("name", _PLANTED)
def test_check_names_file_line_module_and_name(tmp_path, name):
    changes, expected = _PLANTED[name]
    problems = check_engine_bypass(_package(tmp_path, changes), _SMALL)
    assert len(problems) == 1 and problems[0].startswith(expected), problems
