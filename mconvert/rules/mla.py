"""The rotary rows of multi-latent attention checkpoints: the joins both DeepSeek's Hugging Face layout and
Megatron's MLA use (see mconvert/ir/features.py).

The IR keeps rotary rows half-split; those checkpoints keep them interleaved, in the last qk_rope_head_dim rows of
every query head (`q_proj` / `q_b_proj`, Megatron `linear_q_proj` / `linear_q_up_proj`) and of the single shared
key (`kv_a_proj_with_mqa`, Megatron `linear_kv_down_proj`):

    query head h:  [q_nope rows (dn) | q_rope rows (dr), pairs interleaved]      for h in 0..nh-1
    kv down:       [latent rows (kv_lora_rank) | k_rope rows (dr), pairs interleaved]
"""

from __future__ import annotations

from mconvert.rules import transforms
from mconvert.rules.table import Join

Q_ROPE = Join(
    "mla_q_rope",
    lambda ts, ctx: transforms.rope_rows_to_interleaved(ts[0], ctx.config.num_attention_heads,
                                                        ctx.config.qk_rope_head_dim),
    lambda t, ctx: [transforms.rope_rows_to_half(t, ctx.config.num_attention_heads, ctx.config.qk_rope_head_dim)],
)
KV_ROPE = Join(
    "mla_kv_rope",
    lambda ts, ctx: transforms.rope_rows_to_interleaved(ts[0], 1, ctx.config.qk_rope_head_dim),
    lambda t, ctx: [transforms.rope_rows_to_half(t, 1, ctx.config.qk_rope_head_dim)],
)
