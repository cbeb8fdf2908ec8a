"""Imports point one way: each module of harts/ imports only its own layer and the layers below it, and no chain of
imports leads from a module back to itself. Module-level and function-local imports count alike (`import x`,
`from x import y`, relative imports, those under `if TYPE_CHECKING:`): a function-local import defers when a
dependency is loaded, it does not remove it.

`LAYERS` below, lowest first, is the package's map of who may import whom. A module belongs to the layer of its
longest listed prefix (`harts.trees` holds `harts.trees.io`; the root package `harts` holds only harts/__init__.py),
and every module must belong to one. A layer marked `isolated` holds packages that must not import each other
(training, rl and bench share only what lies below them).

The checks are tested on small packages written into a temporary folder: a wrong-way import (module-level,
function-local, relative), a sideways import between isolated packages, a cycle through a function-local import
and an import of a module that does not exist all fail, naming file, line and the imported module.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = "harts"
PACKAGE_DIR = Path(__file__).resolve().parents[1] / ROOT


@dataclass(frozen=True)
class Layer:
    name: str
    holds: tuple[str, ...]
    """Module and package names: a package holds its submodules (the root package only its __init__)."""
    about: str
    isolated: bool = False
    """Its packages must not import each other."""


LAYERS = (
    Layer("base", ("harts", "harts.config", "harts.extras", "harts.files", "harts.log", "harts.args"),
          "Strict YAML configs, optional extras, atomic files and output locks, the `harts` logger and the "
          "command-line argument types: the standard library and PyYAML only."),
    Layer("trees", ("harts.trees",),
          "Rollout steps: trajectories and their prefix tries, reading, writing, ingesting and synthesising steps, "
          "and where a run's steps come from (harts.trees.sources)."),
    Layer("planning", ("harts.planning",),
          "Microbatch plans and linear-attention call schedules over a step's trie (no torch)."),
    Layer("ops", ("harts.ops",),
          "Kernels beside their naive references (attention groups, KDA, conv, MoE combine, LM-head gradients); ops "
          "and runtime are one floor, ops below: runtime imports ops, never the reverse."),
    Layer("runtime", ("harts.runtime",),
          "Layouts: a plan and a trie turned into the index tensors the ops take (compact and baseline)."),
    Layer("model", ("harts.model",),
          "The hybrid KDA/MLA MoE model, its configs, decoding and Hugging Face checkpoints; never parallel/."),
    Layer("objective", ("harts.objective",),
          "Compact log-probs, GRPO/PPO losses and one training step (plan -> layout -> forward, loss, backward)."),
    Layer("parallel", ("harts.parallel",),
          "Data, tensor, expert and pipeline parallel execution of a step under torchrun."),
    Layer("rollout", ("harts.rollout",),
          "Sampling trajectories from the model through an environment (decoding), the source of harts rl's steps."),
    Layer("shared", ("harts.optim", "harts.tracking", "harts.workflow"),
          "What the training, RL and benchmark surfaces share: the optimizer and its update (optim), JSON records "
          "and W&B logging (tracking), the pipeline's GPU pool and config coercion (workflow).", isolated=True),
    Layer("engine", ("harts.api", "harts.engine", "harts.engine_memory"),
          "The library API (harts.api: a training step on an RL batch), the execution engine and its memory (peak "
          "memory, the device's, the search for the recomputed blocks that fit)."),
    Layer("surfaces", ("harts.training", "harts.rl", "harts.bench", "harts.integrations"),
          "harts train, harts rl, the benchmarks and integrations with other trainers: each on the layers below, "
          "none on another.", isolated=True),
    Layer("report", ("harts.report",), "Tables and figures from the benchmarks' records."),
    Layer("cli", ("harts.cli", "harts.__main__"), "The `harts` command line."),
)


@dataclass(frozen=True)
class Import:
    module: str
    """The importing module."""
    path: Path
    line: int
    name: str
    """What the statement names: `a.b` of `import a.b`, `a.b` of `from a import b`."""
    source: str | None
    """`a` of `from a import b` (the module loaded when `a.b` is a name in it, not a submodule); None for `import`."""

    def resolve(self, modules: dict[str, Path]) -> str | None:
        """The module the import loads, None if there is no such module."""
        if self.name in modules:
            return self.name
        return self.source if self.source in modules else None


def module_files(package_dir: Path) -> dict[str, Path]:
    """Module name -> file of every module under `package_dir` (a package is its __init__.py)."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def import_source(module: str, path: Path, node: ast.ImportFrom) -> str | None:
    """The module a from-import in `module` (the file `path`) names, its relative dots resolved."""
    if not node.level:
        return node.module
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    parts = package.split(".")
    base = ".".join(parts[: len(parts) - node.level + 1])
    return f"{base}.{node.module}" if node.module else base


