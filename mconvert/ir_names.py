"""The IR's tensor vocabulary: which names exist for a config, and their shapes.

This is the one place that says which tensors a model has. Loaders are checked against it (a checkpoint whose
tensors contradict its config is refused), savers iterate it, tests pin it per family.

    embed.weight                          [V, h]
    pos_embed.weight                      [S, h]          learned absolute positions only
    layers.{L}.attn_norm.{weight,bias}    [h]             bias for LayerNorm only
    layers.{L}.attn.{q,k,v}.{weight,bias} [nh*hd, h] / [ng*hd, h]
    layers.{L}.attn.o.{weight,bias}       [h, nh*hd] / [h]
    layers.{L}.attn.{q,k}_norm.{weight,bias} [hd]         per-head norm of q and k (qk_norm; bias for LayerNorm)
    layers.{L}.mlp_norm.{weight,bias}     [h]
    layers.{L}.mlp.{gate,up}.{weight,bias}  [f, h]        gate only for gated activations
    layers.{L}.mlp.down.{weight,bias}     [h, f]
    layers.{L}.moe.router.weight          [E, h]
    layers.{L}.moe.experts.{E}.{gate,up,down}.weight  [f_e, h] / [h, f_e]   MoE layers (not in dense_layers)
    final_norm.{weight,bias}              [h]
    lm_head.weight                        [V, h]          absent when tied to embed.weight
"""

from __future__ import annotations

from mconvert.ir import ModelConfig

Shape = tuple[int, ...]


def norm_shapes(prefix: str, c: ModelConfig) -> dict[str, Shape]:
    shapes = {f"{prefix}.weight": (c.hidden_size,)}
    if c.norm == "layernorm":
        shapes[f"{prefix}.bias"] = (c.hidden_size,)
    return shapes


def attention_shapes(prefix: str, c: ModelConfig) -> dict[str, Shape]:
    h, q_rows, kv_rows = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_query_groups * c.head_dim
    shapes: dict[str, Shape] = {}
    for name, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
        shapes[f"{prefix}.{name}.weight"] = (rows, h)
        if c.qkv_bias:
            shapes[f"{prefix}.{name}.bias"] = (rows,)
    shapes[f"{prefix}.o.weight"] = (h, q_rows)
    if c.proj_bias:
        shapes[f"{prefix}.o.bias"] = (h,)
    return shapes


def qk_norm_shapes(prefix: str, c: ModelConfig) -> dict[str, Shape]:
    """One norm over head_dim for all query heads and one for all key heads (Qwen3's q_norm / k_norm)."""
    if not c.qk_norm:
        return {}
    shapes: dict[str, Shape] = {}
    for name in ("q_norm", "k_norm"):
        shapes[f"{prefix}.{name}.weight"] = (c.head_dim,)
        if c.norm == "layernorm":
            shapes[f"{prefix}.{name}.bias"] = (c.head_dim,)
    return shapes


def mlp_shapes(prefix: str, c: ModelConfig, bias: bool, ffn: int | None = None) -> dict[str, Shape]:
    h, f = c.hidden_size, ffn or c.ffn_hidden_size
    shapes: dict[str, Shape] = {}
    for name in ("gate", "up") if c.gated else ("up",):
        shapes[f"{prefix}.{name}.weight"] = (f, h)
        if bias:
            shapes[f"{prefix}.{name}.bias"] = (f,)
    shapes[f"{prefix}.down.weight"] = (h, f)
    if bias:
        shapes[f"{prefix}.down.bias"] = (h,)
    return shapes


def layer_shapes(layer: int, c: ModelConfig) -> dict[str, Shape]:
    """The IR tensors of one transformer layer, in a stable order."""
    p = f"layers.{layer}"
    shapes = norm_shapes(f"{p}.attn_norm", c)
    shapes |= attention_shapes(f"{p}.attn", c)
    shapes |= qk_norm_shapes(f"{p}.attn", c)
    shapes |= norm_shapes(f"{p}.mlp_norm", c)
    if c.is_moe_layer(layer):
        shapes[f"{p}.moe.router.weight"] = (c.num_experts, c.hidden_size)
        for e in range(c.num_experts):
            shapes |= mlp_shapes(f"{p}.moe.experts.{e}", c, bias=False, ffn=c.expert_ffn_hidden_size)
    else:
        shapes |= mlp_shapes(f"{p}.mlp", c, bias=c.mlp_bias)
    return shapes


def embedding_shapes(c: ModelConfig) -> dict[str, Shape]:
    shapes: dict[str, Shape] = {"embed.weight": (c.vocab_size, c.hidden_size)}
    if c.position_embedding == "learned":
        shapes["pos_embed.weight"] = (c.max_position_embeddings, c.hidden_size)
    return shapes


def head_shapes(c: ModelConfig) -> dict[str, Shape]:
    shapes = norm_shapes("final_norm", c)
    if not c.tie_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def expected_shapes(c: ModelConfig) -> dict[str, Shape]:
    """Every IR tensor of the model, in canonical order (embeddings, layers 0..L-1, head)."""
    shapes = embedding_shapes(c)
    for layer in range(c.num_layers):
        shapes |= layer_shapes(layer, c)
    return shapes | head_shapes(c)
