"""The process groups of a run's layout: which ranks share data, a tensor shard, a pipeline.

The world is split as DeepSpeed splits it, so that our data loader, loss reduction and
evaluators agree with the engine:

- tensor parallel: DeepSpeed's own data x tensor mesh (deepspeed.utils.groups), tensor ranks
  adjacent: with tp 2 on 4 ranks the tensor groups are [0, 1] [2, 3] and the data groups
  [0, 2] [1, 3]. It is created here, before the engine, and the engine is handed the same
  groups as its model-parallel unit, so both use one mesh.
- pipeline parallel: DeepSpeed's PipeDataParallelTopology (axes pipe, data): rank =
  stage * dp + data rank. The PipelineModule is built on this topology.

Every rank of one data-parallel replica (the tensor ranks of a tensor group, the stages of a
pipeline) has the same `dp_rank`, so it loads the same batches. Which of these a run uses is
decided once, by its layout object (engine.parallel.layouts.layout_class).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from engine.parallel import ds_config


@dataclass(frozen=True)
class Groups:
    """This rank's place in the run's process groups."""
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    tp_rank: int = 0
    stage: int = 0        # pipeline stage of this rank
    dp_rank: int = 0
    dp_group: Any = None  # process group of this rank's data-parallel peers; None: the world
    topology: Any = None  # the pipeline's ProcessTopology under pipeline parallelism


def replicas(model_parallel: int, world_size: int, what: str) -> int:
    """How many data-parallel replicas `world_size` ranks make when each holds `model_parallel`
    ranks; an error naming the field when they do not divide."""
    if model_parallel < 1 or world_size % model_parallel:
        raise ValueError(f"parallel.nproc: {world_size} ranks cannot be split into {what} "
                         f"{model_parallel}; the world size must be a multiple of {model_parallel}")
    return world_size // model_parallel


def data_groups(rank: int, world_size: int) -> Groups:
    """Plain data parallelism: every rank is a replica; the data group is the world."""
    return Groups(dp_size=world_size, dp_rank=rank)


def tensor_groups(tp: int, world_size: int) -> Groups:
    """DeepSpeed's data x tensor mesh (collective: every rank calls it)."""
    dp = replicas(tp, world_size, "tp_size")
    groups = ds_config.init_tensor_parallel_mesh(tp)  # a second call keeps the first mesh
    if groups.get_tensor_model_parallel_world_size() != tp:
        raise RuntimeError(f"this process already has a tensor-parallel mesh of size "
                           f"{groups.get_tensor_model_parallel_world_size()}, not {tp}")
    return Groups(tp_size=tp, dp_size=dp, tp_rank=groups.get_tensor_model_parallel_rank(),
                  dp_rank=groups.get_data_parallel_rank(), dp_group=groups.get_data_parallel_group())


def pipeline_groups(pp: int, rank: int, world_size: int) -> Groups:
    """DeepSpeed's pipe x data topology and its data-parallel groups (collective)."""
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
    dp = replicas(pp, world_size, "pp_size")
    topology = PipeDataParallelTopology(num_pp=pp, num_dp=dp)
    coord = topology.get_coord(rank)
    mine = None
    for ranks in topology.get_axis_comm_lists("data"):  # new_group is collective: all, in order
        group = dist.new_group(ranks=ranks)
        if rank in ranks:
            mine = group
    return Groups(pp_size=pp, dp_size=dp, stage=coord.pipe, dp_rank=coord.data, dp_group=mine,
                  topology=topology)
