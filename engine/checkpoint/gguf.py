"""GGUF export for llama.cpp and Ollama, written by llama.cpp's own converter.

The GGUF file is never written by code of ours: llama.cpp's `convert_hf_to_gguf.py` (with its
`conversion/` package, taken from the pinned `llama-cpp-python` source package, whose
`vendor/llama.cpp/` carries it; `install_converter` puts it in the venv at set-up) reads a
Hugging Face folder and writes the file, with the `gguf-py` it vendors (the PyPI `gguf` of the same
version number lags behind the converter's code; transformers reads GGUF with that one). What this
module adds:

- the architecture check before any work: the converter's registry, read from its source text
  (`supported_architectures`), so an unknown architecture is refused naming it;
- a LoRA run is merged into its base first (the caller hands a plain model folder:
  engine.checkpoint.export's `--merge-lora`);
- a SentencePiece model (`tokenizer.model`) of the source travels with the folder, since the
  converter reads it where a model's tokenizer is SentencePiece-based;
- an Ollama `Modelfile` beside the file (`FROM ./model.gguf`, the chat template as TEMPLATE, the
  end-of-text tokens as `PARAMETER stop`), so `ollama create NAME -f Modelfile` takes the folder as
  it is;
- the folder is published atomically like every export (engine.checkpoint.atomic).
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Callable

from contract.exports import GGUF_TYPES
from engine.checkpoint.locations import CheckpointError

# The llama.cpp the converter comes from: llama-cpp-python's source package vendors it whole.
LLAMA_CPP_PYTHON = "0.3.36"
CONVERTER_ENV = "LIVETUNE_LLAMA_CPP"  # a llama.cpp checkout (or our extract) to use instead
GGUF_FILE = "model.gguf"
MODELFILE = "Modelfile"


class GGUFError(CheckpointError):
    pass


def converter_dir() -> Path:
    """Where convert_hf_to_gguf.py lies: $LIVETUNE_LLAMA_CPP, else the venv's share/llama.cpp."""
    return Path(os.environ.get(CONVERTER_ENV) or Path(sys.prefix) / "share" / "llama.cpp")


def _converter() -> Path:
    script = converter_dir() / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise GGUFError(f"llama.cpp's converter is not installed ({script} is missing): run "
                        f"`{sys.executable} -m engine.checkpoint.gguf install` (./launch.sh does it at set-up), "
                        f"or point {CONVERTER_ENV} at a llama.cpp checkout")
    return script


def supported_architectures(folder: Path | None = None) -> set[str]:
    """The Hugging Face architecture names the converter registers (`@ModelBase.register(...)`),
    read from its source text: no import, so no torch and no side effects."""
    folder = folder or converter_dir()
    names: set[str] = set()
    for path in sorted((folder / "conversion").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                for deco in node.decorator_list:
                    if (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)
                            and deco.func.attr == "register"):
                        names.update(a.value for a in deco.args
                                     if isinstance(a, ast.Constant) and isinstance(a.value, str))
    return names


def check_architecture(model_folder: Path) -> str:
    """The folder's architecture, or a GGUFError naming it when the converter does not know it."""
    _converter()
    config = json.loads((Path(model_folder) / "config.json").read_text())
    archs = config.get("architectures") or []
    known = supported_architectures()
    for arch in archs:
        if arch in known:
            return arch
    raise GGUFError(f"llama.cpp's converter does not know the architecture "
                    f"{', '.join(archs) or '(none named in config.json)'}; GGUF export is possible for "
                    f"the architectures it registers (e.g. LlamaForCausalLM, Qwen2ForCausalLM, "
                    f"MistralForCausalLM); export a Hugging Face folder instead")


def check_tokenizer(folder: Path) -> None:
    """A GGUF holds a SentencePiece model or a BPE tokenizer; refuse others (a WordLevel one,
    like the embedded default's character tokenizer) before any work, naming the kind."""
    folder = Path(folder)
    if (folder / "tokenizer.model").is_file():
        return
    path = folder / "tokenizer.json"
    if not path.is_file():
        return  # the converter says what it misses
    kind = json.loads(path.read_text()).get("model", {}).get("type")
    if kind not in (None, "BPE"):
        raise GGUFError(f"the tokenizer in {folder} is a {kind} model; a GGUF holds a SentencePiece or a BPE "
                        f"tokenizer only, so llama.cpp could not read this one (the embedded default's "
                        f"character tokenizer is such a case): export a Hugging Face folder instead")


