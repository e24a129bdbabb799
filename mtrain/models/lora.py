"""LoRA adapters on a model's Linear layers, computed as PEFT computes them:

    y = base(x) + scale * lora_B(lora_A(dropout(x)))      lora_A [rank, in], lora_B [out, rank]
    scale = alpha / rank (rslora: alpha / sqrt(rank)); A Kaiming-uniform(a=sqrt(5)) or N(0, 1/rank), B zero

The adapters are children of the base Linear (`layers.3.attn.q.lora_A.weight`, PEFT's names without its adapter
name), added by a forward hook, so the base module, its parameter names and the parallel styles applied to it
stay as they are. The experts of an MoE layer (target `experts`) get one adapter per expert and projection, stacked
like their weights (`layers.3.moe.experts.lora_gate_A` [E, rank, h], `lora_gate_B` [E, f, rank], `lora_down_A`
[E, rank, f], `lora_down_B` [E, h, rank]; models/moe.py adds them), split over expert-parallel ranks like the
experts. Under tensor parallel (attached after the base layer is split): a column-parallel base (q, k, v,
gate, up) splits B by rows like its weight and keeps A whole; a row-parallel base (o, down) splits A by columns
and keeps B whole, the rank-sized partial sums reduced before B.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from mconvert.ir.adapter import TARGETS

TARGET_MODULES = TARGETS  # neutral target -> the Linear's path inside a layer


@dataclass(frozen=True)
class LoraSpec:
    """What the model needs to know of the adapters: their rank, scale, dropout and targets."""

    rank: int
    scale: float
    dropout: float
    targets: tuple[str, ...]


EXPERT_ADAPTERS = {f"lora_{w}_{p}": w for w in ("gate", "up", "down") for p in "AB"}  # -> the stacked weight


def is_adapter(name: str) -> bool:
    """Whether a parameter name is an adapter's (`....lora_A.weight`, `....lora_B.weight`, `...experts.lora_up_A`)."""
    return name.endswith((".lora_A.weight", ".lora_B.weight")) or name.rsplit(".", 1)[-1] in EXPERT_ADAPTERS


def target_of(name: str) -> str:
    """The adapted Linear's weight name of an adapter parameter: `layers.0.attn.q.lora_A.weight` ->
    `layers.0.attn.q.weight`."""
    return name.rsplit(".", 2)[0] + ".weight"


def adapter_shapes(base_shapes: dict[str, tuple[int, ...]], spec: LoraSpec) -> dict[str, tuple[int, ...]]:
    """Adapter parameter name -> shape, for the targeted Linear weights among `base_shapes` (model names)."""
    out = {}
    suffixes = tuple(f".{TARGET_MODULES[t]}.weight" for t in spec.targets if t in TARGET_MODULES)
    experts = tuple(f".moe.experts.{w}" for w in ("gate", "up", "down")) if "experts" in spec.targets else ()
    for name, shape in base_shapes.items():
        if name.startswith("layers.") and suffixes and name.endswith(suffixes) and len(shape) == 2:
            stem = name.removesuffix(".weight")
            out[f"{stem}.lora_A.weight"] = (spec.rank, shape[1])
            out[f"{stem}.lora_B.weight"] = (shape[0], spec.rank)
        elif experts and name.endswith(experts):  # stacked [E, out, in]
            stem, weight = name.rsplit(".", 1)
            out[f"{stem}.lora_{weight}_A"] = (shape[0], spec.rank, shape[2])
            out[f"{stem}.lora_{weight}_B"] = (shape[0], shape[1], spec.rank)
    return out


def initial_adapters(shapes: dict[str, tuple[int, ...]], seed: int, init: str) -> Iterator[tuple[str, torch.Tensor]]:
    """PEFT's initialization, the same whatever the layout (one generator per tensor, seeded from (seed, name)):
    A Kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in)) (or N(0, 1/rank) for `gaussian`), B zero,
    so the adapted model starts as the base."""
    for name, shape in shapes.items():  # A: [rank, in] ([E, rank, in] for experts); B: [out, rank]
        if name.endswith(("lora_B.weight", "_B")):
            yield name, torch.zeros(shape)
            continue
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        if init == "gaussian":
            yield name, torch.randn(shape, generator=g) / shape[-2]
        else:
            bound = 1.0 / math.sqrt(shape[-1])  # kaiming_uniform_(a=sqrt(5)): gain sqrt(1/3) * sqrt(3 / fan_in)
            yield name, (torch.rand(shape, generator=g) * 2 - 1) * bound


