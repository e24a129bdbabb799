"""AdamW and the learning-rate schedule: linear warmup, then cosine or linear decay to a floor.

AdamW runs fused (one kernel over all tensors of a device and dtype: PyTorch's `fused=True`) where PyTorch has that
kernel for the parameters' device, CPU and CUDA among them; elsewhere the multi-tensor `foreach` implementation.
Both compute the same update (tests/mtrain/test_mtrain_speed.py checks it); `optim.fused: false` forces foreach.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from mtrain.config import OptimConfig
from mtrain.errors import TrainError

# Optimizer state keyed by parameter name ("state.layers.3.attn.q.weight.exp_avg"), the same whatever the layout
# and however the parameters are split into pipeline stages: a checkpoint resumes under any layout.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """The learning rate of optimizer step `step` (0-based): Megatron's warmup + decay to min_lr."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = cfg.decay_steps or total_steps
    if cfg.decay_style == "constant" or decay_steps <= cfg.warmup_steps:
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / (decay_steps - cfg.warmup_steps))
    if cfg.decay_style == "linear":
        coeff = 1.0 - progress
    else:
        coeff = 0.5 * (math.cos(math.pi * progress) + 1.0)
    return cfg.min_lr + coeff * (cfg.lr - cfg.min_lr)


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases and norm weights, which are 1-D)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]  # LoRA adapters are all matrices: an empty group breaks DCP's state
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             **implementation(decay + no_decay, cfg.fused))


def implementation(params: list[torch.Tensor], fused: bool | None) -> dict[str, bool]:
    """AdamW's keyword for the fused kernel when asked for (or, with None, when every parameter's device has it),
    for foreach otherwise. PyTorch lists the devices with a fused AdamW in _get_fused_kernels_supported_devices."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    supported = set(_get_fused_kernels_supported_devices())
    can = bool(params) and all(p.device.type in supported and p.is_floating_point() for p in params)
    if fused is None:
        fused = can
    elif fused and not can:
        devices = sorted({p.device.type for p in params} - supported)
        raise TrainError(f"optim.fused is true but PyTorch has no fused AdamW for {', '.join(devices) or 'these'} "
                         "parameters; set optim.fused to null (automatic) or false")
    return {"fused": True} if fused else {"foreach": True}


class Optimizers:
    """One AdamW per model part (pipeline stage), driven as one."""

    def __init__(self, parts: list[nn.Module], cfg: OptimConfig):
        self.parts = parts
        self.optimizers = [build_optimizer(part, cfg) for part in parts]

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def set_lr(self, lr: float) -> None:
        for group in self.param_groups:
            group["lr"] = lr

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        """Every part's state under parameter names (sharded tensors stay sharded)."""
        out: dict = {}
        for part, opt in zip(self.parts, self.optimizers):
            out.update(get_optimizer_state_dict(part, opt, options=FLAT))
        return out

    def load_state_dict(self, state: dict) -> None:
        """Each part takes its own parameters' state from `state` (as returned by state_dict, then filled)."""
        for part, opt in zip(self.parts, self.optimizers):
            set_optimizer_state_dict(part, opt, state, options=FLAT)
