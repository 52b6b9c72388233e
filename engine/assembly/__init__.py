"""The composition root: where a run's objects are built and connected, once, from its config.

    root      `assemble(cfg, Given(...)) -> Assembled`: the order of it all, the objective's choice
    process   the process group and the layout's groups, the run folder and its event log
    data      the datasets, the loaders, the step and epoch counts
    model     the precision, the DeepSpeed config, the model, the optimizer, deepspeed.initialize
    loop      callbacks, monitors, evaluators, snapshots; `start`: a built Trainer connected
              (set-up hooks, setup event, control plane, resume)

The Trainer's constructor (engine.trainer) calls `root.assemble` and `loop.start`; nothing here
imports the Trainer. Import each name from its module; this package's `__init__` exports none.
"""