def attach(block: nn.Module, spec: LoraSpec, mesh: DeviceMesh | None = None, sequence_parallel: bool = False) -> None:
    """Add the adapters to the targeted Linear layers of one transformer layer (on the meta device, after tensor
    parallel and before FSDP) and freeze every base parameter of it."""
    for p in block.parameters():
        p.requires_grad_(False)
    if "experts" in spec.targets and hasattr(block, "moe"):
        attach_experts(block.moe.experts, spec)
    for target in (t for t in spec.targets if t in TARGET_MODULES):
        base = block.get_submodule(TARGET_MODULES[target]) if _has(block, TARGET_MODULES[target]) else None
        if not isinstance(base, nn.Linear):
            continue  # a layer without it (an MoE layer's MLP): checked over the whole model by the trainer
        out_features, in_features = base.weight.shape  # a DTensor's shape is the global one
        base.lora_A = nn.Linear(in_features, spec.rank, bias=False, device="meta")
        base.lora_B = nn.Linear(spec.rank, out_features, bias=False, device="meta")
        base.lora_scale, base.lora_dropout = spec.scale, spec.dropout
        base.lora_output = None
        if isinstance(base.weight, DTensor):
            _split_like_base(base, mesh, sequence_parallel)
        base.register_forward_hook(_add_adapter)


def attach_experts(experts: nn.Module, spec: LoraSpec) -> None:
    """Stacked per-expert adapters beside the stacked expert weights (split over expert-parallel ranks as they are;
    the trainer refuses expert tensor parallel with them)."""
    for weight in ("gate", "up", "down"):
        base = getattr(experts, weight)
        n, out_features, in_features = base.shape
        for part, shape in (("A", (n, spec.rank, in_features)), ("B", (n, out_features, spec.rank))):
            p = torch.empty(shape, device="meta")
            if isinstance(base, DTensor):
                p = distribute_tensor(p, base.device_mesh, base.placements, src_data_rank=None)
            setattr(experts, f"lora_{weight}_{part}", nn.Parameter(p))
    experts.lora_scale, experts.lora_dropout = spec.scale, spec.dropout


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def _split_like_base(base: nn.Linear, mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Column-parallel base (weight Shard(0)): A whole, B Shard(0). Row-parallel (Shard(1)): A Shard(1), B whole,
    and the output laid out as the base's (split over the sequence with sequence parallel)."""
    column = base.weight.placements[0] == Shard(0)
    placements: dict[str, Placement] = {"lora_A": Replicate() if column else Shard(1),
                                        "lora_B": Shard(0) if column else Replicate()}
    for part, placement in placements.items():
        linear = getattr(base, part)
        linear.weight = nn.Parameter(distribute_tensor(linear.weight, mesh, [placement], src_data_rank=None))
    if not column:
        base.lora_output = Shard(1) if sequence_parallel else Replicate()


def _add_adapter(base: nn.Linear, args: tuple, output: torch.Tensor) -> torch.Tensor:
    x = args[0]
    A, B = base.lora_A.weight, base.lora_B.weight
    if base.lora_dropout and base.training:
        x = _dropout(x, base.lora_dropout)
    if not isinstance(A, DTensor):  # one process, or FSDP alone (its unsharded parameters are plain tensors)
        x = x.to_local() if isinstance(x, DTensor) else x
        return output + F.linear(F.linear(x, A), B) * base.lora_scale
    if base.lora_output is None:  # column-parallel: x whole (Replicate), the output split like the base's
        y = F.linear(F.linear(x, A), B)  # Shard(-1)
        return output + y.to_local() * base.lora_scale
    h = F.linear(x, A)  # x split on features (Shard(-1)) and A on columns: partial sums (B, T, rank)
    if h.placements[0] != Replicate():
        h = h.redistribute(h.device_mesh, [Replicate()])  # an all-reduce of rank-sized vectors
    y = F.linear(h, B).redistribute(h.device_mesh, [base.lora_output])
    return output + y.to_local() * base.lora_scale


def _dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Dropout on this rank's values (tensor-parallel ranks draw the same numbers: the trainer seeds them alike)."""
    if not isinstance(x, DTensor):
        return F.dropout(x, p, training=True)
    local = F.dropout(x.to_local(), p, training=True)
    return DTensor.from_local(local, x.device_mesh, x.placements, run_check=False)
