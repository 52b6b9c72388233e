"""The app's side of `python -m engine.preview`: a child process that answers preview questions
(DeepSpeed JSON after "auto" filling, what a model folder or data file holds) with the engine's
own code, so the app process itself never imports torch. Started on first use and kept for the
next questions (the imports are the slow part); restarted if it dies."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from typing import Any

from app.data_preview import RowsPage, pairs_markdown, rows_markdown
from supervisor.launch import REPO_ROOT

TIMEOUT_S = 180.0  # the first answer pays for importing torch and transformers


class PreviewError(RuntimeError):
    pass


class PreviewWorker:
    """One request at a time (a lock), answers read by a thread so a timeout cannot hang us."""

    def __init__(self, python: str = sys.executable, timeout: float = TIMEOUT_S):
        self.python, self.timeout = python, timeout
        self._proc: subprocess.Popen | None = None
        self._answers: queue.Queue[str | None] = queue.Queue()
        self._lock = threading.Lock()

    def ask(self, op: str, **args: Any) -> dict:
        """The worker's answer to one request: {"ok": True, ...} or {"ok": False, "error": ...}."""
        with self._lock:
            proc = self._ensure()
            try:
                proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
                proc.stdin.flush()
                line = self._answers.get(timeout=self.timeout)
            except (OSError, queue.Empty):
                line = None
            if line is None:
                self._kill()
                raise PreviewError(f"the preview process gave no answer within {self.timeout:g} s")
            return json.loads(line)

    def deepspeed(self, config: dict) -> dict:
        return self.ask("deepspeed", config=config)

    def model(self, path: str) -> dict:
        return self.ask("model", path=path)

    def data(self, path: str, fmt: str = "auto") -> dict:
        return self.ask("data", path=path, format=fmt)

    def task(self, objective: str) -> dict:
        """The embedded task's files of the variant `objective` trains on: {"train", "eval", "format"}."""
        return self.ask("task", objective=objective)

    def _ensure(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        self._answers = queue.Queue()
        self._proc = subprocess.Popen(
            [self.python, "-m", "engine.preview"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True, cwd=str(REPO_ROOT), env=env)
        threading.Thread(target=self._read, args=(self._proc, self._answers), daemon=True,
                         name="preview-reader").start()
        return self._proc

    @staticmethod
    def _read(proc: subprocess.Popen, answers: "queue.Queue[str | None]") -> None:
        for line in proc.stdout:
            answers.put(line)
        answers.put(None)

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.stdin.close()
                try:
                    self._proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            self._kill()


def describe_model(info: dict) -> str:
    """A model folder's preview as one short Markdown paragraph."""
    if not info.get("ok"):
        return f"**Cannot use this model folder:** {info.get('error')}"
    params = info.get("parameters")
    size = f"{params / 1e6:.1f} M parameters" if isinstance(params, int) else "size unknown"
    weights = "weights found" if info.get("weights") else "no weight files (built from config.json with the run's seed)"
    tok = info.get("tokenizer") or f"no tokenizer ({info.get('tokenizer_error')})"
    chat = ", has a chat template" if info.get("chat_template") else ", no chat template (the chat sends raw prompts)"
    return (f"**{info.get('architecture')}** · {size} · hidden {info.get('hidden_size')} · "
            f"{info.get('layers')} layers · vocab {info.get('vocab_size')} · {weights} · tokenizer {tok}{chat if info.get('tokenizer') else ''}")


def describe_data(info: dict, page: RowsPage | str | None = None) -> str:
    """A data file's preview as one short Markdown paragraph; with `page` (app.data_preview's
    rows_page, or why there is none) a page of its rows, their token lengths and what the run does
    with each, instead of the first rows."""
    if not info.get("ok"):
        return f"**Cannot use this data:** {info.get('error')}"
    text = f"**{info['rows']} rows**, format **{info['format']}** (keys: {', '.join(info['keys']) or 'none'})"
    if info.get("unreadable"):
        text += f" · {info['unreadable']} unreadable rows (first: {info['unreadable_rows']})"
    if info.get("other_formats"):
        text += f" · other formats also present: {', '.join(info['other_formats'])}"
    if isinstance(page, RowsPage):
        return text + "\n\n" + rows_markdown(page)
    if isinstance(page, str):
        text += f" · {page}"
    if info.get("pairs"):  # preference rows: prompt above, chosen | rejected (KTO: completion | label)
        text += "\n\n" + pairs_markdown(info["pairs"])
    elif info.get("examples"):
        text += "\n\nfirst row: `" + json.dumps(info["examples"][0], ensure_ascii=False)[:200] + "`"
    return text

