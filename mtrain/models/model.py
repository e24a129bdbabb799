"""The decoder-only transformer for every IR family: architecture only.

    tokens (B, T) ─ embed (+ pos_embed) ─ layers["0"] … layers["L-1"] ─ final_norm ─ lm_head ─ logits (B, T, V)
    each layer:  h = h + attn(attn_norm(h));  h = h + mlp(mlp_norm(h))   (mlp is a MoE for Mixtral)

Parameter names are the IR names (see mconvert/ir_names.py), except the MoE experts, which are stacked in one
module (state_dict_adapter.py maps them). Build the model on the meta device, apply parallelism from outside
(parallelize.py), then `to_empty()` and `init_buffers()`; weights come from weights.py. Layers live in a
ModuleDict keyed by their global index, so a pipeline stage can drop layers and keep checkpoint names, and
`embed`, `final_norm`, `lm_head` may be None on stages that do not hold them (issue 7).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mconvert.ir import ModelConfig
from mtrain.models import rope
from mtrain.models.moe import MoE


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back as in HF Llama."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * y.to(x.dtype)


def make_norm(c: ModelConfig) -> nn.Module:
    if c.norm == "layernorm":
        return nn.LayerNorm(c.hidden_size, eps=c.norm_eps)
    return RMSNorm(c.hidden_size, c.norm_eps)


class Attention(nn.Module):
    """Multi-head attention with grouped key/value heads (GQA), rotary or no positions, optional window."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.head_dim = c.head_dim
        self.q = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.qkv_bias)
        self.k = nn.Linear(c.hidden_size, c.num_query_groups * c.head_dim, bias=c.qkv_bias)
        self.v = nn.Linear(c.hidden_size, c.num_query_groups * c.head_dim, bias=c.qkv_bias)
        self.o = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.proj_bias)

    def forward(self, x: torch.Tensor, rot: tuple[torch.Tensor, torch.Tensor] | None,
                mask: torch.Tensor | None) -> torch.Tensor:
        B, T, _ = x.shape
        # Head counts come from the weights (-1), so a tensor-parallel shard works with its local heads.
        q = self.q(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, ng, T, hd)
        v = self.v(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, ng, T, hd)
        if rot is not None:
            q, k = rope.apply(q, *rot), rope.apply(k, *rot)
        # Query head i reads key/value group i // (nh/ng), as HF's repeat_kv does.
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=q.shape[1] != k.shape[1])  # (B, nh, T, hd)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); otherwise down(act(up(x))) with GELU (tanh approximation for GPT-2)."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.activation = c.activation
        if c.gated:
            self.gate = nn.Linear(c.hidden_size, c.ffn_hidden_size, bias=c.mlp_bias)
        self.up = nn.Linear(c.hidden_size, c.ffn_hidden_size, bias=c.mlp_bias)
        self.down = nn.Linear(c.ffn_hidden_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            return self.down(F.silu(self.gate(x)) * self.up(x))
        approximate = "tanh" if self.activation == "gelu_tanh" else "none"
        return self.down(F.gelu(self.up(x), approximate=approximate))


class Block(nn.Module):
    """One pre-norm transformer layer."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.attn_norm = make_norm(c)
        self.attn = Attention(c)
        self.mlp_norm = make_norm(c)
        if c.is_moe:
            self.moe = MoE(c)
        else:
            self.mlp = MLP(c)

    def forward(self, h: torch.Tensor, rot: tuple[torch.Tensor, torch.Tensor] | None,
                mask: torch.Tensor | None) -> torch.Tensor:
        h = h + self.attn(self.attn_norm(h), rot, mask)
        ffn = self.moe if hasattr(self, "moe") else self.mlp
        return h + ffn(self.mlp_norm(h))


class Transformer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.config = c
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.pos_embed = nn.Embedding(c.max_position_embeddings, c.hidden_size) \
            if c.position_embedding == "learned" else None
        self.layers = nn.ModuleDict({str(i): Block(c) for i in range(c.num_layers)})
        self.final_norm = make_norm(c)
        self.lm_head = None if c.tie_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.register_buffer("inv_freq", torch.empty(c.head_dim // 2), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        """(Re)compute the non-persistent buffers: needed after `to_empty()` from the meta device."""
        if self.config.position_embedding == "rope" and self.inv_freq.device.type != "meta":
            c = self.config
            with torch.no_grad():
                self.inv_freq.copy_(rope.inv_freq(c.head_dim, c.rope_theta, c.rope_scaling))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, V). On a pipeline stage without `embed`, `tokens` are hidden states."""
        T = tokens.shape[1]
        if positions is None:
            positions = torch.arange(T, device=tokens.device)
        h = self.embed(tokens) if self.embed is not None else tokens  # (B, T, h)
        if self.pos_embed is not None and self.embed is not None:
            h = h + self.pos_embed(positions)
        rot = rope.cos_sin(self.inv_freq, positions) if self.config.position_embedding == "rope" else None
        mask = self.attention_mask(positions)
        for layer in self.layers.values():
            h = layer(h, rot, mask)
        if self.final_norm is None:
            return h
        h = self.final_norm(h)
        return self.lm_head(h) if self.lm_head is not None else F.linear(h, self.embed.weight)

    def attention_mask(self, positions: torch.Tensor) -> torch.Tensor | None:
        """None for plain causal attention (SDPA's is_causal); a boolean (T, T) mask with a sliding window,
        where query i sees keys j with i - window < j <= i (HF Mistral's window: the token and window-1 before)."""
        window = self.config.sliding_window
        if window is None or positions.shape[0] <= window:
            return None
        i, j = positions[:, None], positions[None, :]
        return (j <= i) & (j > i - window)
