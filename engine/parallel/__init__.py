"""Parallel layouts beyond data parallelism: tensor (AutoTP) and pipeline parallelism.

    groups.py    the process groups of a layout (data, tensor, pipeline) -> a `Layout`
    tp.py        DeepSpeed AutoTP: the engine's model-parallel unit, whole weights from shards
    pipeline.py  a Hugging Face Llama-family model split into a DeepSpeed PipelineModule,
                 the pipeline step strategy, and the stage-to-stage forward used by
                 evaluation and generation
    layouts.py   one ordinary Hugging Face state dict from any layout, and back

Which layouts a run config allows is checked torch-free in `contract.layout_checks`.
"""
