"""How the data-parallel ranks share the model: `parallel.dp_mode` fsdp, ddp, or auto (the default).

    fsdp   FSDP2: weights, gradients and optimizer state sharded over the data-parallel (and context) ranks;
           all-gathers before each layer, reduce-scatters after; works with every layout
    ddp    every rank holds the whole model and optimizer; one all-reduce of the gradients; data parallel alone
    auto   ddp when the layout is data parallel alone (no tp, pp, ep or cp), the device is a CPU (gloo) and the
           replicas fit in memory; fsdp otherwise

Why: on CPUs over gloo FSDP's collectives do not overlap with compute, and two ranks measured 0.82-0.88x the
throughput of HF's and litgpt's DDP loops while DDP measured 1.03x (docs/performance.md, bench/train_peers.py).
On GPUs FSDP overlaps its collectives and saves memory, so auto keeps it there.

"Fits": a DDP replica holds REPLICA_BYTES per parameter (fp32 weights and gradients, AdamW's two moments, DDP's
gradient buckets); the replicas of the ranks on this machine must take at most MEMORY_SHARE of its available
memory (MemAvailable), leaving the rest for activations. Rank 0 decides and every rank takes its decision, so the
ranks cannot disagree.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from mtrain.parallel.dims import ParallelDims

REPLICA_BYTES = 20  # per parameter: fp32 weight 4 + gradient 4 + AdamW moments 8 + DDP bucket 4
MEMORY_SHARE = 0.5


def available_memory() -> int | None:
    """Bytes of memory the kernel says new work can take (MemAvailable), or None where that is not known."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def choose(dims: ParallelDims, device: torch.device, params: int, local_ranks: int,
           available: int | None) -> tuple[str, str]:
    """(fsdp or ddp, why) for `parallel.dp_mode auto`."""
    if (dims.tp, dims.pp, dims.ep, dims.cp) != (1, 1, 1, 1):
        return "fsdp", "the layout is more than data parallel"
    if device.type != "cpu":
        return "fsdp", f"on {device.type} FSDP overlaps its collectives and shards the memory"
    need = local_ranks * params * REPLICA_BYTES
    if available is None:
        return "ddp", "data parallel alone on CPU (available memory unknown)"
    room = f"{local_ranks} replica(s) need {need / 2**30:.1f} GiB of {available / 2**30:.1f} GiB available"
    if need > MEMORY_SHARE * available:
        return "fsdp", f"DDP would not fit: {room}"
    return "ddp", f"data parallel alone on CPU, faster than FSDP over gloo; {room}"


def resolve(requested: str, dims: ParallelDims, device: torch.device, params: int) -> tuple[str, str | None]:
    """The data-parallel mode of the run and, for auto with more than one rank sharing weights, the line that
    says what it chose and why."""
    if requested != "auto":
        return requested, None
    if dims.dp * dims.cp == 1:
        return "fsdp", None  # no rank shares this one's weights: the mode changes nothing
    available = available_memory()
    if device.type == "cpu" and dist.is_initialized() and dims.world > 1:  # rank 0's figure for all: one decision
        shared = torch.tensor([-1.0 if available is None else float(available)], dtype=torch.float64)
        dist.broadcast(shared, src=0)
        available = None if shared.item() < 0 else int(shared.item())
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", dims.world))
    mode, why = choose(dims, device, params, local_ranks, available)
    return mode, f"parallel.dp_mode auto: {mode} ({why})"
