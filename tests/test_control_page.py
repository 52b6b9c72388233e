"""`Trainer(server=True)` in a user's own script: the chat page on rank 0 answers from the live
weights through the same command path, and controls the run (pause, resume, stop without save).
The script trains a LoRA adapter, so the socket client can also ask the base model side by side."""

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from supervisor.client import CommandError, RunClient
from control_runs import task_files
from contract.run_folder import read_events

REPO = Path(__file__).resolve().parent.parent

SCRIPT = """
import sys
import time
from engine import Trainer
from contract.config.load import load_config
cfg = load_config(overrides=sys.argv[2:])
trainer = Trainer(config=cfg, run_dir=sys.argv[1], server=True)
trainer.train()
print("trained to step", trainer.state.global_step, flush=True)
print("final save:", trainer.live_settings.save_at_end(trainer.config), flush=True)
print("config save_at_end:", trainer.config.checkpoint.save_at_end, flush=True)
time.sleep(4)  # the script goes on after training: its run still answers, and refuses clearly
"""


def _events(run_dir: Path) -> list[dict]:
    return list(read_events(run_dir / "events.jsonl"))


def _page_url(run_dir: Path, proc, timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in _events(run_dir):
            if e["type"] == "chat_page":
                return e["url"]
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    pytest.fail("no chat page was announced")


def _post(url: str, body: dict, token: str | None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json", **({"X-Token": token} if token else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.mark.slow
def test_chat_page_of_a_script_trainer(tmp_path):
    task = task_files(tmp_path / "task")
    run_dir = tmp_path / "run"
    env = dict(os.environ, LIVETUNE_CACHE=task["cache"], HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    args = ["max_steps=5000", "method=lora", "optim.lr=0.01", "batch_size=8", "data.max_length=32", f"data.train={task['train']}",
            "precision=fp32", "logging.tensorboard=false", "checkpoint.save_at_end=true",
            "eval.at_end=false", f"output_dir={tmp_path}"]
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(run_dir), *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = _page_url(run_dir, proc).rstrip("/")
        url = json.loads((run_dir / "control.json").read_text())["chat_page"]
        token = url.split("/?token=")[1]
        assert url.startswith(base) and token not in (run_dir / "events.jsonl").read_text()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(base + "/?token=wrong", timeout=10)
        assert refused.value.code == 403
        with urllib.request.urlopen(url, timeout=10) as page:
            assert b"<textarea" in page.read()
        assert _post(base + "/api/generate", {"prompt": "sort: abc\n"}, None)[0] == 403
        assert _post(base + "/api/generate", {"prompt": "x", "top_p": 5}, token)[0] == 400

        code, text = _post(base + "/api/generate", {"prompt": "upper: dog\n", "max_new_tokens": 6,
                                                    "temperature": 1.0, "seed": 1}, token)
        assert code == 200
        done = [e for e in _events(run_dir) if e["type"] == "command" and e["status"] == "done"]
        assert done[-1]["cmd"] == "generate" and done[-1]["result"]["text"] == text.decode()

        # the same run through the socket client: the adapter's answer and the base model's
        client = RunClient.connect(run_dir, timeout=10)
        gen = client.generate("reverse: cat\n", max_new_tokens=6, temperature=1.0, seed=2, compare_base=True)
        pieces = list(gen)
        assert isinstance(gen.base_text, str) and gen.result.note is None
        assert "".join(p for p in pieces if p.model == "base") == gen.base_text
        assert "".join(p for p in pieces if p.model == "current") == gen.text
        client.close()

        code, paused = _post(base + "/api/command", {"cmd": "pause"}, token)
        assert code == 200 and json.loads(paused)["state"] == "paused"
        req = urllib.request.Request(base + "/api/status", headers={"X-Token": token})
        with urllib.request.urlopen(req, timeout=10) as resp:
            status = json.loads(resp.read())
        assert status["state"] == "paused" and status["step"] == json.loads(paused)["step"]
        assert json.loads(_post(base + "/api/command", {"cmd": "resume"}, token)[1])["state"] == "running"
        code, stopped = _post(base + "/api/command", {"cmd": "stop", "args": {"save": False}}, token)
        assert code == 200 and json.loads(stopped)["checkpoint"] is None
        deadline = time.monotonic() + 60
        with RunClient.connect(run_dir, timeout=10) as client:
            while True:  # chats are answered until training has ended, then refused with why
                try:
                    client.chat("sort: zyx\n", max_new_tokens=2)
                except CommandError as e:  # the plane's own refusal, or, once train() has closed
                    # the plane, the client's word that the run has ended
                    assert "training has ended" in str(e) or "the run has ended" in str(e), e
                    break
                assert time.monotonic() < deadline
        assert max(e["step"] for e in _events(run_dir) if e["type"] == "train") < 5000
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        assert "trained to step" in out and int(out.split("trained to step")[1].split()[0]) < 5000
        assert "final save: False" in out  # stop without save also cancels the final save
        assert "config save_at_end: True" in out  # decided in the live settings, not the config
        assert not any(e["type"] == "export" for e in _events(run_dir)) and not (run_dir / "model").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