def imports_of(module: str, path: Path, root: str = ROOT) -> list[Import]:
    """Every import of a `root` module anywhere in the file (module level, functions, classes, conditionals)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = import_source(module, path, node)
            named = [(source if alias.name == "*" else f"{source}.{alias.name}", source) for alias in node.names]
        else:
            continue
        found += [Import(module, path, node.lineno, name, source) for name, source in named
                  if name == root or name.startswith(root + ".")]
    return found


def layer_of(module: str, layers=LAYERS, root: str = ROOT) -> tuple[int, str] | None:
    """(rank, holder) of the module: the layer's index and the longest listed name that holds it."""
    best = None
    for rank, layer in enumerate(layers):
        for holder in layer.holds:
            if module == holder or (holder != root and module.startswith(holder + ".")):
                if best is None or len(holder) > len(best[1]):
                    best = (rank, holder)
    return best


def _where(item: Import, package_dir: Path) -> str:
    return f"{item.path.relative_to(package_dir.parent)}:{item.line}"


def check_layers(package_dir: Path, layers=LAYERS) -> list[str]:
    """One line per module without a layer, per import of no module of the package, and per import of a higher
    layer or of another package of an isolated layer."""
    root = package_dir.name
    modules = module_files(package_dir)
    problems = [f"{path.relative_to(package_dir.parent)}: module {module} is in no layer (add it to LAYERS)"
                for module, path in modules.items() if layer_of(module, layers, root) is None]
    for module, path in modules.items():
        own = layer_of(module, layers, root)
        seen = set()
        for item in imports_of(module, path, root):
            target = item.resolve(modules)
            if (item.line, target) in seen:  # `from a import b, c`: one line
                continue
            seen.add((item.line, target))
            if target is None:
                problems.append(f"{_where(item, package_dir)}: imports {item.source or item.name}, which is no module "
                                f"of {root}/")
                continue
            other = layer_of(target, layers, root)
            if own is None or other is None or target == module:
                continue
            if other[0] > own[0]:
                problems.append(f"{_where(item, package_dir)}: {module} ({layers[own[0]].name}) imports {target} "
                                f"({layers[other[0]].name}), a higher layer")
            elif other[0] == own[0] and layers[own[0]].isolated and other[1] != own[1]:
                problems.append(f"{_where(item, package_dir)}: {module} imports {target}: {own[1]} and {other[1]} "
                                f"must not import each other ({layers[own[0]].name}: share a lower layer instead)")
    return problems


def import_graph(package_dir: Path) -> dict[str, dict[str, Import]]:
    """module -> {imported module: its first import} over the package's own modules."""
    root = package_dir.name
    modules = module_files(package_dir)
    graph: dict[str, dict[str, Import]] = {module: {} for module in modules}
    for module, path in modules.items():
        for item in imports_of(module, path, root):
            target = item.resolve(modules)
            if target is not None and target != module:
                graph[module].setdefault(target, item)
    return graph


def check_cycles(package_dir: Path) -> list[str]:
    """One line per import cycle between modules (per strongly connected component: one cycle through it, each
    import named by file and line)."""
    graph = import_graph(package_dir)
    problems = []
    for component in _strongly_connected(graph):
        if len(component) < 2:
            continue
        start = min(component)
        path = _path_back(graph, start, component)
        edges = [graph[a][b] for a, b in zip(path, path[1:])]
        problems.append("import cycle: " + "; ".join(f"{_where(e, package_dir)} {e.module} imports {b}"
                                                      for e, b in zip(edges, path[1:])))
    return problems


