"""The compute precision of a run: `train.precision` fp32, bf16 or auto, checked against what the device does fast.

bf16 pays on GPUs with bf16 tensor cores and on CPUs with bf16 matrix units (Intel AMX). On other CPUs PyTorch
emulates bf16 matrix products, or has slow kernels for them, and a bf16 run is slower than fp32: 1.8x on a Xeon
with AVX-512 BF16 but no AMX, 27x on an AVX2-only one. Which one a CPU is cannot be read
reliably from its flags, so it is measured: a small MLP's forward and backward under bf16 autocast against fp32
(a few tenths of a second at start, only when the config asks for bf16 or auto on a CPU).

    precision: bf16   on a CPU where bf16 is slower: a warning with the measured slowdown, then bf16 as asked
    precision: auto   bf16 on a GPU that supports it, or on a CPU where bf16 measured faster; fp32 otherwise
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

FASTER = 0.9  # auto picks bf16 on a CPU when it takes at most this fraction of fp32's time
SLOWER = 1.1  # bf16 on a CPU warns when it takes more than this multiple of fp32's time


def bf16_slowdown(repeats: int = 3) -> float:
    """Time of a bf16-autocast MLP forward + backward over the fp32 one on this CPU (the best of `repeats`)."""
    generator = torch.Generator().manual_seed(0)
    w1 = torch.randn(1024, 256, generator=generator, requires_grad=True)
    w2 = torch.randn(256, 1024, generator=generator, requires_grad=True)
    x = torch.randn(512, 256, generator=generator)

    def once(autocast: bool) -> float:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            y = F.linear(F.silu(F.linear(x, w1)), w2)
        y.float().square().mean().backward()
        return time.perf_counter() - start

    once(False), once(True)  # first calls pay for kernel selection
    fp32 = bf16 = float("inf")
    for _ in range(repeats):  # interleaved: a drift of the machine's speed hits both
        fp32, bf16 = min(fp32, once(False)), min(bf16, once(True))
    return bf16 / fp32


def resolve(requested: str, device: torch.device, world: int, out: Callable[[str], None],
            measure: Callable[[], float] = bf16_slowdown) -> str:
    """fp32 or bf16 for a run that asked for `requested`; says what it measured and decided (rank 0 measures,
    every rank takes its decision)."""
    if requested == "fp32" or (requested == "bf16" and device.type != "cpu"):
        return requested
    if device.type == "cuda":  # auto on a GPU
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    if device.type != "cpu":
        return "fp32"
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    slowdown = torch.tensor([measure() if rank0 else 0.0], dtype=torch.float64)
    if world > 1 and dist.is_initialized():
        dist.broadcast(slowdown, src=0)
    slowdown = float(slowdown)
    speed = f"bf16 measured {slowdown:.1f}x " + ("slower than" if slowdown > 1 else "the time of") + " fp32"
    if requested == "bf16":
        if slowdown > SLOWER:
            out(f"warning: train.precision bf16 on a CPU without fast bf16 matrix units: {speed} (a small MLP's "
                "forward and backward); expect the run to be about that much slower than fp32. Use "
                "train.precision fp32, or auto to let mtrain choose.")
        return "bf16"
    choice = "bf16" if slowdown <= FASTER else "fp32"
    out(f"train.precision auto: {choice} ({speed} on this CPU)")
    return choice
