"""Hugging Face Llama and Mistral: the key table and the config.json mapping (both directions)."""

from __future__ import annotations

from typing import Any

from mconvert import deepseek
from mconvert.errors import ConvertError
from mconvert.ir import ModelConfig
from mconvert.rules import Rule, Table, linear
from mconvert.schemas.hf_common import parse, rope_decoder_config, rope_decoder_fields

MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}

TABLE = Table(
    embedding=(Rule("model.embed_tokens.weight", ("embed.weight",)),),
    layer=(
        Rule("model.layers.{L}.input_layernorm.weight", ("layers.{L}.attn_norm.weight",)),
        *linear("model.layers.{L}.self_attn.q_proj", "layers.{L}.attn.q"),
        *linear("model.layers.{L}.self_attn.k_proj", "layers.{L}.attn.k"),
        *linear("model.layers.{L}.self_attn.v_proj", "layers.{L}.attn.v"),
        *linear("model.layers.{L}.self_attn.o_proj", "layers.{L}.attn.o"),
        Rule("model.layers.{L}.post_attention_layernorm.weight", ("layers.{L}.mlp_norm.weight",)),
        *linear("model.layers.{L}.mlp.gate_proj", "layers.{L}.mlp.gate"),
        *linear("model.layers.{L}.mlp.up_proj", "layers.{L}.mlp.up"),
        *linear("model.layers.{L}.mlp.down_proj", "layers.{L}.mlp.down"),
    ),
    head=(
        Rule("model.norm.weight", ("final_norm.weight",)),
        Rule("lm_head.weight", ("lm_head.weight",)),
    ),
)

# Present in some checkpoints, never model weights: rotary frequencies (recomputed from rope_theta).
DROP = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)


def config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConvertError(f"{where}: model_type {model_type!r} is not a Llama or Mistral model "
                           f"(expected one of {', '.join(MODEL_TYPES)})")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConvertError(f"{where}: hidden_act {act!r} is not supported for {model_type} (expected 'silu')")
    # transformers' defaults where config.json leaves a field out; Mistral's differ from Llama's.
    mistral = model_type == "mistral"
    defaults = {"num_key_value_heads": 8 if mistral else None, "sliding_window": 4096 if mistral else None,
                "max_position_embeddings": 131072 if mistral else 2048}
    hf = defaults | hf
    bias = bool(hf.get("attention_bias", False))
    return parse(where, lambda: ModelConfig(
        family=model_type, **rope_decoder_fields(hf), qkv_bias=bias, proj_bias=bias,
        mlp_bias=bool(hf.get("mlp_bias", False)), sliding_window=hf["sliding_window"] if mistral else None))


def config_to_hf(c: ModelConfig) -> dict[str, Any]:
    if c.family not in MODEL_TYPES:
        raise ConvertError(f"the Llama/Mistral saver cannot write a {c.family} model; use the saver for that family")
    unsupported = [what for what, bad in (
        (f"activation {c.activation} (Llama and Mistral use SwiGLU)", c.activation != "swiglu"),
        (f"{c.norm} (they use RMSNorm)", c.norm != "rmsnorm"),
        ("learned position embeddings (they use rotary)", c.position_embedding != "rope"),
        ("experts (save it as mixtral)", c.is_moe),
        ("per-head q/k norms (save it as qwen3)", c.qk_norm),
        (f"no sliding window in layers {list(c.full_attention_layers)} (Mistral's applies to every layer)",
         c.sliding_window is not None and bool(c.full_attention_layers)),
    ) if bad] + deepseek.features(c)
    if unsupported:
        raise ConvertError(f"HF {MODEL_TYPES[c.family].removesuffix('ForCausalLM')} cannot hold this model: "
                           f"{', '.join(unsupported)}")
    if c.qkv_bias != c.proj_bias:
        raise ConvertError("HF Llama has one attention_bias flag for q/k/v and o; this model has bias on "
                           f"{'q/k/v only' if c.qkv_bias else 'o only'}")
    hf = rope_decoder_config(c, MODEL_TYPES[c.family], c.family) | {"attention_bias": c.qkv_bias}
    if c.family == "llama":
        hf["mlp_bias"] = c.mlp_bias
        hf["pretraining_tp"] = 1
    else:
        if c.mlp_bias:
            raise ConvertError("HF Mistral has no MLP bias; this model has one (save it as family llama)")
        hf["sliding_window"] = c.sliding_window
    return hf
