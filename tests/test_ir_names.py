"""Pin the IR vocabulary: the exact tensor names per family (a change here is a format change)."""

import math
import re

import pytest

from mconvert.errors import ConvertError
from mconvert.ir.config import ModelConfig
from mconvert.ir.names import expected_shapes, num_elements

BASE = dict(num_layers=1, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2, num_query_groups=1, head_dim=4,
            vocab_size=10, max_position_embeddings=32)


def names(**fields) -> list[str]:
    return list(expected_shapes(ModelConfig(**(BASE | fields))))


def test_llama_names():
    assert names(family="llama") == [
        "embed.weight",
        "layers.0.attn_norm.weight",
        "layers.0.attn.q.weight", "layers.0.attn.k.weight", "layers.0.attn.v.weight", "layers.0.attn.o.weight",
        "layers.0.mlp_norm.weight",
        "layers.0.mlp.gate.weight", "layers.0.mlp.up.weight", "layers.0.mlp.down.weight",
        "final_norm.weight",
        "lm_head.weight",
    ]


def test_llama_with_biases_and_tied_embeddings():
    got = names(family="llama", qkv_bias=True, proj_bias=True, mlp_bias=True, tie_embeddings=True)
    assert "lm_head.weight" not in got
    assert [n for n in got if n.endswith("bias")] == [
        "layers.0.attn.q.bias", "layers.0.attn.k.bias", "layers.0.attn.v.bias", "layers.0.attn.o.bias",
        "layers.0.mlp.gate.bias", "layers.0.mlp.up.bias", "layers.0.mlp.down.bias",
    ]


def test_gpt2_names():
    assert names(family="gpt2", norm="layernorm", activation="gelu_tanh", position_embedding="learned",
                 qkv_bias=True, proj_bias=True, mlp_bias=True, tie_embeddings=True, num_query_groups=2) == [
        "embed.weight", "pos_embed.weight",
        "layers.0.attn_norm.weight", "layers.0.attn_norm.bias",
        "layers.0.attn.q.weight", "layers.0.attn.q.bias", "layers.0.attn.k.weight", "layers.0.attn.k.bias",
        "layers.0.attn.v.weight", "layers.0.attn.v.bias", "layers.0.attn.o.weight", "layers.0.attn.o.bias",
        "layers.0.mlp_norm.weight", "layers.0.mlp_norm.bias",
        "layers.0.mlp.up.weight", "layers.0.mlp.up.bias", "layers.0.mlp.down.weight", "layers.0.mlp.down.bias",
        "final_norm.weight", "final_norm.bias",
    ]


def test_mixtral_names():
    got = names(family="mixtral", num_experts=2, moe_top_k=1)
    assert got == [
        "embed.weight",
        "layers.0.attn_norm.weight",
        "layers.0.attn.q.weight", "layers.0.attn.k.weight", "layers.0.attn.v.weight", "layers.0.attn.o.weight",
        "layers.0.mlp_norm.weight",
        "layers.0.moe.router.weight",
        "layers.0.moe.experts.0.gate.weight", "layers.0.moe.experts.0.up.weight",
        "layers.0.moe.experts.0.down.weight",
        "layers.0.moe.experts.1.gate.weight", "layers.0.moe.experts.1.up.weight",
        "layers.0.moe.experts.1.down.weight",
        "final_norm.weight",
        "lm_head.weight",
    ]


def test_shapes_follow_the_config():
    shapes = expected_shapes(ModelConfig(family="llama", **BASE))
    assert shapes["layers.0.attn.q.weight"] == (8, 8)
    assert shapes["layers.0.attn.k.weight"] == (4, 8)
    assert shapes["layers.0.attn.o.weight"] == (8, 8)
    assert shapes["layers.0.mlp.down.weight"] == (8, 16)


def test_config_json_round_trip():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    config = ModelConfig(family="llama", rope_scaling=scaling, **BASE)
    assert ModelConfig.from_json(config.to_json()) == config


def test_deepseek_names():
    """MLA with a query LoRA, a dense layer then an MoE layer with a score bias and shared experts, one MTP module
    whose transformer layer is layer num_layers + 0."""
    got = names(family="deepseek_v3", num_layers=2, head_dim=6, num_query_groups=2, num_experts=2, moe_top_k=1,
                dense_layers=(0,), q_lora_rank=3, kv_lora_rank=4, qk_rope_head_dim=2, v_head_dim=5,
                moe_shared_expert_ffn_hidden_size=8, moe_router_score="sigmoid", moe_router_expert_bias=True,
                mtp_layers=1)
    mla = ["attn_norm.weight", "attn.q_down.weight", "attn.q_norm.weight", "attn.q_up.weight", "attn.kv_down.weight",
           "attn.kv_norm.weight", "attn.kv_up.weight", "attn.o.weight", "mlp_norm.weight"]
    moe = ["moe.router.weight", "moe.router.expert_bias",
           *(f"moe.experts.{e}.{p}.weight" for e in range(2) for p in ("gate", "up", "down")),
           "moe.shared.gate.weight", "moe.shared.up.weight", "moe.shared.down.weight"]
    assert got == [
        "embed.weight",
        *(f"layers.0.{n}" for n in mla), "layers.0.mlp.gate.weight", "layers.0.mlp.up.weight",
        "layers.0.mlp.down.weight",
        *(f"layers.1.{n}" for n in mla + moe),
        "final_norm.weight", "lm_head.weight",
        "mtp.0.enorm.weight", "mtp.0.hnorm.weight", "mtp.0.eh_proj.weight", "mtp.0.final_norm.weight",
        *(f"layers.2.{n}" for n in mla + moe),
    ]
    without_lora = names(family="deepseek_v3", head_dim=6, num_query_groups=2, kv_lora_rank=4, qk_rope_head_dim=2,
                         v_head_dim=5)
    assert [n for n in without_lora if ".attn." in n] == ["layers.0.attn.q.weight", "layers.0.attn.kv_down.weight",
                                                          "layers.0.attn.kv_norm.weight", "layers.0.attn.kv_up.weight",
                                                          "layers.0.attn.o.weight"]
    shapes = expected_shapes(ModelConfig(**(BASE | dict(family="deepseek_v3", head_dim=6, num_query_groups=2,
                                                        kv_lora_rank=4, qk_rope_head_dim=2, v_head_dim=5))))
    assert (shapes["layers.0.attn.q.weight"], shapes["layers.0.attn.kv_down.weight"],
            shapes["layers.0.attn.kv_up.weight"], shapes["layers.0.attn.o.weight"]) == \
        ((12, 8), (6, 8), (18, 4), (8, 10))


