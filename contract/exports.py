"""What an export can be asked for, declared once for the engine's exporter and the front ends.

GGUF_TYPES are llama.cpp's converter's output types that llama.cpp loads (engine.checkpoint.gguf
runs the converter; the web app's Checkpoints tab and `python -m engine.checkpoint export
--format gguf --dtype T` offer them).
"""

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
