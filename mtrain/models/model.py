"""The decoder-only transformer for every IR family: architecture only.

    tokens (B, T) ─ embed (+ pos_embed) ─ layers["0"] … layers["L-1"] ─ final_norm ─ lm_head ─ logits (B, T, V)
    each layer:  h = h + attn(attn_norm(h));  h = h + mlp(mlp_norm(h))   (a MoE in the expert layers)
                 with sandwich norms (Gemma 3): h = h + post_attn_norm(attn(...)); h = h + post_mlp_norm(mlp(...))

Parameter names are the IR names (see mconvert/ir/names.py), except the MoE experts, which are stacked in one
module (state_dict_adapter.py maps them). Build the model on the meta device, apply parallelism from outside
(parallelize.py), then `to_empty()` and `init_buffers()`; weights come from weights.py.

A pipeline stage is a Transformer built with `layers=` (global indices: layers live in a ModuleDict keyed by
them, so checkpoint names do not depend on the stage) and `first=`/`last=`: only the first stage embeds tokens,
only the last has `final_norm` and the head. With tied embeddings the last stage keeps its own `embed` (its
weight is the head's; the trainer keeps both copies equal by summing their gradients).

Hooks for parallelism, with plain single-process defaults: `sequence` says which positions this rank's tokens
have (context parallel) and how much shorter hidden states are than tokens (sequence parallel);
`Attention.core` is the attention kernel (context parallel swaps in one that gathers keys and values);
`MoE.dispatch` runs the experts (expert parallel swaps in the all-to-all).

Generation passes a `KVCache` (kv_cache.py): `model(tokens, cache=cache)` runs the new tokens at the positions
after the cached ones, and each attention appends its keys and values to its layer's slot (`LayerContext.cache`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from mconvert.ir.config import ModelConfig
from mtrain.errors import TrainError
from mtrain.models import mtp, rope
from mtrain.models.kv_cache import KVCache, LayerCache
from mtrain.models.mla import MLAttention
from mtrain.models.moe import MoE


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 (fp64 stays fp64) and cast back as in HF Llama; with `zero_centered`
    x / rms(x) * (1 + weight), all in fp32 and cast back at the end, as HF Gemma 3 computes it."""

    def __init__(self, size: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.weight = nn.Parameter(torch.zeros(size) if zero_centered else torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.zero_centered:
            y = F.rms_norm(x.to(torch.promote_types(x.dtype, torch.float32)), (x.shape[-1],), eps=self.eps)
            return (y * (1.0 + self.weight.to(y.dtype))).to(x.dtype)
        if x.dtype == self.weight.dtype == torch.float32 and not isinstance(self.weight, DTensor):
            return F.rms_norm(x, (x.shape[-1],), self.weight, eps=self.eps)  # one kernel, the same bits
        y = F.rms_norm(x.to(torch.promote_types(x.dtype, torch.float32)), (x.shape[-1],), eps=self.eps)
        return self.weight * y.to(x.dtype)


def make_norm(c: ModelConfig, size: int | None = None) -> nn.Module:
    """The model's norm over `size` features (the hidden size unless given)."""
    size = size or c.hidden_size
    if c.norm == "layernorm":
        if c.norm_zero_centered:
            raise TrainError("norm_zero_centered (weights applied as 1 + w) is implemented for rmsnorm only")
        return nn.LayerNorm(size, eps=c.norm_eps)
    return RMSNorm(size, c.norm_eps, c.norm_zero_centered)


class LayerContext(NamedTuple):
    """What every layer needs besides the hidden states: rotary angles, token positions, the window, and in
    generation the layer's key/value cache."""

    rot: tuple[torch.Tensor, torch.Tensor] | None  # cos, sin: each (T, hd)
    positions: torch.Tensor  # (T,) position of each local token in its sequence
    window: int | None  # sliding-window length
    cache: LayerCache | None = None  # this layer's slot of the KVCache (generation); None in training
    local_rot: tuple[torch.Tensor, torch.Tensor] | None = None  # the windowed layers' own angles (local_rope_theta)
    causal: bool = True  # False: every query sees every key (BERT's bidirectional encoder), but `key_mask`'s zeros
    key_mask: torch.Tensor | None = None  # (B, 1, 1, Tk) bool, True where a key may be seen (not padding)


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean (Tq, Tk) mask: query at position i sees keys at j with i - window < j <= i (HF Mistral's window:
    the token and window-1 before it); causal only when window is None."""
    i, j = q_pos[:, None], k_pos[None, :]
    mask = j <= i
    return mask & (j > i - window) if window is not None else mask


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
           scale: float | None, softcap: float | None) -> torch.Tensor:
    """softmax(q k^T * scale (soft-capped: cap * tanh(. / cap)) + mask) v: (B, nh, Tq, hd). Query head i reads
    key/value group i // (nh/ng), as HF's repeat_kv does. Soft-capping has no SDPA kernel: it is computed
    explicitly (the softmax in fp32, as transformers' eager attention)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


class CoreAttention(nn.Module):
    """softmax(q k^T * scale + mask) v (no parameters); the scale is 1/sqrt(hd) unless the attention sets `scale`
    (MLA with YaRN, Gemma's query_pre_attn_scalar), the scores soft-capped when it sets `softcap`. Queries and keys
    are the same positions, or, with a key/value cache, the keys are positions 0 … Tk-1 and the queries the last
    Tq of them."""

    def __init__(self) -> None:
        super().__init__()
        self.scale: float | None = None
        self.softcap: float | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        if not ctx.causal:  # bidirectional: padding keys aside, every query sees every key
            return attend(q, k, v, ctx.key_mask, False, self.scale, self.softcap)
        Tq, Tk = q.shape[2], k.shape[2]
        window_bites = ctx.window is not None and Tk > ctx.window
        # SDPA's own causal path for a whole sequence, no mask for one query that sees every cached key, an
        # explicit mask otherwise (a window that bites, or several new queries after cached keys).
        mask, causal = None, Tq == Tk
        if window_bites or Tq not in (1, Tk):
            # cached keys are consecutive positions up to the last query's (a windowed cache keeps only the last)
            k_pos = ctx.positions if Tq == Tk else torch.arange(Tk, device=q.device) + (ctx.positions[-1] + 1 - Tk)
            mask, causal = attention_mask(ctx.positions, k_pos, ctx.window), False
        return attend(q, k, v, mask, causal, self.scale, self.softcap)  # (B, nh, Tq, hd)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, ctx: LayerContext,
                   scale: float | None = None) -> torch.Tensor:
    """softmax([q k^T * scale + mask | sink]) without the sink's column, times v: each head's probabilities sum to
    less than 1 by the sink's share (GPT-OSS; Megatron's learnable softmax offset). Written out, as SDPA has no
    sinks: the scores are (B, nh, Tq, Tk), the size SDPA's math path makes too."""
    Tq, Tk = q.shape[2], k.shape[2]
    # cached keys are consecutive positions up to the last query's (a windowed cache keeps only the last)
    k_pos = ctx.positions if Tq == Tk else torch.arange(Tk, device=q.device) + (ctx.positions[-1] + 1 - Tk)
    q_pos = ctx.positions
    groups = q.shape[1] // k.shape[1]  # query head i reads key/value group i // groups, as HF's repeat_kv
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(2, 3) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = scores.masked_fill(~attention_mask(q_pos, k_pos, ctx.window), float("-inf"))
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(scores.shape[0], -1, Tq, 1)
    logits = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v


class Attention(nn.Module):
    """Multi-head attention with grouped key/value heads (GQA), rotary or no positions, the context's window,
    optional per-head norms of queries and keys (Qwen3's q_norm / k_norm), optional attention sinks (GPT-OSS)."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.head_dim = c.head_dim
        self.q = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.qkv_bias)
        self.k = nn.Linear(c.hidden_size, c.num_query_groups * c.head_dim, bias=c.qkv_bias)
        self.v = nn.Linear(c.hidden_size, c.num_query_groups * c.head_dim, bias=c.qkv_bias)
        self.o = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.proj_bias)
        if c.qk_norm:  # one norm over head_dim shared by all query heads, one by all key heads
            self.q_norm = make_norm(c, c.head_dim)
            self.k_norm = make_norm(c, c.head_dim)
        if c.attention_sinks:  # one logit per head (the local heads under tensor parallel)
            self.sinks = nn.Parameter(torch.zeros(c.num_attention_heads))
        self.core = CoreAttention()
        self.core.scale, self.core.softcap = c.attention_scale, c.attn_logit_softcap

    def forward(self, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        B, T, _ = x.shape
        # Head counts come from the weights (-1), so a tensor-parallel shard works with its local heads.
        q = self.q(x).view(B, T, -1, self.head_dim)  # (B, T, nh, hd)
        k = self.k(x).view(B, T, -1, self.head_dim)  # (B, T, ng, hd)
        if hasattr(self, "q_norm"):  # before rotary, as Qwen3 and Megatron's qk_layernorm do
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, nh, T, hd), (B, ng, T, hd)
        v = self.v(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, ng, T, hd)
        if ctx.rot is not None:
            q, k = rope.apply(q, *ctx.rot), rope.apply(k, *ctx.rot)
        if ctx.cache is not None:  # generation: attend to the cached positions too
            k, v = ctx.cache.append(k, v, dim=2)  # (B, ng, cached + T, hd)
        if hasattr(self, "sinks"):
            sinks = self.sinks.to_local() if isinstance(self.sinks, DTensor) else self.sinks
            y = sink_attention(q, k, v, sinks, ctx, self.core.scale)
        else:
            y = self.core(q, k, v, ctx)  # (B, nh, T, hd)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


def gated_unit(c: ModelConfig):
    """The gated unit of a gated MLP, (gate, up) -> (f,): act(g) * (u + glu_linear_offset) with act SiLU (SwiGLU),
    the tanh GELU (Gemma's GeGLU) or GPT-OSS's quick GELU g * sigmoid(1.702 g); with `activation_clamp` set,
    g = min(gate, clamp) and u = clamp(up, -clamp, clamp), else g = gate and u = up."""
    act = {"swiglu": F.silu, "geglu_tanh": lambda g: F.gelu(g, approximate="tanh"),
           "quick_geglu": lambda g: g * torch.sigmoid(1.702 * g)}[c.activation]
    limit, offset = c.activation_clamp, c.glu_linear_offset
    if limit is None and offset == 0.0:
        return lambda gate, up: act(gate) * up

    def unit(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return act(gate) * (up + offset)

    return unit


class MLP(nn.Module):
    """Gated: down(unit(gate(x), up(x))) (see `gated_unit`); otherwise down(act(up(x))) with GELU (tanh
    approximation for GPT-2)."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.activation = c.activation
        self.unit = gated_unit(c) if c.gated else None
        if c.gated:
            self.gate = nn.Linear(c.hidden_size, c.ffn_hidden_size, bias=c.mlp_bias)
        self.up = nn.Linear(c.hidden_size, c.ffn_hidden_size, bias=c.mlp_bias)
        self.down = nn.Linear(c.ffn_hidden_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.unit is not None:
            return self.down(self.unit(self.gate(x), self.up(x)))
        approximate = "tanh" if self.activation == "gelu_tanh" else "none"
        return self.down(F.gelu(self.up(x), approximate=approximate))


class Block(nn.Module):
    """One pre-norm transformer layer (number `layer`: an MoE model may keep dense MLPs in some layers, a windowed
    model attend to every earlier key in some), with multi-head or multi-latent attention."""

    def __init__(self, c: ModelConfig, layer: int = 0):
        super().__init__()
        self.attn_norm = make_norm(c)
        self.attn = MLAttention(c, RMSNorm, CoreAttention()) if c.is_mla else Attention(c)
        self.full_attention = layer in c.full_attention_layers  # exempt from the sliding window
        self.local = c.layer_window(layer) is not None  # windowed: rotates by local_rope_theta when set
        if c.sandwich_norms:
            self.post_attn_norm = make_norm(c)
        self.mlp_norm = make_norm(c)
        if c.sandwich_norms:
            self.post_mlp_norm = make_norm(c)
        if c.is_moe_layer(layer):
            self.moe = MoE(c, gated_unit(c))
        else:
            self.mlp = MLP(c)

    def forward(self, h: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        if self.full_attention:
            ctx = ctx._replace(window=None)
        elif self.local and ctx.local_rot is not None:
            ctx = ctx._replace(rot=ctx.local_rot)
        a = self.attn(self.attn_norm(h), ctx)
        h = h + (self.post_attn_norm(a) if hasattr(self, "post_attn_norm") else a)
        ffn = self.moe if hasattr(self, "moe") else self.mlp
        m = ffn(self.mlp_norm(h))
        return h + (self.post_mlp_norm(m) if hasattr(self, "post_mlp_norm") else m)


class MTPModule(nn.Module):
    """A multi-token-prediction module's own weights (its transformer layer is a Block of the model):
    h = layer(eh_proj([enorm(embedding of the next token) | hnorm(previous hidden state)])), then final_norm."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.enorm, self.hnorm, self.final_norm = make_norm(c), make_norm(c), make_norm(c)
        self.eh_proj = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)


@dataclass(frozen=True)
class SequenceShard:
    """Which positions this rank's tokens have, for context parallel (CP) and sequence parallel (SP).

    CP cuts each sequence into 2*cp equal chunks and gives rank r chunks r and 2cp-1-r, so every rank gets as
    much causal-attention work as the others:  cp=2, T=8:  rank 0: positions 0 1 6 7,  rank 1: 2 3 4 5.
    SP further splits the hidden states between layers over the `sp` tensor-parallel ranks, so a pipeline stage
    that receives hidden states has sp times fewer rows than tokens.
    """

    cp: int = 1
    cp_rank: int = 0
    sp: int = 1

    def positions(self, length: int, device: torch.device | None = None) -> torch.Tensor:
        """Positions of this rank's `length` tokens (its share of a cp*length sequence)."""
        if self.cp == 1:
            return torch.arange(length, device=device)
        half = length // 2
        first, second = self.cp_rank * half, (2 * self.cp - 1 - self.cp_rank) * half
        return torch.cat([torch.arange(first, first + half, device=device),
                          torch.arange(second, second + half, device=device)])


class Transformer(nn.Module):
    def __init__(self, c: ModelConfig, *, layers: Iterable[int] | None = None, first: bool = True,
                 last: bool = True):
        super().__init__()
        if c.is_encoder_decoder:
            raise TrainError("mtrain builds decoder-only models; this is an encoder-decoder (Megatron T5), which "
                             "mconvert converts (core, legacy, blenderbot_hf) but mtrain cannot run or train")
        self.config = c
        self.embeds_tokens = first
        # The head of a tied model reads embed.weight, as do the MTP modules: a last stage keeps its own copy.
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size) \
            if first or (last and (c.tie_embeddings or c.mtp_layers)) else None
        self.pos_embed = nn.Embedding(c.max_position_embeddings, c.hidden_size) \
            if first and c.position_embedding == "learned" else None
        layers = list(range(c.num_layers) if layers is None else layers)
        # The MTP modules go with the head; their transformer layers are layers num_layers + i (the IR's names).
        modules = range(c.mtp_layers if last else 0)
        self.layers = nn.ModuleDict({str(i): Block(c, i) for i in [*layers, *(c.num_layers + m for m in modules)]})
        self.mtp = nn.ModuleDict({str(m): MTPModule(c) for m in modules}) if c.mtp_layers and last else None
        self.mtp_loss_scale = 0.0  # set by the trainer (mtp.set_loss_scale)
        self.last_mtp_losses: list[torch.Tensor] = []  # each MTP module's loss at the last training forward
        self.final_norm = make_norm(c) if last else None
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False) if last and not c.tie_embeddings else None
        self.sequence = SequenceShard()
        self.rotary_dim = c.rotary_dim  # MLA's rotary part, or the first rotary_percent of a head
        self.register_buffer("inv_freq", torch.empty(self.rotary_dim // 2), persistent=False)
        if c.local_rope_theta is not None:  # the windowed layers' frequencies (Gemma 3)
            self.register_buffer("local_inv_freq", torch.empty(self.rotary_dim // 2), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        """(Re)compute the non-persistent buffers: needed after `to_empty()` from the meta device."""
        if self.config.position_embedding == "rope" and self.inv_freq.device.type != "meta":
            c = self.config
            with torch.no_grad():
                self.inv_freq.copy_(rope.inv_freq(self.rotary_dim, c.rope_theta, c.rope_scaling))
                if c.local_rope_theta is not None:
                    self.local_inv_freq.copy_(rope.inv_freq(self.rotary_dim, c.local_rope_theta, None))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                cache: KVCache | None = None, labels: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, V). On a pipeline stage after the first, `tokens` are hidden states
        (B, T/sp, h) and the output of a stage before the last is hidden states too. With a `cache` the tokens
        continue the cached ones (generation, one process). Training gives the `labels` of the whole sequences
        (B, cp x T): the MTP modules' loss then enters backward (mtp.py)."""
        if positions is None and cache is not None:
            positions = cache.positions(tokens.shape[1], tokens.device)
        elif positions is None:
            length = tokens.shape[1] * (1 if self.embeds_tokens else self.sequence.sp)
            positions = self.sequence.positions(length, tokens.device)
        h = self.embed_tokens(tokens) if self.embeds_tokens else tokens  # (B, T, h)
        if self.pos_embed is not None:
            h = h + self.pos_embed(positions)
        ctx = self.context(positions)
        for key, layer in self.layers.items():
            if int(key) < self.config.num_layers:  # the MTP modules' layers run in mtp.py
                h = layer(h, ctx if cache is None else
                          ctx._replace(cache=cache.layer(int(key), self.config.layer_window(int(key)))))
        if cache is not None:
            cache.advance(tokens.shape[1])
        if self.final_norm is None:
            return h
        h = self.final_norm(h)
        if labels is not None and self.mtp is not None and torch.is_grad_enabled():
            h = mtp.attach_loss(self, h, labels, positions, ctx)
        return self.head(h)

    def context(self, positions: torch.Tensor) -> LayerContext:
        c = self.config
        scale = rope.attention_factor(c.rope_scaling)
        rot = rope.cos_sin(self.inv_freq, positions, scale) if c.position_embedding == "rope" else None
        local = rope.cos_sin(self.local_inv_freq, positions) if c.local_rope_theta is not None else None
        return LayerContext(rot, positions, c.sliding_window, local_rot=local)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The token embeddings, times embedding_multiplier (Gemma: sqrt(hidden)) rounded to their dtype first,
        as transformers multiplies them."""
        h = self.embed(tokens)
        if self.config.embedding_multiplier != 1.0:
            h = h * float(torch.tensor(self.config.embedding_multiplier, dtype=h.dtype))
        return h

    def mtp_logits(self, tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(logits, [logits of MTP module i]) of a whole model. Module i reads the hidden state of module i-1 (the
        model's, after its final norm, for i = 0) at positions 0..T-2-i and the embedding of the token i+1 further
        on; its logits there predict the token i+2 further on (DeepSeek-V3's multi-token prediction)."""
        T = tokens.shape[1]
        positions = torch.arange(T, device=tokens.device)
        h, ctx = self.embed_tokens(tokens), self.context(positions)
        for i in range(self.config.num_layers):
            h = self.layers[str(i)](h, ctx)
        h = self.final_norm(h)
        following = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)  # the labels, but for the unknown last one
        modules = mtp.hidden_states(self, h, following, positions, ctx) if self.mtp else ()
        return self.head(h), [self.head(s[:, :T - 1 - i]) for i, (s, _) in enumerate(modules)]

    def head(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(h) if self.lm_head is not None else F.linear(h, self.embed.weight)
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
