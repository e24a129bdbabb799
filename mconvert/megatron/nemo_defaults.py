"""The defaults of NeMo 2's model config classes, as data: what a config leaves out of `context/io.json`.

NeMo 2 records only the arguments a config class was given (NeMo's own HF import of a Llama passes the sizes and
leaves `normalization`, `activation_func`, `gated_linear_unit`, ... to LlamaConfig). The fields a class fixes are
listed here, class by class, with the class each one extends; `class_defaults` applies them from the base up:
megatron-core's TransformerConfig -> GPTConfig (-> MLATransformerConfig for DeepSeek) -> the family's class -> its
size class. Nothing of NeMo is imported.

Only the fields that decide the model's shape and computation are listed (no dropout, fusion, init or parallel
settings). Facts from NeMo 2.6.0rc0 (NVIDIA/NeMo commit 8cfedd7203462cb251a914e700e5605444277561,
nemo/collections/llm/gpt/model/{base,llama,mistral,mixtral,qwen2,qwen3,deepseek}.py) and megatron-core 0.19.2's
TransformerConfig and MLATransformerConfig (megatron/core/transformer/transformer_config.py). Other classes (Gemma,
Llama 4, ...) are not listed: their configs must state every field mconvert reads (bridge_config.STATED names
what is missing).
"""

from __future__ import annotations

import copy
from typing import Any

from mconvert.errors import ConvertError

NEMO = "nemo.collections.llm.gpt.model."
SILU = {"_target_": "torch.nn.functional.silu", "_call_": False}
GELU = {"_target_": "torch.nn.functional.gelu", "_call_": False}

# megatron-core 0.19.2 TransformerConfig; None where __post_init__ derives the value (see `with_defaults`)
TRANSFORMER_CONFIG: dict[str, Any] = dict(
    num_layers=0, hidden_size=0, num_attention_heads=0, ffn_hidden_size=None, num_query_groups=None,
    kv_channels=None, normalization="LayerNorm", layernorm_epsilon=1e-5, layernorm_zero_centered_gamma=False,
    activation_func=GELU, gated_linear_unit=False, add_bias_linear=True, add_qkv_bias=False, qk_layernorm=False,
    apply_residual_connection_post_layernorm=False, rotary_interleaved=False, window_size=None,
    softmax_scale=None, num_moe_experts=None, moe_ffn_hidden_size=None, moe_router_topk=2,
    moe_aux_loss_coeff=0.0, moe_router_pre_softmax=False, moe_router_score_function="softmax", moe_layer_freq=1,
    moe_shared_expert_intermediate_size=None, moe_router_enable_expert_bias=False, multi_latent_attention=False,
    mtp_num_layers=None)

_LLAMA = dict(normalization="RMSNorm", activation_func=SILU, gated_linear_unit=True, position_embedding_type="rope",
              add_bias_linear=False, seq_length=4096, share_embeddings_and_output_weights=False)
_LLAMA3 = dict(num_query_groups=8, normalization="RMSNorm", layernorm_epsilon=1e-5, add_bias_linear=False,
               activation_func=SILU, gated_linear_unit=True, share_embeddings_and_output_weights=False,
               position_embedding_type="rope", rotary_percent=1.0)
# Llama 3.1's rope scaling (configure_model applies it with these, Megatron's use_rope_scaling with the factor)
_LLAMA31 = dict(scale_factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, old_context_len=8192)
_LLAMA3_SIZES = {"8B": dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32),
                 "70B": dict(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                             make_vocab_size_divisible_by=128)}
_MISTRAL = dict(normalization="RMSNorm", activation_func=SILU, position_embedding_type="rope", add_bias_linear=False,
                gated_linear_unit=True, num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                ffn_hidden_size=14336, seq_length=32768, share_embeddings_and_output_weights=False,
                layernorm_epsilon=1e-5, window_size=[4096, 0])
_MIXTRAL = dict(normalization="RMSNorm", activation_func=SILU, position_embedding_type="rope", add_bias_linear=False,
                gated_linear_unit=True, num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                ffn_hidden_size=14336, seq_length=4096, share_embeddings_and_output_weights=False,
                num_moe_experts=8, moe_aux_loss_coeff=0.01, moe_router_topk=2, moe_router_pre_softmax=False,
                layernorm_epsilon=1e-5, rotary_percent=1.0, rotary_base=1000000.0)
_QWEN2 = dict(normalization="RMSNorm", activation_func=SILU, gated_linear_unit=True, add_bias_linear=False,
              add_qkv_bias=True, seq_length=4096, vocab_size=151936, share_embeddings_and_output_weights=False,
              layernorm_epsilon=1e-6, rotary_base=1000000.0, position_embedding_type="rope")


