"""This rank in its run: the process group (and the layout's groups in it), the run folder and
its event log. The first things the composition root (engine.assembly.root) builds."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import deepspeed
import torch
import torch.distributed as dist

from contract.config.schema import RunConfig
from contract.run_folder import EventLog, RunFolder, make_run_folder
from engine.parallel import rendezvous
from engine.context import DistEnv
from engine.monitors import open_sinks
from engine.parallel.groups import Groups, data_groups


def init_distributed(make_groups: Callable[[int, int], Groups] = data_groups) -> DistEnv:
    """Join the launcher's process group (gloo on CPU, NCCL and gloo on GPUs: backend_for), or
    make a one-rank group when a script or notebook runs the Trainer without a launcher (this
    rank's GPU made current first: device_of); then create the groups of
    the run's layout: `make_groups(rank, world_size)` (the layout object's; plain data
    parallelism by default)."""
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(rendezvous.free_port()))
    local_rank = int(os.environ["LOCAL_RANK"])
    device = device_of(local_rank)
    if not dist.is_initialized():
        backend = backend_for(device.type == "cuda")
        _remove_stale_shm_buffer()
        rendezvous.join_on_loopback(backend)  # one machine: nothing listens beyond loopback
        deepspeed.init_distributed(dist_backend=backend)
        _unlink_shm_buffers()
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = make_groups(rank, world)
    return DistEnv(rank, local_rank, world, dp_rank=layout.dp_rank, dp_size=layout.dp_size,
                   dp_group=layout.dp_group, device=device, tp_size=layout.tp_size,
                   tp_rank=layout.tp_rank, pp_size=layout.pp_size, stage=layout.stage,
                   topology=layout.topology)


def device_of(local_rank: int) -> torch.device:
    """This rank's device: GPU `local_rank` of those visible, made current before the process
    group exists (NCCL binds its communicators to the current device); the CPU without CUDA."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise RuntimeError(f"parallel.nproc: local rank {local_rank} has no GPU of its own: {count} GPU"
                           f"{'s' * (count != 1)} visible (CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); start at most {count} "
                           "ranks per machine")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def backend_for(cuda: bool) -> str:
    """The process group's backend: gloo on CPU; with GPUs, NCCL for CUDA tensors and gloo for
    CPU tensors. The loop's small collectives (a step's loss and token counts, evaluation sums,
    the guard's verdicts) reduce CPU tensors, which an NCCL-only group refuses ("no backend
    type associated with device type cpu") as soon as there are two ranks."""
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def _remove_stale_shm_buffer() -> None:
    """DeepSpeed's CPU all-reduce names each rank's /dev/shm buffer by user, MASTER_ADDR,
    MASTER_PORT and rank, and the other ranks map it as soon as the name exists. A run killed
    before `_unlink_shm_buffers` leaves its buffers behind; a later run on the same port would
    have its peers map the stale one before this rank rewrote it (a rank then crashed at start).
    Each rank removes its own name before the rendezvous, which no rank passes before all have
    joined, so no peer can have mapped it yet."""
    if torch.cuda.is_available():
        return
    name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ['MASTER_ADDR']}_"
            f"{os.environ['MASTER_PORT']}_{os.environ['RANK']}")
    try:
        (Path("/dev/shm") / name).unlink()
    except OSError:
        pass


def _unlink_shm_buffers() -> None:
    """DeepSpeed's CPU all-reduce maps a 66 MB /dev/shm file per rank and never deletes it.
    Once every rank has mapped them (the barrier), each rank unlinks its own, so the memory is
    freed when the processes exit, however they exit."""
    if torch.cuda.is_available() or dist.get_world_size() == 1:
        return
    dist.barrier()
    suffix = f"_{os.environ['MASTER_PORT']}_{dist.get_rank()}"
    for path in Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"):
        if path.name.endswith(suffix):
            try:
                path.unlink()
            except OSError:
                pass


def open_run_folder(cfg: RunConfig, run_dir: str | None, is_rank0: bool) -> tuple[RunFolder, EventLog | None]:
    """The run folder (made by rank 0 when not given) and, on rank 0, its event log."""
    path = [run_dir]
    if run_dir is None:
        if is_rank0:
            path = [str(make_run_folder(cfg).root)]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(path, src=0)
    folder = RunFolder(Path(path[0])).create()
    if not is_rank0:
        return folder, None
    if not folder.config.exists():
        folder.config.write_text(cfg.to_yaml())
    return folder, open_sinks(folder.events, cfg)
