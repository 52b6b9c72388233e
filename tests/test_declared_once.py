"""Run states, event types and command statuses are enums declared once in contract/; outside it
they are used through the enum, never spelled as string literals (a typo in a literal compares
false forever; a typo in an enum member fails at import)."""

import ast
from pathlib import Path

from contract.events import CommandStatus, EventType
from contract.protocol.states import RunState

ROOT = Path(__file__).resolve().parent.parent
SPELLED = {"state": {s.value for s in RunState}, "type": {t.value for t in EventType},
           "status": {c.value for c in CommandStatus}}


def literals_outside_the_contract() -> list[str]:
    """Each `"running"`-style literal compared with, or stored as, a state / type / status."""
    found = []
    for package in ("app", "supervisor", "engine"):
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                for what, value, line in _uses(node):
                    found.append(f"{path.relative_to(ROOT)}:{line} {what} {value!r}")
    return found


def _uses(node: ast.AST):
    if isinstance(node, ast.Dict):  # {"type": "train", "state": "running", "status": "done"}
        for key, value in zip(node.keys, node.values):
            if isinstance(key, ast.Constant) and key.value in SPELLED and _is(value, key.value):
                yield key.value, value.value, value.lineno
    if isinstance(node, ast.Compare):  # kind == "train", event.get("state") in ("a", "b")
        operands = [node.left, *node.comparators]
        for operand in operands:
            others = " ".join(ast.unparse(o) for o in operands if o is not operand)
            constants = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
            for constant in constants:
                for what in SPELLED:
                    mentioned = what in others or (what == "type" and "kind" in others)
                    if mentioned and _is(constant, what):
                        yield what, constant.value, constant.lineno


def _is(node: ast.AST, what: str) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in SPELLED[what]


def test_no_state_event_type_or_status_literal_outside_the_contract():
    assert literals_outside_the_contract() == []


def test_the_check_finds_a_literal():
    tree = ast.parse('if event["type"] == "train" and event.get("state") in ("running", "x"):\n    pass\n'
                     'emit({"type": "state", "status": "done"})\n')
    found = sorted((what, value) for node in ast.walk(tree) for what, value, _ in _uses(node))
    assert found == [("state", "running"), ("status", "done"), ("type", "state"), ("type", "train")]