def _sizes(layers: int, hidden: int, heads: int, groups: int, ffn: int, **more: Any) -> dict[str, Any]:
    return dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
                ffn_hidden_size=ffn, **more)


MLA = "megatron.core.transformer.transformer_config.MLATransformerConfig"  # a base, never a config's own class
# class (under nemo.collections.llm.gpt.model.) -> (the class it extends, the defaults it declares)
CLASSES: dict[str, tuple[str | None, dict[str, Any]]] = {
    "base.GPTConfig": (None, dict(share_embeddings_and_output_weights=True, make_vocab_size_divisible_by=128,
                                  position_embedding_type="learned_absolute", rotary_base=10000, rotary_percent=1.0,
                                  seq_len_interpolation_factor=None, seq_length=1024, vocab_size=None)),
    "llama.LlamaConfig": ("base.GPTConfig", _LLAMA),
    "llama.Llama2Config7B": ("llama.LlamaConfig", _sizes(32, 4096, 32, 32, 11008)),
    "llama.Llama2Config13B": ("llama.LlamaConfig", _sizes(40, 5120, 40, 40, 13824)),
    "llama.Llama2Config70B": ("llama.LlamaConfig", _sizes(80, 8192, 64, 8, 28672)),
    "llama.Llama3Config": ("llama.LlamaConfig", _LLAMA3),
    "llama.Llama31Config": ("llama.Llama3Config", _LLAMA31),
    "llama.Llama3Config8B": ("llama.Llama3Config", dict(rotary_base=500_000, seq_length=8192, **_LLAMA3_SIZES["8B"])),
    "llama.Llama3Config70B": ("llama.Llama3Config", dict(rotary_base=500_000, seq_length=8192,
                                                         **_LLAMA3_SIZES["70B"])),
    "llama.Llama31Config8B": ("llama.Llama31Config", dict(rotary_base=500_000, seq_length=131072,
                                                          **_LLAMA3_SIZES["8B"])),
    "llama.Llama31Config70B": ("llama.Llama31Config", dict(rotary_base=500_000, seq_length=131072,
                                                           **_LLAMA3_SIZES["70B"])),
    "llama.Llama31Config405B": ("llama.Llama31Config", dict(
        rotary_base=500_000, seq_length=131072, num_layers=126, hidden_size=16384, ffn_hidden_size=53248,
        num_attention_heads=128, make_vocab_size_divisible_by=128)),
    "llama.Llama32Config1B": ("llama.Llama31Config", dict(
        scale_factor=32.0, share_embeddings_and_output_weights=True, rotary_base=500_000, seq_length=131072,
        make_vocab_size_divisible_by=128, **_sizes(16, 2048, 32, 8, 8192))),
    "llama.Llama32Config3B": ("llama.Llama31Config", dict(
        scale_factor=32, share_embeddings_and_output_weights=True, rotary_base=500_000, seq_length=131072,
        make_vocab_size_divisible_by=128, **_sizes(28, 3072, 24, 8, 8192))),
    "mistral.MistralConfig7B": ("base.GPTConfig", _MISTRAL),
    "mistral.MistralNeMoConfig12B": ("mistral.MistralConfig7B", dict(
        num_layers=40, hidden_size=5120, kv_channels=128, seq_length=4096, window_size=None, rotary_percent=1.0,
        rotary_base=1000000.0)),
    "mistral.MistralNeMoConfig123B": ("mistral.MistralConfig7B", dict(
        num_layers=88, hidden_size=12288, ffn_hidden_size=28672, num_attention_heads=96, kv_channels=128,
        seq_length=4096, window_size=None, rotary_percent=1.0, rotary_base=1000000.0)),
    "mixtral.MixtralConfig": ("base.GPTConfig", _MIXTRAL),
    "mixtral.MixtralConfig8x3B": ("mixtral.MixtralConfig", dict(num_layers=32, hidden_size=2560,
                                                                num_attention_heads=32, ffn_hidden_size=8960,
                                                                seq_length=4096)),
    "mixtral.MixtralConfig8x7B": ("mixtral.MixtralConfig", dict(num_layers=32, hidden_size=4096,
                                                                ffn_hidden_size=14336, seq_length=4096)),
    "mixtral.MixtralConfig8x22B": ("mixtral.MixtralConfig", dict(num_layers=56, hidden_size=6144,
                                                                 num_attention_heads=48, ffn_hidden_size=16384,
                                                                 seq_length=4096)),
    "qwen2.Qwen2Config": ("base.GPTConfig", _QWEN2),
    "qwen2.Qwen2Config500M": ("qwen2.Qwen2Config", _sizes(24, 896, 14, 2, 4864)),
    "qwen2.Qwen25Config500M": ("qwen2.Qwen2Config500M", dict(seq_length=32768)),
    "qwen2.Qwen2Config1P5B": ("qwen2.Qwen2Config", _sizes(28, 1536, 12, 2, 8960)),
    "qwen2.Qwen25Config1P5B": ("qwen2.Qwen2Config1P5B", dict(seq_length=131072)),
    "qwen2.Qwen25Config3B": ("qwen2.Qwen2Config", _sizes(36, 2048, 16, 2, 11008, vocab_size=151936,
                                                         share_embeddings_and_output_weights=True)),
    "qwen2.Qwen2Config7B": ("qwen2.Qwen2Config", _sizes(28, 3584, 28, 4, 18944, vocab_size=152064)),
    "qwen2.Qwen25Config7B": ("qwen2.Qwen2Config7B", dict(seq_length=131072)),
    "qwen2.Qwen25Config14B": ("qwen2.Qwen2Config", _sizes(48, 5120, 40, 8, 13824, vocab_size=152064,
                                                          layernorm_epsilon=1e-5, seq_length=131072)),
    "qwen2.Qwen25Config32B": ("qwen2.Qwen2Config", _sizes(64, 5120, 40, 8, 27648, vocab_size=152064,
                                                          layernorm_epsilon=1e-5, seq_length=131072)),
    "qwen2.Qwen2Config72B": ("qwen2.Qwen2Config", _sizes(80, 8192, 64, 8, 29568, vocab_size=152064,
                                                         layernorm_epsilon=1e-5)),
    "qwen2.Qwen25Config72B": ("qwen2.Qwen2Config72B", dict(seq_length=131072)),
    "qwen3.Qwen3Config": ("qwen2.Qwen2Config", dict(add_qkv_bias=False, qk_layernorm=True, kv_channels=128,
                                                    num_query_groups=8, vocab_size=151936)),
    "qwen3.Qwen3MoEConfig": ("qwen3.Qwen3Config", dict(num_moe_experts=128, moe_aux_loss_coeff=1e-3,
                                                       moe_router_topk=8, moe_router_pre_softmax=False)),
    "qwen3.Qwen3Config600M": ("qwen3.Qwen3Config", dict(num_layers=28, hidden_size=1024, num_attention_heads=16,
                                                        ffn_hidden_size=3072,
                                                        share_embeddings_and_output_weights=True)),
    "qwen3.Qwen3Config1P7B": ("qwen3.Qwen3Config", dict(num_layers=28, hidden_size=2048, num_attention_heads=16,
                                                        ffn_hidden_size=6144,
                                                        share_embeddings_and_output_weights=True)),
    "qwen3.Qwen3Config4B": ("qwen3.Qwen3Config", dict(num_layers=36, hidden_size=2560, num_attention_heads=32,
                                                      ffn_hidden_size=9728, share_embeddings_and_output_weights=True)),
    "qwen3.Qwen3Config8B": ("qwen3.Qwen3Config", dict(num_layers=36, hidden_size=4096, num_attention_heads=32,
                                                      ffn_hidden_size=12288)),
    "qwen3.Qwen3Config14B": ("qwen3.Qwen3Config", dict(num_layers=40, hidden_size=5120, num_attention_heads=40,
                                                       ffn_hidden_size=17408)),
    "qwen3.Qwen3Config32B": ("qwen3.Qwen3Config", dict(num_layers=64, hidden_size=5120, num_attention_heads=64,
                                                       ffn_hidden_size=25600)),
    "qwen3.Qwen3Config30B_A3B": ("qwen3.Qwen3MoEConfig", _sizes(48, 2048, 32, 4, 6144, moe_ffn_hidden_size=768)),
    # DeepSeekConfig(MLATransformerConfig, GPTConfig): in Python's order MLATransformerConfig's defaults come
    # over GPTConfig's, so the chain runs DeepSeekConfig -> MLATransformerConfig -> GPTConfig
    MLA: ("base.GPTConfig", dict(multi_latent_attention=True, q_lora_rank=512, kv_lora_rank=512, qk_head_dim=128,
                                 qk_pos_emb_head_dim=64, v_head_dim=128, normalization="RMSNorm", rope_type="yarn",
                                 rotary_base=10000, rotary_percent=1.0, rotary_scaling_factor=40,
                                 original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0,
                                 mscale_all_dim=0.0)),
    "deepseek.DeepSeekConfig": (MLA, dict(
        normalization="RMSNorm", activation_func=SILU, gated_linear_unit=True, position_embedding_type="rope",
        add_bias_linear=False, share_embeddings_and_output_weights=False, num_attention_heads=128, kv_channels=128,
        seq_length=4096, rotary_base=10000.0, make_vocab_size_divisible_by=3200, mtp_num_layers=None,
        qk_layernorm=True, moe_router_pre_softmax=True, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
        qk_pos_emb_head_dim=64, v_head_dim=128, rotary_scaling_factor=40, mscale=1.0, mscale_all_dim=1.0,
        layernorm_epsilon=1e-6)),
    "deepseek.DeepSeekV2Config": ("deepseek.DeepSeekConfig", dict(
        num_layers=60, hidden_size=5120, ffn_hidden_size=12288, num_moe_experts=160, moe_ffn_hidden_size=1536,
        moe_shared_expert_intermediate_size=3072, moe_layer_freq=[0] + [1] * 59, moe_router_topk=6,
        moe_router_num_groups=8, moe_router_group_topk=3, moe_router_topk_scaling_factor=16.0,
        moe_aux_loss_coeff=1e-3, mscale=0.707, mscale_all_dim=0.707)),
    "deepseek.DeepSeekV2LiteConfig": ("deepseek.DeepSeekV2Config", dict(
        num_layers=27, hidden_size=2048, ffn_hidden_size=10944, num_attention_heads=16, kv_channels=16,
        q_lora_rank=None, num_moe_experts=64, moe_ffn_hidden_size=1408, moe_shared_expert_intermediate_size=2816,
        moe_layer_freq=[0] + [1] * 26, moe_router_topk=6, moe_router_num_groups=1, moe_router_group_topk=1,
        moe_router_topk_scaling_factor=1.0)),
    "deepseek.DeepSeekV3Config": ("deepseek.DeepSeekConfig", dict(
        num_layers=61, hidden_size=7168, ffn_hidden_size=18432, num_moe_experts=256, moe_ffn_hidden_size=2048,
        moe_shared_expert_intermediate_size=2048, moe_layer_freq=[0] * 3 + [1] * 58, moe_router_topk=8,
        moe_router_num_groups=8, moe_router_group_topk=4, moe_router_topk_scaling_factor=2.5,
        moe_aux_loss_coeff=1e-4, make_vocab_size_divisible_by=1280, moe_router_score_function="sigmoid")),
    "qwen3.Qwen3Config235B_A22B": ("qwen3.Qwen3MoEConfig", _sizes(94, 4096, 64, 4, 12288, moe_ffn_hidden_size=1536)),
}
# Llama 3.1's scaling as Megatron's use_rope_scaling computes it: only the factor may differ
LLAMA31_FIXED = {k: v for k, v in _LLAMA31.items() if k != "scale_factor"}


