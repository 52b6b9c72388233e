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
pipeline) has the same `dp_rank`, so it loads the same batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class Layout:
    """This rank's place in the run's layout."""
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    tp_rank: int = 0
    stage: int = 0        # pipeline stage of this rank
    dp_rank: int = 0
    dp_group: Any = None  # process group of this rank's data-parallel peers; None: the world
    topology: Any = None  # the pipeline's ProcessTopology when pp_size > 1


def build_layout(tp_size: int, pp_size: int, rank: int, world_size: int) -> Layout:
    """Create the groups of a tp_size x pp_size x dp layout (collective: every rank calls it)."""
    if tp_size < 1 or pp_size < 1 or world_size % (tp_size * pp_size):
        raise ValueError(f"parallel.nproc: {world_size} ranks cannot be split into tp_size {tp_size} x "
                         f"pp_size {pp_size}; the world size must be a multiple of {tp_size * pp_size}")
    if tp_size > 1 and pp_size > 1:
        raise ValueError("parallel.pp_size: tensor and pipeline parallelism cannot be combined")
    dp = world_size // (tp_size * pp_size)
    if tp_size > 1:
        return _tensor_layout(tp_size, dp)
    if pp_size > 1:
        return _pipeline_layout(pp_size, dp, rank)
    return Layout(dp_size=world_size, dp_rank=rank)


def _tensor_layout(tp: int, dp: int) -> Layout:
    from deepspeed.utils import groups
    # DeepSpeed's own initialiser of its TP mesh (what deepspeed.initialize calls when it is
    # not given an mpu); a second call in the same process keeps the first mesh.
    groups._init_tp_mesh_device(tensor_model_parallel_size=tp)
    if groups.get_tensor_model_parallel_world_size() != tp:
        raise RuntimeError(f"this process already has a tensor-parallel mesh of size "
                           f"{groups.get_tensor_model_parallel_world_size()}, not {tp}")
    return Layout(tp_size=tp, dp_size=dp, tp_rank=groups.get_tensor_model_parallel_rank(),
                  dp_rank=groups.get_data_parallel_rank(), dp_group=groups.get_data_parallel_group())


def _pipeline_layout(pp: int, dp: int, rank: int) -> Layout:
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
    topology = PipeDataParallelTopology(num_pp=pp, num_dp=dp)
    coord = topology.get_coord(rank)
    mine = None
    for ranks in topology.get_axis_comm_lists("data"):  # new_group is collective: all, in order
        group = dist.new_group(ranks=ranks)
        if rank in ranks:
            mine = group
    return Layout(pp_size=pp, dp_size=dp, stage=coord.pipe, dp_rank=coord.data, dp_group=mine,
                  topology=topology)
