"""One set of verbs: the same bad input gets the same words from every front end (the Python
client, the notebook's Run, the web app's API and learning-rate box, the terminal), because
each builds the same contract.protocol command, whose model refuses it. No run is needed: a bad
argument is refused before anything is sent."""

from __future__ import annotations

import inspect

import gradio as gr
import pytest

from app.cli import main
from app.lr_box import lr_from_box
from app.notebook.api import Run
from app.session import SessionError
from app.session_verbs import SessionVerbs
from app.web import api
from app.web.backend import Backend
from contract.protocol.base import ProtocolError
from contract.protocol.commands import Set
from contract.run_folder import RunFolder
from supervisor.client import CommandError, RunClient, Verbs


def _run() -> Run:
    """A notebook Run whose verbs are called without a run: the command is refused while it is
    built, before the run (its session, its handle) is ever asked."""
    return object.__new__(Run)


def _words(lr: float = -1) -> str:
    with pytest.raises(ProtocolError) as refused:
        Set(lr=lr)
    return str(refused.value)


def test_a_bad_learning_rate_gets_the_same_words_everywhere(tmp_path, capsys):
    words = _words()
    assert words == "set: argument 'lr' must be at least 0.0 and at most 10.0, got -1"
    folder = RunFolder(tmp_path / "runs" / "r").create()

    with pytest.raises(CommandError) as client:  # Python
        RunClient(folder.root).set(lr=-1)
    with pytest.raises(SessionError) as notebook:  # the notebook
        _run().set(lr=-1)
    with pytest.raises(SessionError) as box:  # the web page's and the panel's learning-rate box
        lr_from_box("-1", confirmed=True)
    backend = Backend(tmp_path / "runs")
    try:
        with gr.Blocks() as blocks:
            api.register(backend)
        endpoint = next(f.fn for f in blocks.fns.values() if f.api_name == "set")
        with pytest.raises(gr.Error) as web:  # the web app's API (gradio_client's /set)
            endpoint(str(folder.root), lr=-1)
    finally:
        backend.close()
    with pytest.raises(SystemExit) as ended:  # the terminal
        main(["command", str(folder.root), "set", "lr=-1"])
    terminal = capsys.readouterr().err.strip()

    assert ended.value.code == 2
    assert [str(client.value), str(notebook.value), web.value.message, terminal] == [words] * 4
    assert str(box.value) == _words(-1.0)  # a box's text is read as a float


def _endpoints(tmp_path) -> tuple[Backend, dict]:
    """The web app's API endpoints by name (their functions, called as gradio_client's calls run them)."""
    backend = Backend(tmp_path / "runs")
    with gr.Blocks() as blocks:
        api.register(backend)
    return backend, {f.api_name: f.fn for f in blocks.fns.values() if f.api_name}


def test_a_bad_source_weight_gets_the_same_words_everywhere(tmp_path, capsys):
    folder = RunFolder(tmp_path / "runs" / "r").create()
    words = "add_source: argument 'weight' must be at least 0.0 and at most 1000000000.0, got -2"
    with pytest.raises(CommandError) as client:
        RunClient(folder.root).add_source("x.jsonl", weight=-2)
    with pytest.raises(SessionError) as notebook:
        _run().add_source("x.jsonl", weight=-2)
    backend, endpoints = _endpoints(tmp_path)
    try:
        with pytest.raises(gr.Error) as web:
            endpoints["add_source"]("x.jsonl", run=str(folder.root), weight=-2)
    finally:
        backend.close()
    with pytest.raises(SystemExit):
        main(["command", str(folder.root), "add_source", "path=x.jsonl", "weight=-2"])
    terminal = capsys.readouterr().err.strip()
    assert [str(client.value), str(notebook.value), web.value.message, terminal] == [words] * 4


def test_a_set_of_nothing_gets_the_same_words_everywhere(tmp_path, capsys):
    """Set's own rule (name at least one field), not a message of each front end's."""
    with pytest.raises(ProtocolError) as model:
        Set()
    folder = RunFolder(tmp_path / "runs" / "r").create()
    with pytest.raises(CommandError) as client:
        RunClient(folder.root).set()
    with pytest.raises(SessionError) as notebook:
        _run().set()
    backend, endpoints = _endpoints(tmp_path)
    try:
        with pytest.raises(gr.Error) as web:
            endpoints["set"](str(folder.root))
    finally:
        backend.close()
    with pytest.raises(SystemExit):
        main(["command", str(folder.root), "set"])
    terminal = capsys.readouterr().err.strip()
    assert str(model.value).startswith("set: name at least one of lr, ")
    assert [str(client.value), str(notebook.value), web.value.message, terminal] == [str(model.value)] * 4


def test_the_web_set_takes_the_fields_of_set(tmp_path):
    """/set's parameters are Set's fields (a new live setting is an argument at once), gradio's
    positional call reaches the verb as its keyword call does."""
    backend, endpoints = _endpoints(tmp_path)
    try:
        endpoint = endpoints["set"]
        assert list(inspect.signature(endpoint).parameters) == ["run", *Set.model_fields]
        folder = RunFolder(tmp_path / "runs" / "r").create()
        with pytest.raises(gr.Error) as positional:  # run, lr as gradio passes them: in order
            endpoint(str(folder.root), 11.0)
    finally:
        backend.close()
    assert positional.value.message == _words(11.0)


def test_the_notebook_and_the_web_call_the_clients_verbs():
    """One set of verbs: the notebook's Run and the web API's SessionVerbs inherit the client's
    methods and override none of them (the Run adds what a notebook needs, e.g. `entries`; its
    `stop` also ends the processes)."""
    shared = [name for name, _ in inspect.getmembers(Verbs, inspect.isfunction) if not name.startswith("_")]
    assert {"pause", "set", "add_source", "teach", "rewind", "generate"} <= set(shared)
    for front in (RunClient, SessionVerbs, Run):
        assert issubclass(front, Verbs)
    own = {name for name in shared if name in vars(Run) or name in vars(SessionVerbs)}
    assert own == {"send", "stream"}


def test_the_notebook_and_the_web_api_build_no_command_of_their_own():
    """Their commands are built by the verbs alone: they import no command class but Set (whose
    fields /set takes) and Stop (whose default `save` they show). So do the web page's handlers
    of the Train, Chat, Data and Checkpoints tabs (Backend.verbs)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    for module in ("app/notebook/api.py", "app/web/api.py", "app/web/train.py", "app/web/chat.py",
                   "app/web/data.py", "app/web/branches.py"):
        tree = ast.parse((root / module).read_text())
        commands = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    and (node.module or "").startswith("contract.protocol.") and node.module.endswith("commands")
                    for alias in node.names}
        assert commands <= {"Set", "Stop"}, (module, commands)


@pytest.mark.parametrize("value, words", [
    (float("nan"), "must be a number, got nan (nan and inf are not numbers)"),
    (True, "must be a number, got True (true / false is not a number)"),
    ("fast", "must be a number, got 'fast'"),
    (-1.0, "must be at least 0.0"),
])
def test_the_config_and_the_commands_say_a_bad_value_in_the_same_words(value, words):
    """One translator of pydantic's errors (contract.validation_words): the learning rate in the
    config file and in a `set` command is refused in the same words; only the place is named as
    each names it (the config key, the command's argument)."""
    from contract.config.checks import build
    _, problems = build({"optim": {"lr": value}})
    assert [(key, text[:len(words)]) for key, text in problems] == [("optim.lr", words)]
    with pytest.raises(ProtocolError) as refused:
        Set(lr=value)
    assert str(refused.value).startswith(f"set: argument 'lr' {words}")
