"""The loop's course is decided in one place (`Trainer._act`, engine.trainer): commands that move
the loop return a Signal like every hook (engine.control.moves), and no other module sets a flag
of the loop or of the control plane. A rewind sent while the last boundaries drain the queue is
refused, as docs/rewind.md says: the final model is the trained one."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from contract.run_folder import read_events
from control_runs import task_files

REPO = Path(__file__).resolve().parent.parent

# what decides the loop's course: the trainer's own flags and parts, the control plane's hold
LOOP_FLAGS = {"live_settings", "paused", "stopping", "finishing", "ended", "_stopping",
              "_restart", "_pending"}


def _flag_assignments(tree: ast.AST) -> list[tuple[int, str]]:
    """`x.flag = ...` (or `x.flag += ...`) where x is not `self`, and any `trainer.attr = ...`."""
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if not isinstance(t, ast.Attribute):
                    continue
                owner = ast.unparse(t.value)
                if owner.split(".")[-1] == "trainer" or (t.attr in LOOP_FLAGS and owner != "self"):
                    found.append((t.lineno, f"{owner}.{t.attr}"))
    return found


def test_no_module_but_the_trainer_sets_a_flag_of_the_loop():
    offenders = []
    for path in sorted((REPO / "engine").rglob("*.py")):
        if path == REPO / "engine" / "trainer.py":
            continue
        for line, what in _flag_assignments(ast.parse(path.read_text(encoding="utf-8"))):
            offenders.append(f"{path.relative_to(REPO)}:{line} assigns {what}")
    assert offenders == [], "only engine/trainer.py (`_act`) changes the loop's course:\n" + "\n".join(offenders)


def test_the_check_finds_what_the_old_code_did():
    old = ("trainer.live_settings = self.settings\n"
           "trainer.control.paused = True\n"
           "self._restart, epoch = False, 1\n"
           "control.stopping = True\n")
    assert [w for _, w in _flag_assignments(ast.parse(old))] == [
        "trainer.live_settings", "trainer.control.paused", "control.stopping"]


def test_the_trainer_keeps_no_stash_and_no_restart_flag():
    source = (REPO / "engine" / "trainer.py").read_text(encoding="utf-8")
    assert "_restart" not in source and "_pending" not in source
    assert not hasattr(__import__("engine.control", fromlist=["x"]), "attach")


SCRIPT = """
import json, sys
from contract.config.load import load_config
from contract.protocol.branch_commands import Rewind
from engine.trainer import Trainer
from engine.callbacks import Callback
from engine.control.pending import Reply

replies = []

class RewindAtTheEnd(Callback):
    def on_evaluate_end(self, trainer, results):  # the evaluation at the end: the queue drains next
        if trainer.state.global_step == trainer.state.total_steps:
            trainer.control.commands.put("rewind", Rewind(target="2"), Reply("rewind", replies.append, Rewind.returns))

trainer = Trainer(config=load_config(overrides=sys.argv[1:]), callbacks=[RewindAtTheEnd()])
trainer.train()
trainer.close()
print("REPLY", json.dumps([r for r in replies if r.get("type") in ("done", "error")]), flush=True)
"""


@pytest.mark.slow
def test_a_rewind_sent_during_the_final_drain_is_refused(tmp_path):
    task = task_files(tmp_path / "task")
    env = dict(os.environ, LIVETUNE_CACHE=task["cache"], HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    args = [f"output_dir={tmp_path / 'runs'}", "run_name=drain", "max_steps=4", "batch_size=8",
            "data.max_length=32", f"data.train={task['train']}", f"data.eval={task['eval']}",
            "logging.tensorboard=false", "control.enabled=true", "eval.at_end=true", "eval.every_n_steps=0",
            "checkpoint.every_n_steps=2", "checkpoint.save_at_end=true"]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("REPLY ")]
    (reply,) = json.loads(line[len("REPLY "):])
    assert reply["type"] == "error" and "rewind: training has ended" in reply["message"], reply
    events = list(read_events(tmp_path / "runs" / "drain" / "events.jsonl"))
    assert [e for e in events if e["type"] in ("rewind", "branch")] == []
    final = [e for e in events if e["type"] == "state"][-1]
    assert (final["state"], final["step"]) == ("finished", 4)
    assert any(e["type"] == "export" and e.get("step") == 4 for e in events), "the final model is step 4's"
