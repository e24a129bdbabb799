"""Mixture of experts as in Mixtral: a top-k softmax router, SwiGLU experts, a load-balancing auxiliary loss.

The experts live in one module with stacked weights (`gate`, `up`: [E, f, h]; `down`: [E, h, f]) and take
tokens already grouped by expert plus the count per expert. Expert parallelism (issue 7) shards these weights
on dim 0 and wraps `GroupedExperts.forward` with the token all-to-all; nothing here has to change for that.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mconvert.ir import ModelConfig


class GroupedExperts(nn.Module):
    """E SwiGLU MLPs: expert e computes down[e] @ (silu(gate[e] @ x) * (up[e] @ x))."""

    def __init__(self, num_experts: int, hidden: int, ffn: int):
        super().__init__()
        self.gate = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.up = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, ffn))

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x: (N, h) sorted by expert; tokens_per_expert: (E_local,) counts summing to N."""
        outputs = []
        for e, chunk in enumerate(torch.split(x, tokens_per_expert.tolist())):
            if chunk.shape[0]:
                hidden = F.silu(chunk @ self.gate[e].T) * (chunk @ self.up[e].T)  # (n_e, f)
                outputs.append(hidden @ self.down[e].T)  # (n_e, h)
        return torch.cat(outputs) if outputs else x.new_zeros(x.shape)


class _AuxLossGradient(torch.autograd.Function):
    """Identity on `out` that, in backward, also sends gradient `scale` into `aux_loss`.

    The auxiliary loss thus trains the router without being returned through every layer (which pipeline
    stages and activation checkpointing would have to carry); Megatron-Core's MoEAuxLossAutoScaler trick.
    """

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.scale), None


def load_balancing_loss(probs: torch.Tensor, top_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch Transformer's loss for one layer: E * sum_e (fraction of top-k picks of e) * (mean prob of e).

    probs: (N, E) router softmax; top_idx: (N, k). The same normalization as transformers' Mixtral
    `load_balancing_loss_func` given one layer (the fractions sum to k, not 1).
    """
    picks = torch.bincount(top_idx.flatten(), minlength=num_experts).to(probs.dtype) / probs.shape[0]
    return num_experts * torch.sum(picks * probs.mean(dim=0))


class MoE(nn.Module):
    """Router + experts. Routing as HF Mixtral: softmax over all experts (fp32), top-k, renormalize."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.num_experts, self.top_k = c.num_experts, c.moe_top_k
        self.jitter_eps = c.moe_jitter_eps or 0.0
        # The loss is the mean of the layers' losses times the coefficient; the trainer multiplies in its
        # gradient-accumulation factor through `aux_loss_scale` (see set_aux_loss_scale).
        self.aux_coeff = (c.moe_aux_loss_coeff or 0.0) / c.num_layers
        self.aux_loss_scale = 1.0
        self.last_aux_loss: torch.Tensor | None = None  # for logging: this layer's loss at the last forward
        self.router = nn.Linear(c.hidden_size, c.num_experts, bias=False)
        self.experts = GroupedExperts(c.num_experts, c.hidden_size, c.ffn_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, h = x.shape
        x = x.reshape(B * T, h)
        if self.training and self.jitter_eps > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter_eps, 1.0 + self.jitter_eps)
        probs = F.softmax(self.router(x).float(), dim=-1)  # (N, E)
        top_w, top_idx = torch.topk(probs, self.top_k, dim=-1)  # (N, k)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)

        # Group the N*k (token, expert) pairs by expert; a stable sort keeps token order within an expert.
        flat_idx = top_idx.flatten()
        order = torch.argsort(flat_idx, stable=True)
        token = order // self.top_k
        counts = torch.bincount(flat_idx, minlength=self.num_experts)
        y = self.experts(x[token], counts)  # (N*k, h)
        y = y * top_w.flatten()[order, None].to(y.dtype)
        out = torch.zeros_like(x).index_add_(0, token, y.to(x.dtype)).reshape(B, T, h)

        aux = load_balancing_loss(probs, top_idx, self.num_experts)
        self.last_aux_loss = aux.detach()
        if self.training and self.aux_coeff > 0 and torch.is_grad_enabled():
            out = _AuxLossGradient.apply(out, aux, self.aux_coeff * self.aux_loss_scale)
        return out


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """Scale every MoE layer's auxiliary-loss gradient, e.g. by 1/micro-batches under gradient accumulation."""
    for m in model.modules():
        if isinstance(m, MoE):
            m.aux_loss_scale = scale


def aux_loss(model: nn.Module) -> float | None:
    """The mean auxiliary loss over MoE layers at the last forward (None for dense models)."""
    losses = [m.last_aux_loss for m in model.modules() if isinstance(m, MoE) and m.last_aux_loss is not None]
    return float(torch.stack(losses).mean()) if losses else None
