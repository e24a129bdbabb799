"""Process-group setup: one process, or `torchrun` ranks (gloo on CPU, NCCL on GPUs) on a data-parallel mesh."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world: int
    device: torch.device
    mesh: DeviceMesh | None  # None when training in one process
    owns_group: bool  # this module created the process group (and destroys it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init() -> DistEnv:
    """Join the process group `torchrun` describes (WORLD_SIZE > 1), or run as a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if dist.is_initialized():
        world, owns = dist.get_world_size(), False
    elif world > 1:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend)
        owns = True
    else:
        owns = False
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world == 1:
        return DistEnv(0, 1, device, None, owns)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    return DistEnv(dist.get_rank(), world, device, mesh, owns)


def shutdown(env: DistEnv) -> None:
    if env.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def mean_across_ranks(value: torch.Tensor, env: DistEnv) -> float:
    if env.mesh is not None:
        value = value.detach().clone()
        dist.all_reduce(value)  # SUM: gloo has no AVG
        value /= env.world
    return float(value)
