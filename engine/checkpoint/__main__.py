"""`python -m engine.checkpoint export SOURCE TARGET [--merge-lora] [--format gguf --dtype T]` (engine/checkpoint/export.py)."""

from __future__ import annotations

import argparse
import sys

from contract.exports import GGUF_TYPES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.checkpoint",
                                     description="Export saved weights as a Hugging Face folder.")
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="a training checkpoint, adapter or model folder to a new "
                                 "Hugging Face folder")
    export.add_argument("source", help="a training checkpoint, a PEFT adapter folder or a model folder")
    export.add_argument("target", help="a new (or empty) folder to write")
    export.add_argument("--merge-lora", action="store_true",
                        help="fold the LoRA adapter into the base weights: a plain model")
    export.add_argument("--format", choices=["hf", "gguf"], default="hf",
                        help="hf: a Hugging Face folder; gguf: a GGUF file for llama.cpp / Ollama (llama.cpp's "
                             "converter; a LoRA adapter is merged first) with an Ollama Modelfile")
    export.add_argument("--dtype", choices=list(GGUF_TYPES), default="f16",
                        help="the GGUF's tensor type (with --format gguf)")
    args = parser.parse_args(argv)
    from engine.checkpoint.locations import CheckpointError
    from engine.checkpoint.export import export as run_export
    from contract.config.schema import ConfigError
    try:
        print(run_export(args.source, args.target, merge_lora=args.merge_lora, fmt=args.format,
                         dtype=args.dtype), flush=True)
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
