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
    layers.{L}.post_{attn,mlp}_norm.{weight,bias} [h]     sandwich_norms: norms of the attention / MLP outputs
    layers.{L}.mlp.{gate,up}.{weight,bias}  [f, h]        gate only for gated activations
    layers.{L}.mlp.down.{weight,bias}     [h, f]
    layers.{L}.attn.sinks                 [nh]            attention sinks: one logit per head (GPT-OSS)
    layers.{L}.moe.router.weight          [E, h]
    layers.{L}.moe.router.bias            [E]             moe_router_bias (GPT-OSS)
    layers.{L}.moe.experts.{E}.{gate,up,down}.weight  [f_e, h] / [h, f_e]   MoE layers (not in dense_layers)
    layers.{L}.moe.experts.{E}.{gate,up,down}.bias    [f_e] / [h]      with mlp_bias (GPT-OSS)
    final_norm.{weight,bias}              [h]
    lm_head.weight                        [V, h]          absent when tied to embed.weight

DeepSeek-V3 (see mconvert/ir/features.py; nh heads, dn + dr = head_dim, dv = v_head_dim, r_q/r_kv the LoRA ranks):

    layers.{L}.attn.q.weight              [nh*(dn+dr), h]  MLA without a query LoRA, else:
    layers.{L}.attn.q_down.weight         [r_q, h]
    layers.{L}.attn.q_norm.weight         [r_q]           the query latent's norm (MLA excludes qk_norm)
    layers.{L}.attn.q_up.weight           [nh*(dn+dr), r_q]
    layers.{L}.attn.kv_down.weight        [r_kv+dr, h]
    layers.{L}.attn.kv_norm.weight        [r_kv]
    layers.{L}.attn.kv_up.weight          [nh*(dn+dv), r_kv]
    layers.{L}.attn.o.weight              [h, nh*dv]
    layers.{L}.moe.router.expert_bias     [E]             float32
    layers.{L}.moe.shared.{gate,up,down}.weight  [f_s, h] / [h, f_s]
    mtp.{M}.{enorm,hnorm,final_norm}.weight  [h]          MTP module M; its transformer layer is layers.{num_layers+M}
    mtp.{M}.eh_proj.weight                [h, 2h]

BERT (families megatron_bert and bert, see mconvert/ir/features.py; T = num_tokentypes). The layers are named as
above (attention and MLP biased, LayerNorm); with post_norm (HF "bert") attn_norm / mlp_norm are the norms after
each residual add, embed_norm normalizes the summed embeddings and there is no final_norm:

    token_type_embed.weight               [T, h]          num_tokentypes > 0: added to the word and position ones
    embed_norm.{weight,bias}              [h]             post_norm only
    pooler.{weight,bias}                  [h, h] / [h]    pooler: tanh(pooler(h[:, 0]))
    nsp_head.{weight,bias}                [2, h] / [2]    binary_head: next-sentence logits from the pooled output
    mlm_head.dense.{weight,bias}          [h, h] / [h]    the MLM head's transform: mlm_head.norm(act(dense(h)))
    mlm_head.norm.{weight,bias}           [h]
    lm_head.bias                          [V]             lm_head_bias: logits = lm_head(transformed) + bias
    lm_head.weight                        [V, h]          absent when tied to embed.weight (as BERTs usually are)
