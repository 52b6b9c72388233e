"""The shape of the code: which package may import which, no import cycles, and a
type checker on the torch-free packages.

Every `import` and `from ... import` anywhere in a file counts: at the top, inside functions
(lazy imports), under `if TYPE_CHECKING:` and in `try` blocks, relative imports resolved; a
failure lists each offending import as file:line, marked [lazy] or [type-checking] where it is
one. A type-only import is counted too: it is still a dependency of the design (a Protocol
declared in the lower module, or the type moved down, breaks such a circle). An import names the
most specific module of ours it reaches (`from engine.checkpoint import models` ->
engine.checkpoint.models; `from engine.checkpoint import save_model` -> engine.checkpoint), as
import-linter does; the parent packages whose `__init__` runs on the way are not counted as
edges, so a package `__init__` that re-exports its modules does not make every module a cycle.

The allowed directions:

    app (front ends: app.web, app.notebook, app.cli)  ->  supervisor  ->  contract
    engine                                            ->  contract

contract imports nothing of ours; supervisor and app never import the engine, torch, deepspeed
or the libraries that import torch (they start `python -m engine.worker` as a process); the
front ends (app.web, app.notebook, app.cli) never import one another, only the app modules they
share; the engine never imports gradio, ipywidgets, app or supervisor; within the engine only
the entry points (engine.worker, the `engine` package's lazy `Trainer` export) may import
engine.trainer, nothing below the trainer reaches back up to it (the composition root,
engine.assembly, is called by the Trainer's constructor and never imports it); and no module is
in an import cycle with another.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("contract", "supervisor", "engine", "app")

# Which of our packages each package may import (itself included).
ALLOWED: dict[str, set[str]] = {
    "contract": {"contract"},
    "supervisor": {"supervisor", "contract"},
    "engine": {"engine", "contract"},
    "app": {"app", "supervisor", "contract"},
}
# Outside libraries a package must never import (top-level names). The torch-free packages
# also stay clear of the libraries that import torch themselves.
TORCH = {"torch", "deepspeed", "transformers", "peft", "accelerate"}
UI = {"gradio", "ipywidgets"}
FORBIDDEN_LIBS: dict[str, set[str]] = {
    "contract": TORCH | UI,
    "supervisor": TORCH | UI,
    "engine": UI,
    "app": TORCH,
}
# The front ends: none imports another; what they share (app.session, app.form, app.series)
# imports none of them. `python -m app` (app.__main__) serves the web app.
FRONT_ENDS = {"app.web": ("app.web", "app.__main__"), "app.notebook": ("app.notebook",),
              "app.cli": ("app.cli",)}
TRAINER = "engine.trainer"
# The entry points: the only modules that may import the trainer.
MAY_IMPORT_TRAINER = {"engine", "engine.worker"}


@dataclass(frozen=True)
class Edge:
    """One import statement's target: `source` (a module of ours) imports `target`."""
    source: str
    target: str
    file: str
    line: int
    kind: str = ""  # "lazy" (inside a function), "type-checking" (under `if TYPE_CHECKING:`), or ""

    def where(self) -> str:
        how = f" [{self.kind}]" if self.kind else ""
        return f"{self.file}:{self.line}: {self.source} imports {self.target}{how}"


def module_files() -> dict[str, Path]:
    """Every module of our packages by dotted name (a package by its name, for `__init__.py`)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _base_of_relative(module: str, is_package: bool, level: int) -> str:
    """The package a relative import with `level` dots starts from."""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    return ".".join(parts[:len(parts) - (level - 1)])


def _ours(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is a module of ours; None for outside libraries."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> list[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement in the tree with how it runs: "", "lazy" or "type-checking"."""
    found: list[tuple[ast.Import | ast.ImportFrom, str]] = []

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, kind))
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), "type-checking")
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), kind)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, kind or "lazy")
            else:
                visit(child, kind)

    visit(tree, "")
    return found


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> tuple[list[Edge], list[Edge]]:
    """(imports of our modules, imports of outside libraries by top-level name) in one file,
    one edge per imported module and statement."""
    tree = ast.parse(path.read_text(), filename=str(path))
    file = str(path.relative_to(REPO))
    ours: set[Edge] = set()
    libs: set[Edge] = set()

    def add(name: str, line: int, kind: str) -> None:
        target = _ours(name, modules)
        if target is None:
            libs.add(Edge(module, name.split(".")[0], file, line, kind))
        elif target != module:
            ours.add(Edge(module, target, file, line, kind))

    for node, kind in _import_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno, kind)
            continue
        base = node.module or ""
        if node.level:
            start = _base_of_relative(module, path.name == "__init__.py", node.level)
            base = ".".join(p for p in (start, base) if p)
        for alias in node.names:  # `from pkg import mod` imports the module pkg.mod
            full = f"{base}.{alias.name}"
            add(full if full in modules else base, node.lineno, kind)
    key = lambda e: (e.line, e.target)  # noqa: E731
    return sorted(ours, key=key), sorted(libs, key=key)


