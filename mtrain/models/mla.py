"""Multi-latent attention (DeepSeek-V2/V3), the IR's MLA (see mconvert/ir/features.py); architecture only.

    x (B, T, h)
    q  = q_up(q_norm(q_down(x)))  or q(x)        (B, nh, T, dn + dr)   split [q_nope | q_rope]
    kv = kv_down(x)                              (B, T, r + dr)        split [c | k_rope], k_rope one for all heads
    k_nope, v = kv_up(kv_norm(c))                (B, nh, T, dn), (B, nh, T, dv)
    q = [q_nope | rope(q_rope)],  k = [k_nope | rope(k_rope) for every head]
    out = o(softmax(q k^T * scale + causal) v)   scale = head_dim^-0.5, times YaRN's mscale(f, mscale_all_dim)^2

With a key/value cache (generation) a layer keeps, for every earlier position, kv_norm(c) (B, T, r) and the
rotated k_rope (B, 1, T, dr): r + dr numbers per position instead of nh x (dn + dr + dv) for whole keys and
values. Each step re-expands k_nope and v of the cached positions with kv_up (one matrix product over them, far
cheaper than running the model over them again).

Rotary rows are half-split (the IR's order), so `rope.apply` rotates them as in any other layer. Parameter names
are the IR names. The core attention (`self.core`) is the same swappable kernel as in multi-head attention, told
the softmax scale.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mconvert.ir.config import ModelConfig
from mconvert.ir.features import yarn_mscale, yarn_params
from mtrain.models import rope


class MLAttention(nn.Module):
    def __init__(self, c: ModelConfig, norm: type[nn.Module], core: nn.Module):
        super().__init__()
        h, nh = c.hidden_size, c.num_attention_heads
        self.head_dim, self.rope_dim, self.v_dim = c.head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.rank = c.kv_lora_rank
        if c.q_lora_rank is None:
            self.q = nn.Linear(h, nh * c.head_dim, bias=False)
        else:
            self.q_down = nn.Linear(h, c.q_lora_rank, bias=False)
            self.q_norm = norm(c.q_lora_rank, c.norm_eps)
            self.q_up = nn.Linear(c.q_lora_rank, nh * c.head_dim, bias=False)
        self.kv_down = nn.Linear(h, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_norm = norm(c.kv_lora_rank, c.norm_eps)
        self.kv_up = nn.Linear(c.kv_lora_rank, nh * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o = nn.Linear(nh * c.v_head_dim, h, bias=False)
        self.core = core
        # The rope key every head reads: identity here; under tensor parallel each rank's heads read it, so its
        # gradient is summed over the ranks (tensor_parallel.copy_to_region).
        self.shared_key: Callable[[torch.Tensor], torch.Tensor] = _identity
        yarn = yarn_params(c.rope_scaling)
        mscale = yarn_mscale(yarn["factor"], yarn["mscale_all_dim"]) if yarn and yarn["mscale_all_dim"] else 1.0
        self.core.scale = c.head_dim ** -0.5 * mscale * mscale

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        B, T, _ = x.shape
        nope = self.head_dim - self.rope_dim
        q = self.q(x) if hasattr(self, "q") else self.q_up(self.q_norm(self.q_down(x)))
        # Head counts come from the weights (-1), so a tensor-parallel shard works with its local heads.
        q_nope, q_rope = q.view(B, T, -1, self.head_dim).transpose(1, 2).split([nope, self.rope_dim], -1)
        latent, k_rope = self.kv_down(x).split([self.rank, self.rope_dim], -1)  # (B, T, r), (B, T, dr)
        latent, k_rope = self.kv_norm(latent), self.shared_key(k_rope.view(B, 1, T, self.rope_dim))
        if ctx.rot is not None:
            q_rope, k_rope = rope.apply(q_rope, *ctx.rot), rope.apply(k_rope, *ctx.rot)
        if ctx.cache is not None:  # generation: the normed latent and the rotated shared key of every position
            latent, k_rope = ctx.cache.append(latent, k_rope, dim=(1, 2))  # (B, Tk, r), (B, 1, Tk, dr)
        Tk = latent.shape[1]
        kv = self.kv_up(latent).view(B, Tk, -1, nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([nope, self.v_dim], -1)  # (B, nh, Tk, dn), (B, nh, Tk, dv)
        q = torch.cat([q_nope, q_rope], dim=-1)  # (B, nh, T, dn + dr)
        k = torch.cat([k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        y = self.core(q, k, v, ctx)  # (B, nh, T, dv)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t
