"""Parallel layouts beyond plain data parallelism: tensor (AutoTP) and pipeline parallelism.

    groups.py    the process groups of a layout (data, tensor, pipeline) -> a `Layout` of ranks
    layouts.py   the layout objects (DataParallel, TensorParallel, Pipeline), chosen once at
                 assembly: every operation in which layouts differ (step, loss, generation,
                 whole-model weights, saving and loading)
    tp.py        DeepSpeed AutoTP: the engine's model-parallel unit, whole weights from shards
    pipeline.py  a Hugging Face Llama-family model split into a DeepSpeed PipelineModule,
                 the pipeline step strategy, and the stage-to-stage forward used by
                 evaluation and generation
    weights.py   one ordinary Hugging Face state dict from a split model, and checks against it

Which layouts a run config allows is checked torch-free in `contract.config.layout_checks`.
"""
