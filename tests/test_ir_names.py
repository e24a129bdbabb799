"""Pin the IR vocabulary: the exact tensor names per family (a change here is a format change)."""

from mconvert.ir import ModelConfig
from mconvert.ir_names import expected_shapes

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
    config = ModelConfig(family="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0}, **BASE)
    assert ModelConfig.from_json(config.to_json()) == config
