"""A tiny DeepSeek-V3 model config for training tests: MLA with a query LoRA and YaRN, one dense layer then MoE
layers (8 experts in 4 groups, top-2 among 2 groups, sigmoid scores with the expert bias, routed scaling, shared
experts); `with_mtp` adds multi-token-prediction modules."""

from __future__ import annotations

from tests.mtrain.corpus import VOCAB

YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.7}
TINY_DEEPSEEK = dict(
    family="deepseek_v3", num_layers=3, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
    num_query_groups=4, head_dim=16, vocab_size=VOCAB, max_position_embeddings=64, norm_eps=1e-6,
    rope_scaling=YARN, num_experts=8, moe_top_k=2, moe_ffn_hidden_size=16, dense_layers=(0,), q_lora_rank=24,
    kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8, moe_shared_expert_ffn_hidden_size=32,
    moe_router_score="sigmoid", moe_router_expert_bias=True, moe_router_groups=4, moe_router_group_topk=2,
    moe_router_scaling_factor=2.5)


def with_mtp(model: dict, layers: int = 1) -> dict:
    return model | {"mtp_layers": layers}
