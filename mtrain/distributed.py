"""Process-group setup: one process, or `torchrun` ranks (gloo on CPU, NCCL on GPUs).

The device mesh of the parallel layout is built from the config by mtrain/parallel/dims.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mconvert.workers import end_process_group, init_process_group


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world: int
    device: torch.device
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
        init_process_group(backend)  # imports torch.distributed.checkpoint first, or the group outlives its end
        owns = True
    else:
        owns = False
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return DistEnv(dist.get_rank() if world > 1 else 0, world, device, owns)


def shutdown(env: DistEnv) -> None:
    if env.owns_group and dist.is_initialized():
        end_process_group()


def weighted_mean(value: float, weight: float, env: DistEnv) -> float:
    """sum(value * weight) / sum(weight) over all ranks (ranks without the value give weight 0)."""
    if env.world == 1:
        return value
    t = torch.tensor([value * weight, weight], dtype=torch.float64, device=env.device)  # NCCL: on the GPU
    dist.all_reduce(t)  # SUM: gloo has no AVG
    return float(t[0] / t[1])
