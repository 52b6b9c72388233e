#!/usr/bin/env bash
# One entry point for everything:
#   ./launch.sh                      set up on first use, then serve the web app on 127.0.0.1:7860
#   ./launch.sh train [--detach] [CONFIG.yaml] [key=value ...]   train from the terminal (no config:
#                                    the default); Ctrl-C / closing the terminal stops the run
#   ./launch.sh watch RUN_FOLDER     follow a run (a detached one) to its end
#   ./launch.sh stop RUN_FOLDER [save=false]   stop a run (saving first unless save=false)
#   ./launch.sh export SOURCE TARGET [--merge-lora] [--format gguf --dtype f32|f16|bf16|q8_0]
#                                    a checkpoint, adapter or model folder to a Hugging Face folder,
#                                    or to GGUF + an Ollama Modelfile (docs/checkpoints.md)
#   ./launch.sh preview DATA_FILE [format=F max_length=N start=N ...]  a page of a data file's rows
#   ./launch.sh submit [CONFIG.yaml] --slurm [--nodes N] [--procs-per-node N] [--partition P]
#                    [--time T] [--account A] [key=value ...]   submit the run to Slurm (sbatch)
#   ./launch.sh serve [--runs DIR] [--host H] [--port P]   the runs in DIR (default runs/) behind an
#                                    OpenAI-compatible API on 127.0.0.1:8000/v1 (docs/openai-api.md)
#   ./launch.sh test [pytest args]   install what the tests need (as CI: .ci/run calls this), then run them
#   ./launch.sh notebook [jupyter lab args]   the notebooks in JupyterLab (widgets extension and a
#                                    `livetune` kernel on this venv's Python) on 127.0.0.1
set -euo pipefail
CALLER_DIR="$PWD"  # `train` reads its config and data paths relative to where it was typed
cd "$(dirname "$0")"
VENV="$(pwd)/${LIVETUNE_VENV:-.venv}"
case "${LIVETUNE_VENV:-}" in /*) VENV="$LIVETUNE_VENV" ;; esac
PY="$VENV/bin/python"
# offline unless asked (HF_HUB_OFFLINE=0 ./launch.sh ... lets a model named by hub ID be downloaded)
export GRADIO_ANALYTICS_ENABLED=False HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
# DeepSpeed compiles its CPU communication op (deepspeed_shm_comm) on first use into
# TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions: shared by every venv on the machine,
# so two venvs (two torch versions) rebuild each other's copy. This venv keeps its own; every
# process started from here (the app, the CLI, the tests, the ranks they launch) inherits it.
# tests/conftest.py sets the same folder when pytest is started without this script.
export TORCH_EXTENSIONS_DIR="$VENV/torch_extensions"

setup() {  # (re)install when the venv is missing or pyproject.toml changed since the last install
  local extra="$1" stamp="$VENV/.installed-$1"
  if [ -x "$PY" ] && [ "$stamp" -nt pyproject.toml ]; then return; fi
  echo "setting up $VENV (first run takes a few minutes) ..."
  [ -x "$PY" ] || python3 -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q "torch==2.13.0"          # the CPU build on this disk, never a CUDA download
  # llama-cpp-python (the test extra: llama.cpp itself reads the GGUF exports) builds from source,
  # about 4 minutes, once: pip keeps the wheel in its cache. A portable build (no -march=native):
  # its AVX-512/AMX weight repacking crashed on q8_0 models, and a cached wheel must run on any x86-64.
  CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON}" \
    "$PY" -m pip install -q -e ".[$extra]"
  "$PY" -m engine.checkpoint.gguf install  # llama.cpp's GGUF converter, from its pinned source package
  touch "$stamp"
}

cmd="${1:-app}"
case "$cmd" in
  test)
    shift
    setup test
    # What CI has (.ci/run calls this very command): sshd, pdsh, Slurm and munge for the tests of
    # several machines and of Slurm (installed only when missing; without root they skip, saying why)
    .ci/setup-hosts.sh
    # The browser tests drive Debian's Chromium; never a browser a tool downloads by itself.
    if ! command -v chromium >/dev/null 2>&1; then
      echo "installing chromium (Debian package) for the browser tests ..."
      (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium) >/dev/null
    fi
    # Two test workers, each taking whole files (module fixtures and the machines a file sets up
    # stay in one process): most tests wait on processes they started, so two at a time keep the
    # 2-core machine busy. Files go out costliest first (tests/file_costs.py), not xdist's order by
    # test count, so that neither worker is left alone with a long file at the end.
    # LIVETUNE_TEST_WORKERS=0 runs them one after another.
    workers="${LIVETUNE_TEST_WORKERS:-2}"
    if [ "$workers" != 0 ]; then set -- -n "$workers" --dist loadfile --no-loadscope-reorder "$@"; fi
    exec "$PY" -m pytest "$@"
    ;;
  notebook)
    shift
    setup test  # the test extra holds jupyterlab and jupyterlab_widgets (the `notebook` extra too)
    # the notebooks name the kernel `livetune`: this venv's Python, registered inside the venv
    "$PY" -m ipykernel install --prefix "$VENV" --name livetune --display-name "livetune (.venv)" >/dev/null
    root=()
    [ "$(id -u)" = 0 ] && root=(--allow-root)
    # serves this folder (the working folder), opening on the quickstart
    exec "$VENV/bin/jupyter" lab --ServerApp.ip=127.0.0.1 \
      --ServerApp.default_url=/lab/tree/notebooks/quickstart.ipynb "${root[@]}" "$@"
    ;;
  train|watch|stop|submit|preview)
    shift
    setup test
    cd "$CALLER_DIR"  # paths are made absolute against it, so the engine (in this folder) finds them
    exec "$PY" -m app.cli "$cmd" "$@"  # the repo is installed editable: importable from anywhere
    ;;
  export)
    shift
    setup test
    cd "$CALLER_DIR"  # SOURCE and TARGET are relative to where they were typed
    exec "$PY" -m engine.checkpoint export "$@"
    ;;
  serve)
    shift
    setup test
    cd "$CALLER_DIR"  # --runs is relative to where it was typed
    exec "$PY" -m supervisor.openai_api "$@"
    ;;
  app)
    [ $# -gt 0 ] && shift
    setup test
    exec "$PY" -m app "$@"
    ;;
  *)
    setup test
    exec "$PY" -m app "$@"
    ;;
esac
