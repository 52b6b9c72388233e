"""The run folder as a branch tree (contract.branches), the commands' validation and the keep
rules' fork points -- torch-free, no process group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contract.branches import (ROOT, BranchTree, attributed, branch_events, check_name, checkpoints_dir,
                               names_branch, path_events, resume_problem)
from contract.config.schema import ConfigError
from contract.config.load import load_config
from contract.protocol.commands import ALLOWED_COMMANDS, command_from_wire
from contract.protocol.states import RunState
from contract.protocol.branch_commands import Branch, Rewind, Snapshot
from contract.protocol.base import ProtocolError
from contract.run_folder import EventLog, RunFolder


def test_names_are_checked():
    assert check_name("low-lr_2.b") == "low-lr_2.b"
    for bad in ("", "-x", "a/b", "..", "a..b", "x" * 65, "sp ace"):
        with pytest.raises(ValueError, match="not allowed"):
            check_name(bad)


def test_commands_validate_and_round_trip():
    b = Branch(target="step-4", branch="low", lr=1e-4, save_every_n_steps=2)
    assert b.to_wire() == {"cmd": "branch", "args": {"target": "step-4", "branch": "low", "lr": 1e-4,
                                                      "save_every_n_steps": 2}}
    assert b.settings() == {"lr": 1e-4, "save_every_n_steps": 2}
    assert command_from_wire("branch", b.args()) == b
    assert command_from_wire("snapshot", {}) == Snapshot()
    with pytest.raises(ProtocolError, match="branch: branch name 'a/b' is not allowed"):
        Branch(target="4", branch="a/b")
    with pytest.raises(ProtocolError, match="rewind: argument 'target' must name"):
        Rewind(target=" ")
    with pytest.raises(ProtocolError, match="'lr' must be at least 0.0"):
        Branch(target="4", branch="x", lr=-1.0)
    with pytest.raises(ProtocolError, match="unknown argument 'name'"):
        command_from_wire("snapshot", {"name": "x"})
    for state in (RunState.RUNNING, RunState.PAUSED):
        assert {"rewind", "branch", "snapshot", "branches"} <= ALLOWED_COMMANDS[state]
    assert "rewind" not in ALLOWED_COMMANDS[RunState.STOPPING]


def test_tree_records_parents_and_forks(tmp_path):
    tree = BranchTree.load(tmp_path)
    assert list(tree.branches) == [ROOT] and tree.current == ROOT
    tree.add("a", ROOT, 4, "file:///run/checkpoints/step-4", {"lr": 0.1})
    tree.add("b", "a", 8, "snapshot:s8")
    tree.current = "b"
    tree.save(tmp_path)
    again = BranchTree.load(tmp_path)
    assert again.current == "b" and again.ancestry("b") == [ROOT, "a", "b"]
    assert again.branches["a"].settings == {"lr": 0.1} and again.children(ROOT) == ["a"]
    assert again.fork_sources() == {"file:///run/checkpoints/step-4"}  # snapshots are no files
    with pytest.raises(ValueError, match="exists already"):
        again.add("a", ROOT, 2, "")
    with pytest.raises(ValueError, match="no branch named 'zz'"):
        again.add("c", "zz", 2, "")
    assert checkpoints_dir(tmp_path, ROOT) == tmp_path / "checkpoints"
    assert checkpoints_dir(tmp_path, "a") == tmp_path / "branches" / "a" / "checkpoints"


def _history() -> list[dict]:
    """main trains 1..6, rewinds to 2, trains 3..5, branch b forks from main's step 4 (leaving
    main at 5), b trains 5..6; a manager event without a branch field comes last."""
    ev = [{"type": "train", "step": s} for s in range(1, 7)]
    ev.append({"type": "rewind", "step": 2, "abandoned": [3, 6], "branch": ROOT})
    ev += [{"type": "train", "step": s} for s in range(3, 6)]
    ev.append({"type": "branch", "branch": "b", "parent": ROOT, "step": 4, "abandoned": [5, 5]})
    ev += [{"type": "train", "step": s, "branch": "b"} for s in (5, 6)]
    ev.append({"type": "state", "state": "finished"})
    return ev


def test_events_by_branch_alone_and_from_the_root():
    events = _history()
    tree = BranchTree()
    tree.add("b", ROOT, 4, "x")
    assert [b for b, _ in attributed(events)][-1] == "b"  # untagged, after the branch: b's
    main = branch_events(events, ROOT)
    assert [e["step"] for e in main if e["type"] == "train"] == [1, 2, 3, 4, 5, 6, 3, 4, 5]
    assert [e["step"] for e in path_events(events, ROOT, tree) if e["type"] == "train"] == [1, 2, 3, 4, 5]
    path_b = path_events(events, "b", tree)
    assert [e["step"] for e in path_b if e["type"] == "train"] == [1, 2, 3, 4, 5, 6]
    assert [e.get("branch", ROOT) for e in path_b if e["type"] == "train"] == [ROOT] * 4 + ["b"] * 2


def test_event_log_tags_events_once_branched(tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    log.emit({"type": "train", "step": 1})
    log.branch = "b"
    log.emit({"type": "train", "step": 2})
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert "branch" not in lines[0] and lines[1]["branch"] == "b"
    assert RunFolder(tmp_path, branch="b").checkpoints == tmp_path / "branches" / "b" / "checkpoints"


def test_keep_rules_never_delete_a_fork_point():
    from engine.checkpoint.schedule import to_delete  # imports no torch at module level? it does; fine
    ck = [{"name": f"step-{s}", "step": s, "saved_by": "schedule", "metrics": {}, "url": f"file:///r/step-{s}"}
          for s in (2, 4, 6, 8)]
    assert to_delete(ck, 1, 0, "eval/loss", "min") == ["step-2", "step-4", "step-6"]
    assert to_delete(ck, 1, 0, "eval/loss", "min", {"file:///r/step-4"}) == ["step-2", "step-6"]


def test_resume_names_a_branch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert names_branch("low") and not names_branch("latest") and not names_branch("a/b")
    (tmp_path / "low").mkdir()
    assert not names_branch("low")  # an existing folder is a path
    runs = tmp_path / "runs"
    assert "name its run" in resume_problem(str(runs), "", "b")
    assert "no run 'r1'" in resume_problem(str(runs), "r1", "b")
    (runs / "r1").mkdir(parents=True)
    (runs / "r1" / "events.jsonl").write_text("")
    assert "has no such branch (it has main)" in resume_problem(str(runs), "r1", "b")
    tree = BranchTree()
    tree.add("b", ROOT, 4, "x")
    tree.save(runs / "r1")
    assert resume_problem(str(runs), "r1", "b") is None
    cfg = load_config(overrides=[f"output_dir={runs}", "run_name=r1", "resume=b"])
    assert cfg.resume == "b"  # stays a name, not made a path
    with pytest.raises(ConfigError, match="resume: no checkpoint folder 'c', and run 'r1' has no such branch"):
        load_config(overrides=[f"output_dir={runs}", "run_name=r1", "resume=c"])
    assert Path(cfg.logging.output_dir) == runs


def test_client_and_notebook_refuse_bad_arguments_before_sending(tmp_path):
    """RunClient and the notebook's Run build the contract's commands: a bad argument is refused
    with the field named, before anything reaches a run (there is none here)."""
    from app.notebook.api import Run
    from app.session import Session, SessionError
    from contract.run_folder import make_run_folder
    from supervisor.client import CommandError, RunClient

    folder = make_run_folder(load_config(overrides=[f"output_dir={tmp_path}", "run_name=r"]))
    folder.events.write_text(json.dumps({"type": "state", "state": "finished", "time": 0.0}) + "\n")
    client = RunClient(folder.root)
    with pytest.raises(CommandError, match="branch: branch name 'a/b' is not allowed"):
        client.branch(4, "a/b")
    with pytest.raises(CommandError, match="rewind: argument 'target' must name"):
        client.rewind("")
    with pytest.raises(CommandError, match="branch: unknown argument 'momentum'"):
        client.branch("step-4", "b", momentum=0.9)
    run = Run(folder.root, Session(tmp_path))
    with pytest.raises(SessionError, match="snapshot: snapshot name '../x' is not allowed"):
        run.snapshot("../x")
    with pytest.raises(SessionError, match="branch: argument 'lr_scale' must be above 0.0"):
        run.branch(4, "b", lr_scale=0)