"""

from __future__ import annotations

from mconvert.ir.config import ModelConfig

Shape = tuple[int, ...]


def norm_shapes(prefix: str, c: ModelConfig) -> dict[str, Shape]:
    shapes = {f"{prefix}.weight": (c.hidden_size,)}
    if c.norm == "layernorm":
        shapes[f"{prefix}.bias"] = (c.hidden_size,)
    return shapes


def attention_shapes(prefix: str, c: ModelConfig) -> dict[str, Shape]:
    if c.is_mla:
        return mla_shapes(prefix, c)
    h, q_rows, kv_rows = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_query_groups * c.head_dim
    shapes: dict[str, Shape] = {}
    for name, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
        shapes[f"{prefix}.{name}.weight"] = (rows, h)
        if c.qkv_bias:
            shapes[f"{prefix}.{name}.bias"] = (rows,)
    shapes[f"{prefix}.o.weight"] = (h, q_rows)
    if c.proj_bias:
        shapes[f"{prefix}.o.bias"] = (h,)
    if c.attention_sinks:
        shapes[f"{prefix}.sinks"] = (c.num_attention_heads,)
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


def mla_shapes(prefix: str, c: ModelConfig) -> dict[str, Shape]:
    h, nh, q_rows = c.hidden_size, c.num_attention_heads, c.num_attention_heads * c.head_dim
    shapes: dict[str, Shape] = {}
    if c.q_lora_rank is None:
        shapes[f"{prefix}.q.weight"] = (q_rows, h)
    else:
        shapes |= {f"{prefix}.q_down.weight": (c.q_lora_rank, h), f"{prefix}.q_norm.weight": (c.q_lora_rank,),
                   f"{prefix}.q_up.weight": (q_rows, c.q_lora_rank)}
    shapes |= {f"{prefix}.kv_down.weight": (c.kv_lora_rank + c.qk_rope_head_dim, h),
               f"{prefix}.kv_norm.weight": (c.kv_lora_rank,),
               f"{prefix}.kv_up.weight": (nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
               f"{prefix}.o.weight": (h, nh * c.v_head_dim)}
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
    if c.sandwich_norms:
        shapes |= norm_shapes(f"{p}.post_attn_norm", c)
    shapes |= norm_shapes(f"{p}.mlp_norm", c)
    if c.sandwich_norms:
        shapes |= norm_shapes(f"{p}.post_mlp_norm", c)
    if c.is_moe_layer(layer):
        shapes[f"{p}.moe.router.weight"] = (c.num_experts, c.hidden_size)
        if c.moe_router_bias:
            shapes[f"{p}.moe.router.bias"] = (c.num_experts,)
        if c.moe_router_expert_bias:
            shapes[f"{p}.moe.router.expert_bias"] = (c.num_experts,)
        for e in range(c.num_experts):
            shapes |= mlp_shapes(f"{p}.moe.experts.{e}", c, bias=c.mlp_bias, ffn=c.expert_ffn_hidden_size)
        if c.moe_shared_expert_ffn_hidden_size:
            shapes |= mlp_shapes(f"{p}.moe.shared", c, bias=False, ffn=c.moe_shared_expert_ffn_hidden_size)
    else:
        shapes |= mlp_shapes(f"{p}.mlp", c, bias=c.mlp_bias)
    return shapes


def embedding_shapes(c: ModelConfig) -> dict[str, Shape]:
    shapes: dict[str, Shape] = {"embed.weight": (c.vocab_size, c.hidden_size)}
    if c.position_embedding == "learned":
        shapes["pos_embed.weight"] = (c.max_position_embeddings, c.hidden_size)
    if c.num_tokentypes:
        shapes["token_type_embed.weight"] = (c.num_tokentypes, c.hidden_size)
    if c.post_norm:
        shapes |= norm_shapes("embed_norm", c)
    return shapes


def head_shapes(c: ModelConfig) -> dict[str, Shape]:
    """The tensors after the last layer: the final norm (not with post_norm), BERT's pooler, binary head and MLM
    transform, the LM head's weight (untied) and bias."""
    h = c.hidden_size
    shapes = {} if c.post_norm else norm_shapes("final_norm", c)
    if c.pooler:
        shapes |= {"pooler.weight": (h, h), "pooler.bias": (h,)}
    if c.binary_head:
        shapes |= {"nsp_head.weight": (2, h), "nsp_head.bias": (2,)}
    if c.is_bert:
        shapes |= {"mlm_head.dense.weight": (h, h), "mlm_head.dense.bias": (h,)} | norm_shapes("mlm_head.norm", c)
    if not c.tie_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    if c.lm_head_bias:
        shapes["lm_head.bias"] = (c.vocab_size,)
    return shapes


def mtp_shapes(module: int, c: ModelConfig) -> dict[str, Shape]:
    """The tensors of multi-token-prediction module `module`: its own, then its transformer layer's."""
    h, p = c.hidden_size, f"mtp.{module}"
    shapes = {f"{p}.enorm.weight": (h,), f"{p}.hnorm.weight": (h,), f"{p}.eh_proj.weight": (h, 2 * h),
              f"{p}.final_norm.weight": (h,)}
    return shapes | layer_shapes(c.num_layers + module, c)


def expected_shapes(c: ModelConfig) -> dict[str, Shape]:
    """Every IR tensor of the model, in canonical order (embeddings, layers 0..L-1, head, MTP modules)."""
    shapes = embedding_shapes(c)
    for layer in range(c.num_layers):
        shapes |= layer_shapes(layer, c)
    shapes |= head_shapes(c)
    for module in range(c.mtp_layers):
        shapes |= mtp_shapes(module, c)
    return shapes


def _elements(shapes: dict[str, Shape]) -> int:
    total = 0
    for shape in shapes.values():
        n = 1
        for s in shape:
            n *= s
        total += n
    return total


def num_elements(c: ModelConfig) -> int:
    """The number of values in `expected_shapes(c)`, by arithmetic: nothing is built per layer or per expert, so a
    config claiming a million layers or experts costs nothing to measure (see mconvert.ir.sizes)."""
    layers = c.num_layers + c.mtp_layers  # each MTP module holds one transformer layer (an MoE one in an MoE model)
    moe_layers = c.num_moe_layers + (c.mtp_layers if c.is_moe else 0)
    p = "layers.0"
    common = (_elements(norm_shapes(f"{p}.attn_norm", c)) + _elements(attention_shapes(f"{p}.attn", c))
              + _elements(qk_norm_shapes(f"{p}.attn", c)) + _elements(norm_shapes(f"{p}.mlp_norm", c)))
    total = _elements(embedding_shapes(c)) + _elements(head_shapes(c)) + layers * common
    total += (layers - moe_layers) * _elements(mlp_shapes(f"{p}.mlp", c, bias=c.mlp_bias))
    if moe_layers:
        expert = _elements(mlp_shapes(f"{p}.moe.experts.0", c, bias=False, ffn=c.expert_ffn_hidden_size))
        per_layer = c.num_experts * (c.hidden_size + (1 if c.moe_router_expert_bias else 0) + expert)
        if c.moe_shared_expert_ffn_hidden_size:
            per_layer += _elements(mlp_shapes(f"{p}.moe.shared", c, bias=False,
                                              ffn=c.moe_shared_expert_ffn_hidden_size))
        total += moe_layers * per_layer
    h = c.hidden_size
    return total + c.mtp_layers * (3 * h + 2 * h * h)  # enorm, hnorm, final_norm, eh_proj
