"""Measures of how the code declares things once, on any checkout (run by hand):

    python bench/code_measures.py [CHECKOUT]

state / event-type / command-status string literals outside contract/ and commands' answers
read by string key in app/ or supervisor/ (the checks of tests/test_declared_once.py), events
written as dicts (`emit({...})`, `emit(dict(...))`: an event is written through its model), names re-exported by a module that does not use them, the longest
functions, and the README's length."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
PACKAGES = ("contract", "engine", "supervisor", "app")


def main(root: Path) -> None:
    spec = importlib.util.spec_from_file_location("declared_once", HERE / "tests" / "test_declared_once.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    check.ROOT = root
    reexported, functions = 0, []
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            tree = ast.parse(path.read_text())
            functions += [(n.end_lineno - n.lineno + 1, f"{path.relative_to(root)}:{n.name}") for n in ast.walk(tree)
                          if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            if path.name == "__init__.py":
                continue  # a package's public names
            used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
            for node in tree.body:
                if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
                    reexported += sum(1 for a in node.names if (a.asname or a.name) not in used)
    functions.sort(reverse=True)
    print(f"state / event-type / status literals outside contract/: {len(check.literals_outside_the_contract())}")
    keyed = check.answers_read_by_key()
    print(f"answers read by string key in app/ or supervisor/: {len(keyed)}"
          + (f" ({', '.join(keyed)})" if keyed else ""))
    dict_events = check.events_written_as_dicts()
    print(f"events written as dicts: {len(dict_events)}" + (f" ({', '.join(dict_events)})" if dict_events else ""))
    print(f"names imported from our packages and not used where imported (re-exports): {reexported}")
    print("longest functions: " + ", ".join(f"{name} ({lines} lines)" for lines, name in functions[:5]))
    print(f"README.md: {len((root / 'README.md').read_text().splitlines())} lines")


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else HERE)