def convert(model_folder: Path, out_file: Path, dtype: str, say: Callable[[str], None] = print) -> None:
    """Run the converter on a plain Hugging Face folder (its own process: its logging, its
    sys.path and its memory stay out of ours). Its output is kept in `<out_file>.log`."""
    if dtype not in GGUF_TYPES:
        raise GGUFError(f"dtype: {dtype!r} is not one of {', '.join(GGUF_TYPES)}")
    check_architecture(model_folder)
    check_tokenizer(model_folder)
    script = _converter()
    say(f"converting {model_folder} to GGUF ({dtype}) with llama.cpp's converter")
    log = out_file.with_suffix(".log")
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # its own gguf-py, beside it
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, str(script), str(model_folder), "--outfile", str(out_file),
                               "--outtype", dtype], stdout=out, stderr=subprocess.STDOUT, env=env,
                              cwd=str(script.parent))
    if done.returncode != 0 or not out_file.is_file():
        tail = log.read_text(errors="replace").strip().splitlines()[-6:]
        raise GGUFError(f"llama.cpp's converter failed on {model_folder} (exit {done.returncode}): "
                        + " | ".join(tail))


def modelfile(tokenizer, gguf_name: str = GGUF_FILE) -> str:
    """An Ollama Modelfile for the tokenizer's chat template and end-of-text tokens.

    Ollama's TEMPLATE is a Go template over `.System` and `.Prompt`; the model's Jinja chat
    template is rendered once with markers in their place and the markers swapped for those
    fields, so what Ollama sends the model is what `apply_chat_template` would build."""
    lines = [f"FROM ./{gguf_name}"]
    template = _go_template(tokenizer)
    if template:
        lines.append(f'TEMPLATE """{template}"""')
    for stop in _stops(tokenizer):
        lines.append(f"PARAMETER stop {json.dumps(stop)}")
    return "\n".join(lines) + "\n"


_SYSTEM, _PROMPT = "\x00SYSTEM\x00", "\x00PROMPT\x00"


def _go_template(tokenizer) -> str | None:
    if not getattr(tokenizer, "chat_template", None):
        return None

    def render(messages: list[dict]) -> str | None:
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - e.g. a template that refuses a system message
            return None
        bos = getattr(tokenizer, "bos_token", None)  # llama.cpp adds BOS itself (the GGUF says so)
        return text[len(bos):] if bos and text.startswith(bos) else text

    user = render([{"role": "user", "content": _PROMPT}])
    if user is None or _PROMPT not in user:
        return None
    head, tail = user.split(_PROMPT, 1)
    with_system = render([{"role": "system", "content": _SYSTEM}, {"role": "user", "content": _PROMPT}])
    if not with_system or _SYSTEM not in with_system or _PROMPT not in with_system:
        return head + "{{ .Prompt }}" + tail
    before, after = with_system.split(_SYSTEM, 1)
    between = after.split(_PROMPT, 1)[0]
    return ("{{ if .System }}" + before + "{{ .System }}" + between + "{{ else }}" + head + "{{ end }}"
            + "{{ .Prompt }}" + tail)


def _stops(tokenizer) -> list[str]:
    eos = getattr(tokenizer, "eos_token", None)
    return [eos] if eos else []


def sentencepiece_file(*folders: Path | None) -> Path | None:
    """The first `tokenizer.model` (a SentencePiece model) among `folders`, to travel with the
    export: the converter reads it for SentencePiece-based tokenizers."""
    for folder in folders:
        if folder is not None and (Path(folder) / "tokenizer.model").is_file():
            return Path(folder) / "tokenizer.model"
    return None


def install_converter(dest: Path | None = None, say: Callable[[str], None] = print) -> Path:
    """Put llama.cpp's converter (convert_hf_to_gguf.py, conversion/, gguf-py/, its licence) from the
    pinned llama-cpp-python source package into `dest` (default: the venv's share/llama.cpp).
    Downloads the source package with pip (PyPI only); does nothing when it is there."""
    dest = Path(dest or Path(sys.prefix) / "share" / "llama.cpp")
    stamp = dest / ".llama-cpp-python"
    if stamp.is_file() and stamp.read_text().strip() == LLAMA_CPP_PYTHON and (dest / "gguf-py").is_dir():
        return dest
    say(f"installing llama.cpp's GGUF converter (llama-cpp-python {LLAMA_CPP_PYTHON} source) into {dest}")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", tmp], check=True)
        archive = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        staging = Path(tmp) / "out"
        with tarfile.open(archive) as tar:
            wanted = [m for m in tar.getmembers() if _wanted(m.name)]
            tar.extractall(staging, members=wanted, filter="data")
        vendor = next(staging.glob("*/vendor/llama.cpp"))
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(vendor, dest)
    stamp.write_text(LLAMA_CPP_PYTHON + "\n")
    return dest


def _wanted(name: str) -> bool:
    parts = name.split("/")
    if len(parts) < 4 or parts[1:3] != ["vendor", "llama.cpp"]:
        return False
    rest = "/".join(parts[3:])
    return rest in {"convert_hf_to_gguf.py", "LICENSE"} or rest.startswith(("conversion/", "gguf-py/"))


def main(argv: list[str] | None = None) -> int:
    """`python -m engine.checkpoint.gguf install [DEST]`: the set-up step."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] != "install":
        print("usage: python -m engine.checkpoint.gguf install [DEST]", file=sys.stderr)
        return 2
    print(f"converter: {install_converter(Path(args[1]) if len(args) > 1 else None)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
