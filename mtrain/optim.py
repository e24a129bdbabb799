"""AdamW and the learning-rate schedule: linear warmup, then cosine or linear decay to a floor."""

from __future__ import annotations

import math

import torch
from torch import nn

from mtrain.config import OptimConfig


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
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=True)