DEEPSEEK = dict(family="deepseek_v3", num_layers=3, head_dim=6, num_query_groups=2, num_experts=4, moe_top_k=1,
                dense_layers=(0,), q_lora_rank=3, kv_lora_rank=4, qk_rope_head_dim=2, v_head_dim=5,
                moe_shared_expert_ffn_hidden_size=8, moe_router_score="sigmoid", moe_router_expert_bias=True,
                mtp_layers=2)
COUNTED = {"llama": dict(family="llama", num_layers=3),
           "gpt2": dict(family="gpt2", norm="layernorm", activation="gelu_tanh", position_embedding="learned",
                        qkv_bias=True, proj_bias=True, mlp_bias=True, tie_embeddings=True, num_query_groups=2),
           "qwen3_moe": dict(family="qwen3_moe", num_layers=4, qk_norm=True, num_experts=3, moe_top_k=2,
                             moe_ffn_hidden_size=6, dense_layers=(1, 3)),
           "deepseek": DEEPSEEK, "deepseek_one_mtp_dense": DEEPSEEK | dict(mtp_layers=1, num_experts=None,
                                                                           moe_top_k=None, dense_layers=(),
                                                                           moe_shared_expert_ffn_hidden_size=None,
                                                                           moe_router_score="softmax",
                                                                           moe_router_expert_bias=False)}
BERT = dict(family="megatron_bert", norm="layernorm", activation="gelu", position_embedding="learned", qkv_bias=True,
            proj_bias=True, mlp_bias=True, tie_embeddings=True, num_query_groups=2, lm_head_bias=True,
            num_tokentypes=2, pooler=True, binary_head=True)
COUNTED |= {"megatron_bert": BERT, "bert_post_ln_untied": BERT | dict(family="bert", post_norm=True,
                                                                       tie_embeddings=False, binary_head=False)}


def test_bert_names():
    """Megatron BERT (pre-LN): token types beside the embeddings; pooler, binary head, MLM transform and LM-head
    bias after the final norm; HF's post-LN BERT: a norm of the embeddings and none after the last layer."""
    got = names(**BERT)
    assert got[:3] == ["embed.weight", "pos_embed.weight", "token_type_embed.weight"]
    assert got[got.index("final_norm.weight"):] == [
        "final_norm.weight", "final_norm.bias", "pooler.weight", "pooler.bias", "nsp_head.weight", "nsp_head.bias",
        "mlm_head.dense.weight", "mlm_head.dense.bias", "mlm_head.norm.weight", "mlm_head.norm.bias", "lm_head.bias"]
    post = names(**(BERT | dict(family="bert", post_norm=True, num_tokentypes=0, pooler=False, binary_head=False)))
    assert post[:4] == ["embed.weight", "pos_embed.weight", "embed_norm.weight", "embed_norm.bias"]
    assert "final_norm.weight" not in post and post[-5:] == [
        "mlm_head.dense.weight", "mlm_head.dense.bias", "mlm_head.norm.weight", "mlm_head.norm.bias", "lm_head.bias"]


@pytest.mark.parametrize("fields, says", [
    (dict(family="llama", num_tokentypes=2), "num_tokentypes describe BERT encoders"),
    (dict(family="gpt2", norm="layernorm", position_embedding="learned", activation="gelu", pooler=True),
     "pooler describe BERT encoders"),
    (BERT | dict(post_norm=True), "post_norm=True"),
    (BERT | dict(family="bert"), "post_norm=False"),
    (BERT | dict(pooler=False), "binary_head=True"),
    (BERT | dict(lm_head_bias=False), "lm_head_bias=False"),
    (BERT | dict(activation="swiglu"), "activation='swiglu'"),
    (BERT | dict(num_tokentypes=-1), "num_tokentypes must be a non-negative integer"),
])
def test_bert_fields_are_checked(fields, says):
    with pytest.raises(ConvertError, match=re.escape(says)):
        ModelConfig(**(BASE | fields))


@pytest.mark.parametrize("name", list(COUNTED))
def test_num_elements_counts_what_expected_shapes_lists(name):
    """num_elements (arithmetic, nothing per layer: what mconvert.ir.sizes compares with the files) is the sum
    over expected_shapes, for every kind of layer: dense, MoE with shared experts and biases, MTP modules."""
    c = ModelConfig(**(BASE | COUNTED[name]))
    assert num_elements(c) == sum(math.prod(s) for s in expected_shapes(c).values())
