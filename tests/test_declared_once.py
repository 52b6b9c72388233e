"""Run states, event types and command statuses are enums declared once in contract/; outside it
they are used through the enum, never spelled as string literals (a typo in a literal compares
false forever; a typo in an enum member fails at import). Commands' answers are models
(contract.protocol.answers): app/ and supervisor/ read their fields, never `answer["step"]`. Events
are written through their models (contract.events), never as a dict; so are the control socket's
frames (contract.protocol.frames: ack, token, done, error, event)."""

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


# the client's verbs (supervisor.client.RunClient, the notebook's Run, app.session.Session.send):
# what they return is a command's answer model
VERBS = {"send", "command", "pause", "resume", "save", "evaluate", "set", "status", "rewind", "branch",
         "snapshot", "branches", "add_source", "set_weight", "remove_source", "teach", "prefer", "inbox",
         "forget", "wait"}


def answers_read_by_key() -> list[str]:
    """Each `answer["step"]` / `answer.get("step")` in app/ and supervisor/ where `answer` is what a
    verb returned (or a generation's `.result`), or a parameter annotated as an answer model."""
    found = []
    for package in ("app", "supervisor"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for function in ast.walk(ast.parse(path.read_text())):
                if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found += [f"{path.relative_to(ROOT)}:{line} {text}" for line, text in _key_reads(function)]
    return found


def _key_reads(function: ast.AST):
    names = {a.arg for a in ast.walk(function) if isinstance(a, ast.arg) and a.annotation is not None
             and ast.unparse(a.annotation).endswith("Answer")}
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and _is_answer(node.value, set()):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    for node in ast.walk(function):
        keyed = None
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_text(node.slice):
            keyed = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and node.args and _is_text(node.args[0]):
            keyed = node.func.value
        if keyed is not None and _is_answer(keyed, names):
            yield node.lineno, ast.unparse(node)


def _is_answer(node: ast.AST, names: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in names
    if isinstance(node, ast.Attribute):  # generation.result
        return node.attr == "result"
    if isinstance(node, ast.BoolOp):  # generation.result or {}
        return any(_is_answer(v, names) for v in node.values)
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in VERBS


def _is_text(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def test_no_answer_read_by_string_key_in_app_or_supervisor():
    assert answers_read_by_key() == []


def test_the_check_finds_an_answer_read_by_key():
    tree = ast.parse('def f(client, g, shown: SetAnswer):\n    r = client.set(lr=1)\n    s = client.status()\n'
                     '    x = {"a": 1}\n    return r["changes"], s.get("step"), g.result["text"], shown["step"], '
                     'client.pause()["state"], x["a"], r.changes\n')
    found = [text for _, text in _key_reads(tree.body[0])]
    assert sorted(found) == sorted(["r['changes']", "s.get('step')", "g.result['text']", "shown['step']",
                                    "client.pause()['state']"])


def test_no_state_event_type_or_status_literal_outside_the_contract():
    assert literals_outside_the_contract() == []


def test_the_check_finds_a_literal():
    tree = ast.parse('if event["type"] == "train" and event.get("state") in ("running", "x"):\n    pass\n'
                     'emit({"type": "state", "status": "done"})\n')
    found = sorted((what, value) for node in ast.walk(tree) for what, value, _ in _uses(node))
    assert found == [("state", "running"), ("status", "done"), ("type", "state"), ("type", "train")]


def events_written_as_dicts() -> list[str]:
    """Each `emit({...})` / `emit(dict(...))` in the product's packages: an event is built as its
    model (contract.events), so a wrong field fails where it is written."""
    found = []
    for package in ("app", "supervisor", "engine", "contract"):
        for path in sorted((ROOT / package).rglob("*.py")):
            found += [f"{path.relative_to(ROOT)}:{line}" for line in _emits_a_dict(ast.parse(path.read_text()))]
    return found


def _emits_a_dict(tree: ast.AST) -> list[int]:
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "emit"
            and node.args and (isinstance(node.args[0], ast.Dict) or
                               (isinstance(node.args[0], ast.Call) and isinstance(node.args[0].func, ast.Name)
                                and node.args[0].func.id == "dict"))]


def test_no_event_written_as_a_dict():
    assert events_written_as_dicts() == []


def test_the_check_finds_an_event_written_as_a_dict():
    tree = ast.parse('log.emit({"type": "x"})\nself.events.emit(dict(type="x"))\nctx.emit(TrainEvent(step=1))\n')
    assert _emits_a_dict(tree) == [1, 2]


FRAME_TYPES = {"ack", "token", "done", "error", "event"}


def frames_spelled_as_dicts(tree: ast.AST) -> list[int]:
    """Each `{"type": "done", ...}`-style dict literal: a frame is built as its model, so a missing
    or misspelt field fails where it is made, not in a client."""
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Dict)
            and any(isinstance(k, ast.Constant) and k.value == "type" and isinstance(v, ast.Constant)
                    and v.value in FRAME_TYPES for k, v in zip(node.keys, node.values))]


def test_no_frame_spelled_as_a_dict():
    found = []
    for package in ("app", "supervisor", "engine"):
        for path in sorted((ROOT / package).rglob("*.py")):
            found += [f"{path.relative_to(ROOT)}:{line}" for line in frames_spelled_as_dicts(ast.parse(path.read_text()))]
    assert found == []


def test_the_check_finds_a_frame_spelled_as_a_dict():
    tree = ast.parse('send({"type": "done", "result": {}})\nx = {"type": "train"}\nsend(Done(result={}))\n')
    assert frames_spelled_as_dicts(tree) == [1]