def known(target: str) -> bool:
    return target.removeprefix(NEMO) in CLASSES and target.startswith(NEMO)


def class_defaults(target: str) -> dict[str, Any]:
    """The defaults of a NeMo 2 config class (a path `known` accepts), its bases' first."""
    chain = []
    name: str | None = target.removeprefix(NEMO)
    while name is not None:
        parent, fields = CLASSES[name]
        chain.append(fields)
        name = parent
    out = dict(TRANSFORMER_CONFIG)
    for fields in reversed(chain):
        out |= fields
    return copy.deepcopy(out)  # the table's lists stay the table's


def with_defaults(model: dict[str, Any], where: str) -> dict[str, Any]:
    """The config's recorded arguments over its class's defaults, then what TransformerConfig.__post_init__
    derives from them (ffn 4 x hidden, one query group per head, head size hidden / heads, the experts' ffn)."""
    out = class_defaults(model["_target_"]) | model
    for name in ("hidden_size", "num_attention_heads"):
        if not isinstance(out[name], int) or isinstance(out[name], bool) or out[name] < 0:
            raise ConvertError(f"{where}: {name} {out[name]!r} is not a whole number")
    if out["ffn_hidden_size"] is None:
        out["ffn_hidden_size"] = 4 * out["hidden_size"]
    if out["num_query_groups"] is None:
        out["num_query_groups"] = out["num_attention_heads"]
    if out["kv_channels"] is None and out["num_attention_heads"]:
        out["kv_channels"] = out["hidden_size"] // out["num_attention_heads"]
    if out["num_moe_experts"] and out["moe_ffn_hidden_size"] is None:
        out["moe_ffn_hidden_size"] = out["ffn_hidden_size"]
    return out
