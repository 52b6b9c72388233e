"""Parallel layouts beyond data parallelism: tensor (AutoTP) and pipeline parallelism.

    checks.py    torch-free: which layouts a run config and its model allow, and why not
    groups.py    the process groups of a layout (data, tensor, pipeline) -> a `Layout`
    tp.py        DeepSpeed AutoTP: the engine's model-parallel unit, whole weights from shards
    pipeline.py  a Hugging Face Llama-family model split into a DeepSpeed PipelineModule,
                 the pipeline step strategy, and the stage-to-stage forward used by
                 evaluation and generation
    layouts.py   one ordinary Hugging Face state dict from any layout, and back

This package file stays torch-free (the config validation imports `engine.parallel.checks`);
the other modules import torch and deepspeed.
"""