def import_graph() -> tuple[list[Edge], list[Edge], dict[str, Path]]:
    modules = module_files()
    ours, libs = [], []
    for module, path in modules.items():
        o, lib = imports_of(module, path, modules)
        ours += o
        libs += lib
    return ours, libs, modules


def strongly_connected(nodes: list[str], edges: list[Edge]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), those with more than one module."""
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    for e in edges:
        if e.target in succ and e.target not in succ[e.source]:
            succ[e.source].append(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(succ[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(succ[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def _package(module: str) -> str:
    return module.split(".")[0]


# -- the tests ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_the_graph_sees_lazy_relative_and_type_checking_imports(graph):
    """The parser itself: a few imports known to exist are found, whatever their form."""
    ours, libs, modules = graph
    assert {"contract.config.schema", "supervisor.launch", "engine.worker", "app.web"} <= set(modules)
    assert len(modules) > 60 and len(ours) > 150
    assert any(e.source == "engine.worker" and e.target == "contract.config.load" and e.kind == ""
               for e in ours)  # top level
    assert any(e.source == "engine.worker" and e.target.startswith("engine.") and e.kind == "lazy"
               for e in ours)  # inside run()
    assert any(e.source.startswith("supervisor") and e.target == "contract.config.schema" for e in ours)
    assert any(e.source.startswith("engine") and e.target == "torch" for e in libs)
    cycle = [Edge("a", "b", "f", 1), Edge("b", "c", "f", 2), Edge("c", "a", "f", 3), Edge("c", "d", "f", 4)]
    assert strongly_connected(["a", "b", "c", "d"], cycle) == [["a", "b", "c"]]
    assert _base_of_relative("engine.control.plane", False, 1) == "engine.control"
    assert _base_of_relative("engine.control", True, 2) == "engine"
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\n"
              "def f():\n    import b\nimport c\n")
    assert [(n.names[0].name, kind) for n, kind in _import_nodes(ast.parse(source))][1:] == [
        ("a", "type-checking"), ("b", "lazy"), ("c", "")]


def test_packages_import_only_in_the_allowed_directions(graph):
    ours, libs, _ = graph
    wrong = [f"{e.where()}  ({_package(e.source)} may import only {sorted(ALLOWED[_package(e.source)])})"
             for e in ours if _package(e.target) not in ALLOWED[_package(e.source)]]
    wrong += [f"{e.where()}  (no {e.target} in {_package(e.source)})"
              for e in libs if e.target in FORBIDDEN_LIBS[_package(e.source)]]
    assert not wrong, f"{len(wrong)} imports break the package rules:\n" + "\n".join(wrong)


def _front_end(module: str) -> str | None:
    for front_end, roots in FRONT_ENDS.items():
        if any(module == root or module.startswith(root + ".") for root in roots):
            return front_end
    return None


def test_front_ends_share_only_the_common_app_modules(graph):
    ours, _, _ = graph
    wrong = [f"{e.where()}  ({_front_end(e.source) or 'shared app code'} imports the front end "
             f"{_front_end(e.target)})" for e in ours
             if e.source.startswith("app") and _front_end(e.target) not in (None, _front_end(e.source))]
    assert not wrong, f"{len(wrong)} imports between front ends:\n" + "\n".join(wrong)


def test_nothing_below_the_trainer_imports_it(graph):
    ours, _, _ = graph
    wrong = [f"{e.where()}  (only {sorted(MAY_IMPORT_TRAINER)} may import the trainer)"
             for e in ours if e.target == TRAINER and e.source not in MAY_IMPORT_TRAINER]
    assert not wrong, f"{len(wrong)} imports of {TRAINER} from below:\n" + "\n".join(wrong)


def test_no_import_cycles(graph):
    ours, _, modules = graph
    cycles = strongly_connected(sorted(modules), ours)
    report = []
    for members in cycles:
        inside = set(members)
        lines = sorted({e.where() for e in ours if e.source in inside and e.target in inside})
        report.append(f"cycle of {len(members)} modules: {', '.join(members)}\n    " + "\n    ".join(lines))
    assert not cycles, f"{len(cycles)} import cycles (the imports inside each):\n" + "\n".join(report)


@pytest.mark.slow
def test_mypy_passes_on_contract_and_supervisor():
    proc = subprocess.run([sys.executable, "-m", "mypy", "contract", "supervisor"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"mypy contract supervisor:\n{proc.stdout}{proc.stderr}"
