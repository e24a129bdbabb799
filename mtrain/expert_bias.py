"""DeepSeek-V3's auxiliary-loss-free load balancing: the router's expert bias follows the expert loads.

Experts are chosen by score + bias (the bias never weighs an expert's output, see MoE.route_sigmoid). After each
optimizer step every MoE layer moves its bias by a fixed rate towards balance, from the (token, expert) pairs
routed in that step, summed over its micro-batches and over the ranks that routed other tokens:

    load_e = pairs routed to expert e          mean = sum_e load_e / E
    bias_e += rate * sign(mean - load_e)       (an overloaded expert loses rate, an underloaded one gains it)

as megatron-core does with moe_router_enable_expert_bias and moe_router_bias_update_rate (DeepSeek-V3: 1e-3;
arXiv 2408.15664). The loads are summed over the "dp_cp" ranks: data-parallel ranks (expert-parallel ones
among them) and context-parallel ranks route different tokens; tensor-parallel ranks route the same tokens, so
their counts are equal and need no sum (Megatron also sums over them, which scales every load alike and leaves
each sign unchanged). Each pipeline rank updates the layers it holds.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mtrain.models.moe import MoE
from mtrain.parallel.grads import local_tensor


def updated_bias(bias: torch.Tensor, loads: torch.Tensor, rate: float) -> torch.Tensor:
    """The new bias of one or more layers: bias, loads (..., E); rate: the step of every expert's bias."""
    loads = loads.to(torch.float64)  # counts: exact
    mean = loads.sum(dim=-1, keepdim=True) / loads.shape[-1]
    return bias + rate * torch.sign(mean - loads).to(bias.dtype)


class ExpertBiasUpdater:
    """Moves the expert bias of every MoE layer of this rank's parts after each optimizer step."""

    def __init__(self, parts: list[nn.Module], rate: float, group: dist.ProcessGroup | None = None):
        self.layers = [m for part in parts for m in part.modules()
                       if isinstance(m, MoE) and hasattr(m.router, "expert_bias")]
        self.rate, self.group = rate, group

    def step(self) -> None:
        """Apply the update from the loads routed since the last call, then start counting afresh."""
        if not self.layers:
            return
        loads = torch.stack([m.routed if m.routed is not None else torch.zeros_like(local_tensor(m.router.expert_bias))
                             for m in self.layers]).to(torch.float64)  # (layers, E), exact sums of counts
        if self.group is not None:
            dist.all_reduce(loads, group=self.group)
        with torch.no_grad():
            for m, load in zip(self.layers, loads):
                bias = local_tensor(m.router.expert_bias)  # a replicated DTensor under tensor parallel
                bias.copy_(updated_bias(bias, load, self.rate))
                m.routed = None
