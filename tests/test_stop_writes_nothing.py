"""`stop` with save=false writes nothing -- no checkpoint (not even the schedule's end-of-training
one), no final model. A real 1-rank run, stopped through the control plane's queue at step 2 of
20, with a checkpoint schedule and checkpoint.save_at_end on. (A plain stop's checkpoint and
model: tests/test_stop_everywhere.py.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from contract.run_folder import read_events
from control_runs import task_files

REPO = Path(__file__).resolve().parent.parent

SCRIPT = """
import json, sys
from contract.config.load import load_config
from contract.protocol.commands import Stop
from engine import Trainer
from engine.callbacks import Callback
from engine.control.pending import Reply

save, replies = json.loads(sys.argv[1]), []

class StopAtTwo(Callback):
    def on_train_batch_end(self, trainer, loss):
        if trainer.state.global_step == 2:
            trainer.control.commands.put("stop", Stop(save=save), Reply("stop", replies.append, Stop.returns))

trainer = Trainer(config=load_config(overrides=sys.argv[2:]), callbacks=[StopAtTwo()])
trainer.train()
trainer.close()
print("REPLY", json.dumps([r for r in replies if r.get("type") == "done"]), flush=True)
"""


def _run(tmp_path: Path, task: dict, name: str, save: bool) -> tuple[Path, dict]:
    env = dict(os.environ, LIVETUNE_CACHE=task["cache"], HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    args = [f"output_dir={tmp_path / 'runs'}", f"run_name={name}", "max_steps=20", "batch_size=8",
            "data.max_length=32", f"data.train={task['train']}", f"data.eval={task['eval']}",
            "logging.tensorboard=false", "control.enabled=true", "eval.at_end=false",
            "checkpoint.every_n_steps=5", "checkpoint.save_at_end=true"]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(save), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("REPLY ")]
    (reply,) = json.loads(line[len("REPLY "):])
    return tmp_path / "runs" / name, reply["result"]


@pytest.mark.slow
def test_stop_without_save_writes_nothing(tmp_path):
    task = task_files(tmp_path / "task")
    folder, result = _run(tmp_path, task, "unsaved", save=False)
    assert (result["checkpoint"], result["final_model"]) == (None, False)
    events = list(read_events(folder / "events.jsonl"))
    assert max(e["step"] for e in events if e["type"] == "train") == 2
    assert [e for e in events if e["type"] in ("checkpoint", "export")] == []
    assert not any((folder / "checkpoints").glob("step-*")), list((folder / "checkpoints").iterdir())
    assert not (folder / "model").exists() or not any((folder / "model").iterdir())
