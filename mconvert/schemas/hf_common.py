"""Hugging Face config.json conventions shared by every HF family (dtype, rope parameters, generation config)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mconvert.errors import ConvertError
from mconvert.ir import ModelConfig


def config_dtype(hf: dict[str, Any]) -> str:
    """The weights' dtype as config.json states it (`dtype` in transformers 5, `torch_dtype` before)."""
    value = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    return value if value in ("float32", "bfloat16", "float16") else "float32"


def rope_from_hf(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either transformers 5's `rope_parameters` or the older `rope_theta`/`rope_scaling`."""
    params = hf.get("rope_parameters")
    for name in ("rope_parameters", "rope_scaling"):  # else dropped, and the model run with plain rope
        if hf.get(name) is not None and not isinstance(hf[name], dict):
            raise ConvertError(f"{name} {hf[name]!r}: expected a mapping (rope_type, rope_theta, factor, ...)")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(hf.get("rope_theta", 10000.0))
        scaling = dict(hf.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, scaling


def rope_to_hf(c: ModelConfig) -> dict[str, Any]:
    """Both spellings, so transformers 4.x and 5.x (and tools that read `rope_theta`) agree."""
    params: dict[str, Any] = {"rope_theta": c.rope_theta, "rope_type": "default"}
    if c.rope_scaling:
        params |= c.rope_scaling
    return {"rope_parameters": params, "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling}


def generation_config(c: ModelConfig) -> dict[str, Any]:
    """generation_config.json as `save_pretrained` writes it from a model config."""
    out: dict[str, Any] = {"_from_model_config": True}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(c, key) is not None:
            out[key] = getattr(c, key)
    return out


def rope_decoder_config(c: ModelConfig, architecture: str, model_type: str) -> dict[str, Any]:
    """The config.json fields every RoPE/RMSNorm/SwiGLU decoder family (Llama, Mistral, Mixtral) shares."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "attention_dropout": 0.0,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "pad_token_id": c.pad_token_id,
        "dtype": c.dtype,
        "torch_dtype": c.dtype,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "hidden_size": c.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": c.ffn_hidden_size,
        "max_position_embeddings": c.max_position_embeddings,
        "num_attention_heads": c.num_attention_heads,
        "num_hidden_layers": c.num_layers,
        "num_key_value_heads": c.num_query_groups,
        "rms_norm_eps": c.norm_eps,
        "tie_word_embeddings": c.tie_embeddings,
        "use_cache": True,
        "vocab_size": c.vocab_size,
        **rope_to_hf(c),
    }


def rope_decoder_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields every RoPE/RMSNorm/SwiGLU family reads alike from config.json (defaults already merged)."""
    heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
    theta, scaling = rope_from_hf(hf)
    return dict(
        num_layers=int(hf["num_hidden_layers"]), hidden_size=hidden, ffn_hidden_size=int(hf["intermediate_size"]),
        num_attention_heads=heads, num_query_groups=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads), vocab_size=int(hf["vocab_size"]),
        max_position_embeddings=int(hf["max_position_embeddings"]), norm="rmsnorm",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), activation="swiglu", position_embedding="rope",
        rope_theta=theta, rope_scaling=scaling, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        dtype=config_dtype(hf), bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"),
        pad_token_id=hf.get("pad_token_id"),
    )


def parse(where: str, build: Callable[[], ModelConfig]) -> ModelConfig:
    """Run `build`, turning a missing or mistyped config.json field into an error naming the file."""
    try:
        return build()
    except KeyError as e:
        raise ConvertError(f"{where}: missing field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ConvertError(f"{where}: a field has a value of the wrong kind: {e}") from None
