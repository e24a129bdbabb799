"""Parallelism and memory savers applied from outside to a model built on the meta device.

    with torch.device("meta"): model = Transformer(config)
    parallelize(model, mesh, ...)      # activation recomputation, then FSDP2 or DDP over the "dp" mesh
    model.to_empty(device=...); model.init_buffers(); weights.load_full_weights(model, ...)

Data parallel is FSDP2 (`fully_shard` per layer and at the root: parameters, gradients and optimizer state
sharded over the ranks; bf16 compute with fp32 master weights through its MixedPrecisionPolicy) or DDP
(`replicate`). Tensor, pipeline, expert and context parallel (issue 7) are applied here too, before FSDP.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh

from mconvert.ir import ModelConfig
from mtrain.models.model import Transformer

DPMode = Literal["fsdp", "ddp"]
Precision = Literal["fp32", "bf16"]
Recompute = Literal["none", "full"]


def build_model(config: ModelConfig, *, device: torch.device, mesh: DeviceMesh | None = None,
                dp_mode: DPMode = "fsdp", precision: Precision = "fp32", recompute: Recompute = "none") -> Transformer:
    """A parallelized model with uninitialized weights (fp32) and initialized buffers on `device`."""
    with torch.device("meta"):
        model = Transformer(config)
    parallelize(model, mesh, dp_mode=dp_mode, precision=precision, recompute=recompute)
    model.to_empty(device=device)
    model.init_buffers()
    return model


def parallelize(model: Transformer, mesh: DeviceMesh | None, *, dp_mode: DPMode, precision: Precision,
                recompute: Recompute) -> None:
    if recompute == "full":
        apply_recompute(model)
    if mesh is None:
        return
    if dp_mode == "fsdp":
        apply_fsdp(model, mesh, precision)
    else:
        apply_ddp(model, mesh)


def apply_recompute(model: Transformer) -> None:
    """Recompute each layer's activations in backward instead of keeping them (saves memory, costs a forward)."""
    for name, block in list(model.layers.items()):
        model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=True)


def apply_fsdp(model: Transformer, mesh: DeviceMesh, precision: Precision) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if precision == "bf16" else None,
                              reduce_dtype=torch.float32)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=mp)
    # The root group holds the embeddings, final norm and head; it stays gathered after forward because
    # backward needs it first.
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)


def apply_ddp(model: nn.Module, mesh: DeviceMesh) -> None:
    from torch.distributed._composable.replicate import replicate

    replicate(model, device_mesh=mesh)


def uses_fsdp_mixed_precision(model: nn.Module) -> bool:
    """True when FSDP already casts to bf16 (then no autocast is needed)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)
