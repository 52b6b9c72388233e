"""A Trainer built from a config in a plain script is the same run as a launched one:
on 2 ranks, `Trainer(config=cfg).train()` writes the config's scheduled checkpoints, answers a
chat through control.json (supervisor.client.RunClient from this process), saves the final
model, and a second script with `resume=latest` goes on from the newest checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from dist_utils import REPO_ROOT, SCRIPTS, deepspeed_command, tail

RUN = "script"  # the run_name the script's config gives


def start(out: Path, max_steps: int, resume: str = "") -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    args = ["--out", str(out), "--max-steps", str(max_steps), *(["--resume", resume] if resume else [])]
    return subprocess.Popen(deepspeed_command(SCRIPTS / "trainer_script.py", 2, args), cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 600) -> None:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        raise AssertionError(f"the script ran past {timeout} s\n{tail(out)}") from None
    assert proc.returncode == 0, f"the script failed ({proc.returncode})\n{tail(out)}"


def events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_script_trainer_checkpoints_chats_saves_and_resumes(tmp_path):
    from supervisor.client import RunClient

    run = tmp_path / RUN
    proc = start(tmp_path, max_steps=4)
    try:
        with RunClient.connect(run, timeout=300) as client:
            paused = client.pause()             # taken at the next step boundary, and held
            answer = client.generate("abc", max_new_tokens=6)
            text, step = answer.text, answer.step
            client.resume()
    finally:
        finish(proc)
    assert 0 <= paused.step < 4 and step == paused.step  # answered while paused there
    assert isinstance(text, str)
    first = events(run)
    chats = [e for e in first if e.get("type") == "command" and e.get("cmd") == "generate"
             and e.get("status") == "done"]
    assert [c["result"]["text"] for c in chats] == [text]
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert checkpoints == ["step-2", "step-4"]
    assert (run / "model" / "config.json").is_file() and (run / "model" / "model.safetensors").is_file()
    assert [e["step"] for e in first if e["type"] == "train"] == [1, 2, 3, 4]
    assert first[-1]["type"] == "state" and first[-1]["state"] == "finished"

    finish(start(tmp_path, max_steps=6, resume="latest"))
    second = events(run)[len(first):]
    resumes = [e for e in second if e["type"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] == 4 and resumes[0]["checkpoint"].endswith("step-4")
    assert [e["step"] for e in second if e["type"] == "train"] == [5, 6]
    assert "step-6" in {p.name for p in (run / "checkpoints").iterdir()}
    exports = [e for e in second if e["type"] == "export" and e["path"].endswith("/model")]
    assert len(exports) == 1 and exports[0]["step"] == 6
    assert second[-1]["type"] == "state" and second[-1]["state"] == "finished"
