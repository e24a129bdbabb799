"""Mixture of experts as in Mixtral: a top-k softmax router, SwiGLU experts, a load-balancing auxiliary loss; and
as in DeepSeek-V3 (config fields, see mconvert/ir/features.py): sigmoid scores, a per-expert bias that only chooses,
group-limited top-k, a scaling of the routed output, shared experts every token goes through.

The experts live in one module with stacked weights (`gate`, `up`: [E, f, h]; `down`: [E, h, f]) and take
tokens already grouped by expert plus the count per expert. `MoE.dispatch` hands them to the experts: here
directly; expert parallel (mtrain/parallel/expert_parallel.py) shards the stacked weights on dim 0 and swaps in
a dispatch that sends each token to the rank owning its expert and back. Sharded weights are DTensors: the
experts compute with their local shard.

Routing is dropless by default; with a capacity factor each expert takes at most
ceil(factor * tokens * top_k / experts) (token, expert) pairs of a micro-batch, the first ones in token order,
and the rest are dropped (their share of the output is zero, as in GShard and Megatron's position drop policy).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from mconvert.ir.config import ModelConfig


class GroupedExperts(nn.Module):
    """E gated MLPs: expert e computes down[e] @ unit(gate[e] @ x, up[e] @ x) (SwiGLU, or the model's gated unit,
    see model.gated_unit), with biases `gate_bias`, `up_bias` [E, f] and `down_bias` [E, h] when `bias`."""

    def __init__(self, num_experts: int, hidden: int, ffn: int, unit: Callable | None = None, bias: bool = False):
        super().__init__()
        self.gate = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.up = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        if bias:
            self.gate_bias = nn.Parameter(torch.zeros(num_experts, ffn))
            self.up_bias = nn.Parameter(torch.zeros(num_experts, ffn))
            self.down_bias = nn.Parameter(torch.zeros(num_experts, hidden))
        self.unit = unit or (lambda g, u: F.silu(g) * u)
        self.down_bias_after_sum = False  # expert tensor parallel adds down's bias after summing the ranks' parts

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x: (N, h) sorted by expert; tokens_per_expert: (E_local,) counts summing to N."""
        # The local shard under expert/tensor parallel; cast for FSDP's bf16 compute (the experts are not FSDP's).
        gate, up, down = (_local(w).to(x.dtype) for w in (self.gate, self.up, self.down))
        bias = hasattr(self, "gate_bias")
        if bias:
            gate_b, up_b, down_b = (_local(w).to(x.dtype) for w in (self.gate_bias, self.up_bias, self.down_bias))
        outputs = []
        lora = self._lora(x.dtype) if hasattr(self, "lora_gate_A") else None
        # Experts without tokens still run (on 0 rows), so every shard has a gradient, if only zeros.
        for e, chunk in enumerate(torch.split(x, tokens_per_expert.tolist())):
            if bias:
                g, u = F.linear(chunk, gate[e], gate_b[e]), F.linear(chunk, up[e], up_b[e])
            else:
                g, u = chunk @ gate[e].T, chunk @ up[e].T  # (n_e, f)
            if lora is not None:  # LoRA (models/lora.py): + scale * B A x, per expert
                g, u = g + lora.add("gate", e, chunk), u + lora.add("up", e, chunk)
            hidden = self.unit(g, u)
            if bias:
                y = F.linear(hidden, down[e], None if self.down_bias_after_sum else down_b[e])
            else:
                y = hidden @ down[e].T  # (n_e, h)
            outputs.append(y if lora is None else y + lora.add("down", e, hidden))
        return torch.cat(outputs)

    def _lora(self, dtype: torch.dtype) -> _ExpertAdapters:
        return _ExpertAdapters({n: _local(getattr(self, f"lora_{n}")).to(dtype) for n in
                                ("gate_A", "gate_B", "up_A", "up_B", "down_A", "down_B")}, self.lora_scale,
                               self.lora_dropout if self.training else 0.0)

    def add_down_bias(self, y: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """y (the summed outputs, grouped by expert) plus each row's expert's down bias (expert tensor parallel)."""
        if not hasattr(self, "down_bias"):
            return y
        bias = _local(self.down_bias).to(y.dtype)  # (E_local, h)
        return y + bias.repeat_interleave(tokens_per_expert.to(bias.device), dim=0)


class _ExpertAdapters:
    """The local experts' stacked LoRA adapters: `add(weight, e, x)` is scale * dropout(x) A[e]^T B[e]^T."""

    def __init__(self, tensors: dict[str, torch.Tensor], scale: float, dropout: float):
        self.tensors, self.scale, self.dropout = tensors, scale, dropout

    def add(self, weight: str, e: int, x: torch.Tensor) -> torch.Tensor:
        x = F.dropout(x, self.dropout) if self.dropout else x
        return (x @ self.tensors[f"{weight}_A"][e].T) @ self.tensors[f"{weight}_B"][e].T * self.scale


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if isinstance(w, DTensor) else w


def run_experts(x: torch.Tensor, tokens_per_expert: torch.Tensor, experts: nn.Module) -> torch.Tensor:
    """The single-process dispatch: every expert is local."""
    return experts(x, tokens_per_expert)


class AddLossGradient(torch.autograd.Function):
    """Identity on `out` that, in backward, also sends gradient `scale` into `aux_loss`.

    The auxiliary loss thus trains the router without being returned through every layer (which pipeline
    stages and activation checkpointing would have to carry); Megatron-Core's MoEAuxLossAutoScaler trick. The MTP
    loss enters the same way (mtp.py).
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


def load_balancing_loss(probs: torch.Tensor, top_idx: torch.Tensor, num_experts: int,
                        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Switch Transformer's loss for one layer: E * sum_e (fraction of top-k picks of e) * (mean prob of e).

    probs: (N, E) router softmax; top_idx: (N, k). The same normalization as transformers' Mixtral
    `load_balancing_loss_func` given one layer (the fractions sum to k, not 1). `reduce` sums statistics over
    the ranks holding other parts of the same sequences (context parallel), so the loss is the whole sequence's.
    """
    stats = torch.cat([torch.bincount(top_idx.flatten(), minlength=num_experts).to(probs.dtype),
                       probs.sum(dim=0), probs.new_tensor([probs.shape[0]])])  # picks, prob sums, tokens
    if reduce is not None:
        stats = reduce(stats)
    picks, prob_sums, tokens = stats[:num_experts], stats[num_experts:-1], stats[-1]
    return num_experts * torch.sum(picks.detach() / tokens * (prob_sums / tokens))


def keep_within_capacity(order: torch.Tensor, expert_of: torch.Tensor, counts: torch.Tensor, capacity: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the (token, expert) pairs past each expert's capacity, keeping the first in token order.

    order: the pairs grouped by expert (stable sort, so token order within an expert); expert_of: the expert of
    each pair in that order; counts: pairs per expert. Returns the kept `order` and the new counts.
    """
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(order.shape[0], device=order.device) - starts[expert_of]
    return order[rank_in_expert < capacity], counts.clamp(max=capacity)


class SharedExperts(nn.Module):
    """DeepSeek's shared experts: one SwiGLU MLP (of all of them side by side) added to the routed output."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MoE(nn.Module):
    """Router + experts. Routing as HF Mixtral and Qwen3-MoE: softmax over all experts (fp32), top-k, renormalized
    to sum to 1 unless the config says not to (moe_norm_topk); or as DeepSeek-V3 (`route_sigmoid`)."""

    def __init__(self, c: ModelConfig, unit: Callable | None = None):
        super().__init__()
        self.num_experts, self.top_k = c.num_experts, c.moe_top_k
        self.jitter_eps = c.moe_jitter_eps or 0.0
        # The loss is the mean of the layers' losses times the coefficient; the trainer multiplies in its
        # gradient-accumulation factor through `aux_loss_scale` (see set_aux_loss_scale).
        self.aux_coeff = (c.moe_aux_loss_coeff or 0.0) / c.num_moe_layers
        self.aux_loss_scale = 1.0
        # for logging: this layer's losses summed over the training forwards since take_aux_losses, and their count
        self.aux_sum: torch.Tensor | None = None
        self.aux_count = 0
        self.capacity_factor: float | None = None  # None: dropless
        self.dispatch: Callable[[torch.Tensor, torch.Tensor, nn.Module], torch.Tensor] = run_experts
        self.reduce_stats: Callable[[torch.Tensor], torch.Tensor] | None = None  # context parallel
        self.router = nn.Linear(c.hidden_size, c.num_experts, bias=c.moe_router_bias)  # GPT-OSS's bias
        self.norm_topk = c.moe_norm_topk
        self.sigmoid, self.scaling = c.moe_router_score == "sigmoid", c.moe_router_scaling_factor
        self.groups, self.group_topk = c.moe_router_groups, c.moe_router_group_topk
        # The IR's layers.{L}.moe.router.expert_bias: a buffer (saved and exported, never seen by the optimizer),
        # moved by the trainer from the expert loads of each step (mtrain/expert_bias.py).
        if c.moe_router_expert_bias:
            self.router.register_buffer("expert_bias", torch.zeros(c.num_experts))
        self.routed: torch.Tensor | None = None  # (E,) (token, expert) pairs routed in training since the last reset
        self.count_loads = True  # off for a pipeline stage's shape-inference pass (parallel/pipeline.py)
        self.experts = GroupedExperts(c.num_experts, c.hidden_size, c.expert_ffn_hidden_size, unit, bias=c.mlp_bias)
        if c.moe_shared_expert_ffn_hidden_size:
            self.shared = SharedExperts(c.hidden_size, c.moe_shared_expert_ffn_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, h = x.shape
        x = x.reshape(B * T, h)
        if self.training and self.jitter_eps > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter_eps, 1.0 + self.jitter_eps)
        if self.sigmoid:
            probs, top_w, top_idx = self.route_sigmoid(x)
        else:
            logits = self.router(x)
            probs = F.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)  # (N, E)
            top_w, top_idx = torch.topk(probs, self.top_k, dim=-1)  # (N, k)
            if self.norm_topk:  # HF's norm_topk_prob (Mixtral always); otherwise the weights of the full softmax
                top_w = top_w / top_w.sum(dim=-1, keepdim=True)
            top_w = top_w * self.scaling if self.scaling != 1.0 else top_w

        # Group the N*k (token, expert) pairs by expert; a stable sort keeps token order within an expert.
        flat_idx = top_idx.flatten()
        order = torch.argsort(flat_idx, stable=True)
        counts = torch.bincount(flat_idx, minlength=self.num_experts)
        if self.capacity_factor is not None:
            capacity = math.ceil(self.capacity_factor * flat_idx.shape[0] / self.num_experts)
            order, counts = keep_within_capacity(order, flat_idx[order], counts, capacity)
        self._count_loads(counts)
        token = order // self.top_k
        y = self.dispatch(x[token], counts, self.experts)  # (pairs, h), in the order of `order`
        y = y * top_w.flatten()[order, None].to(y.dtype)
        out = torch.zeros_like(x).index_add_(0, token, y.to(x.dtype)).reshape(B, T, h)
        if hasattr(self, "shared"):
            out = out + self.shared(x.reshape(B, T, h))

        aux = load_balancing_loss(probs, top_idx, self.num_experts, self.reduce_stats)
        if self.training and torch.is_grad_enabled() and self.count_loads:
            self.aux_sum = aux.detach() if self.aux_sum is None else self.aux_sum + aux.detach()
            self.aux_count += 1
        if self.training and self.aux_coeff > 0 and torch.is_grad_enabled():
            out = AddLossGradient.apply(out, aux, self.aux_coeff * self.aux_loss_scale)
        return out

    def _count_loads(self, counts: torch.Tensor) -> None:
        """Add the pairs each expert takes (after any capacity drop, as megatron-core counts them) to the loads that
        move the expert bias: in training only. Full recomputation routes every micro-batch twice, which doubles
        all loads alike and leaves the update (a sign per expert) as it is."""
        if self.training and torch.is_grad_enabled() and self.count_loads and hasattr(self.router, "expert_bias"):
            self.routed = counts.detach() if self.routed is None else self.routed + counts.detach()

    def route_sigmoid(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """DeepSeek-V3's routing in float32 (a float64 model's in float64): (scores normalized per token, for the
        auxiliary-loss statistics; top-k weights; top-k experts). Experts are chosen by score + expert bias, among the
        `group_topk` groups whose two best choice scores sum highest; weighed by their score, renormalized (+1e-20)
        and scaled."""
        # the local weight: a replicated DTensor under tensor parallel (its gradient is the same on every tp rank)
        dtype = torch.promote_types(x.dtype, torch.float32)
        scores = torch.sigmoid(F.linear(x.to(dtype), _local(self.router.weight).to(dtype)))  # (N, E)
        bias = getattr(self.router, "expert_bias", None)
        choice = scores + _local(bias).to(dtype) if bias is not None else scores
        if self.groups:
            N = choice.shape[0]
            group_scores = choice.view(N, self.groups, -1).topk(2, dim=-1)[0].sum(dim=-1)  # (N, groups)
            keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(self.group_topk, dim=-1)[1], 1.0)
            keep = keep.unsqueeze(-1).expand(N, self.groups, self.num_experts // self.groups).reshape(N, -1)
            choice = choice.masked_fill(keep == 0, float("-inf"))
        top_idx = torch.topk(choice, self.top_k, dim=-1)[1]  # (N, k)
        top_w = scores.gather(1, top_idx)
        if self.norm_topk:
            top_w = top_w / (top_w.sum(dim=-1, keepdim=True) + 1e-20)
        return scores / scores.sum(dim=-1, keepdim=True), top_w * self.scaling, top_idx


def take_aux_losses(model: nn.Module) -> tuple[float, int]:
    """(the sum of the MoE layers' auxiliary losses over the training forwards since the last call, how many) of
    `model`, and start counting again. A micro-batch's loss is the same whatever the layout (its statistics are the
    whole micro-batch's), so the mean over a step's micro-batches and layers is too; full recomputation runs every
    forward twice, which doubles sum and count alike."""
    total, count = 0.0, 0
    for m in model.modules():
        if isinstance(m, MoE) and m.aux_sum is not None:
            total, count = total + float(m.aux_sum), count + m.aux_count
            m.aux_sum, m.aux_count = None, 0
    return total, count


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """Scale every MoE layer's auxiliary-loss gradient, e.g. by 1/micro-batches under gradient accumulation."""
    for m in model.modules():
        if isinstance(m, MoE):
            m.aux_loss_scale = scale
