"""Exports of a run's checkpoint, model or adapter, in a process of their own: the engine's
command line (`python -m engine.checkpoint export`, engine/checkpoint/export.py) started from a
torch-free front end or client. A Hugging Face model folder, a merged LoRA, or a GGUF file for
llama.cpp / Ollama with its Modelfile (llama.cpp's own converter, engine/checkpoint/gguf.py).
The web app's Checkpoints tab, the notebook and `RunClient.export_gguf` (the live model at a step
boundary) all export through `export`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from supervisor.launch import REPO_ROOT

EXPORT_TIMEOUT_S = 900.0


def export(source: str, target: str, merge_lora: bool = False, python: str = sys.executable,
           gguf: str | None = None) -> str:
    """Export a checkpoint or adapter to a Hugging Face model folder through the engine's
    command line (`python -m engine.checkpoint export SOURCE TARGET [--merge-lora]`), or to a
    GGUF file of type `gguf` with its Ollama Modelfile (`--format gguf --dtype T`); returns
    what it printed. Raises RuntimeError with its last lines when it fails."""
    target = str(Path(target).expanduser().resolve())  # the subprocess starts in the project folder
    if Path(target).exists() and any(Path(target).iterdir()):
        raise RuntimeError(f"{target} exists and is not empty; choose a new folder")
    cmd = [python, "-m", "engine.checkpoint", "export", source, target] + (["--merge-lora"] if merge_lora else [])
    if gguf:
        cmd += ["--format", "gguf", "--dtype", gguf]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=str(REPO_ROOT), env=env,
                              timeout=EXPORT_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the export did not finish within {EXPORT_TIMEOUT_S:g} s") from None
    output = (done.stdout + done.stderr).strip()
    if done.returncode != 0:
        errors = [line[len("error: "):] for line in output.splitlines() if line.startswith("error: ")]
        raise RuntimeError(errors[-1] if errors else "the export failed:\n" + "\n".join(output.splitlines()[-12:]))
    said = done.stdout.strip().splitlines()  # the command's last line says what it wrote
    return said[-1] if said else f"exported to {target}"