def _strongly_connected(graph: dict[str, dict[str, Import]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative (a deep chain of imports must not hit Python's recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    advanced = True
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                components.append(component)
    return components


def _path_back(graph: dict[str, dict[str, Import]], start: str, component: set[str]) -> list[str]:
    """A shortest import chain start -> ... -> start inside the component (breadth first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(graph[node]):
                if successor == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if successor in component and successor not in previous:
                    previous[successor] = node
                    following.append(successor)
        frontier = following
    raise AssertionError(f"{start} is in a component without a cycle through it")


def test_every_module_has_a_layer_and_imports_point_down():
    problems = check_layers(PACKAGE_DIR)
    assert not problems, "\n".join(problems)


def test_no_import_cycles():
    problems = check_cycles(PACKAGE_DIR)
    assert not problems, "\n".join(problems)


def test_layer_table_is_consistent():
    holders = [holder for layer in LAYERS for holder in layer.holds]
    assert len(holders) == len(set(holders)), "a name listed in two layers"
    assert all(layer.about for layer in LAYERS)


# Small packages for the checks themselves: file -> source, under a folder named `harts`.
_CLEAN = {
    "__init__.py": "from harts import log\n",
    "log.py": "",
    "trees/__init__.py": "",
    "trees/io.py": "from harts.log import x\n",
    "planning/__init__.py": "from harts.planning.microbatch import plan\n",
    "planning/microbatch.py": "from . import plans\nfrom harts.trees import io\n\n\n"
                              "def f():\n    import harts.trees.io\n",
    "planning/plans.py": "from ..trees.io import read\n",
    "training/__init__.py": "",
    "training/loop.py": "from harts.planning import plan\n",
    "bench/__init__.py": "",
    "bench/speedup.py": "from harts.planning.microbatch import plan\n",
}
_PLANTED = {
    "module-level-wrong-way": ({"trees/io.py": "from harts.planning.microbatch import plan\n"},
                               "harts/trees/io.py:1: harts.trees.io (trees) imports harts.planning.microbatch "
                               "(planning), a higher layer"),
    "function-local-wrong-way": ({"trees/io.py": "import os\n\n\ndef read():\n    from harts.bench import speedup\n"},
                                 "harts/trees/io.py:5: harts.trees.io (trees) imports harts.bench.speedup (surfaces)"),
    "relative-wrong-way": ({"trees/io.py": "from ..planning import plans\n"},
                           "harts/trees/io.py:1: harts.trees.io (trees) imports harts.planning.plans (planning)"),
    "import-statement-wrong-way": ({"log.py": "def f():\n    import harts.trees.io as io\n"},
                                   "harts/log.py:2: harts.log (base) imports harts.trees.io (trees)"),
    "sideways": ({"bench/speedup.py": "from harts.training.loop import train\n"},
                 "harts/bench/speedup.py:1: harts.bench.speedup imports harts.training.loop: harts.bench and "
                 "harts.training must not import each other"),
    "no-such-module": ({"training/loop.py": "def f():\n    from harts.bench.records import x\n"},
                       "harts/training/loop.py:2: imports harts.bench.records, which is no module of harts/"),
    "no-layer": ({"extra.py": ""}, "harts/extra.py: module harts.extra is in no layer"),
}
_CYCLES = {
    "function-local": ({"planning/plans.py": "def f():\n    from harts.planning.microbatch import plan\n"},
                       "import cycle: harts/planning/microbatch.py:1 harts.planning.microbatch imports "
                       "harts.planning.plans; harts/planning/plans.py:2 harts.planning.plans imports "
                       "harts.planning.microbatch"),
    "three-modules": ({"trees/io.py": "from harts.trees import stats\n", "trees/stats.py": "from . import trie\n",
                       "trees/trie.py": "def f():\n    import harts.trees.io\n"},
                      "import cycle: harts/trees/io.py:1 harts.trees.io imports harts.trees.stats; "
                      "harts/trees/stats.py:1 harts.trees.stats imports harts.trees.trie; "
                      "harts/trees/trie.py:2 harts.trees.trie imports harts.trees.io"),
    "type-checking": ({"planning/plans.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                            "    from harts.planning.microbatch import Plan\n"},
                      "harts/planning/plans.py:3 harts.planning.plans imports harts.planning.microbatch"),
}
_SMALL_LAYERS = (
    Layer("base", ("harts", "harts.log"), "base"),
    Layer("trees", ("harts.trees",), "trees"),
    Layer("planning", ("harts.planning",), "planning"),
    Layer("surfaces", ("harts.training", "harts.bench"), "surfaces", isolated=True),
)


def write_package(tmp_path: Path, files: dict[str, str]) -> Path:
    """A package `ROOT` under `tmp_path` of `files` (relative path -> text): what the checks' own tests run on."""
    for name, text in files.items():
        path = tmp_path / ROOT / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path / ROOT


def _package(tmp_path: Path, changes: dict[str, str]) -> Path:
    return write_package(tmp_path, {**_CLEAN, **changes})


def test_checks_pass_a_clean_package(tmp_path):
    package_dir = _package(tmp_path, {})
    assert check_layers(package_dir, _SMALL_LAYERS) == []
    assert check_cycles(package_dir) == []


@pytest.mark.parametrize("name", _PLANTED)
def test_layer_check_names_file_line_and_module(tmp_path, name):
    changes, expected = _PLANTED[name]
    problems = check_layers(_package(tmp_path, changes), _SMALL_LAYERS)
    assert len(problems) == 1 and problems[0].startswith(expected), problems


@pytest.mark.parametrize("name", _CYCLES)
def test_cycle_check_names_every_import_of_the_cycle(tmp_path, name):
    changes, expected = _CYCLES[name]
    problems = check_cycles(_package(tmp_path, changes))
    assert len(problems) == 1 and expected in problems[0], problems
