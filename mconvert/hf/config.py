"""Hugging Face config.json conventions shared by every HF family (dtype, rope parameters, generation config)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mconvert.errors import ConvertError
from mconvert.ir.config import ModelConfig

REQUIRED = object()  # a Field without a default


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


@dataclass(frozen=True)
class Field:
    """One config.json field that is one ModelConfig field, read with `kind` (absent or null: `default`; no
    default: a missing field), written as the IR holds it."""

    hf: str
    ir: str
    kind: Callable[[Any], Any] = lambda value: value
    default: Any = REQUIRED


# The fields every RoPE/RMSNorm/SwiGLU decoder family (Llama, Mistral, Mixtral, Qwen) shares, both ways. The
# computed ones follow in `decoder_fields` / `decoder_config`: key/value heads and head_dim (defaults from the
# heads), rope (two spellings), dtype (two spellings).
DECODER_FIELDS = (
    Field("num_hidden_layers", "num_layers", int),
    Field("hidden_size", "hidden_size", int),
    Field("intermediate_size", "ffn_hidden_size", int),
    Field("num_attention_heads", "num_attention_heads", int),
    Field("vocab_size", "vocab_size", int),
    Field("max_position_embeddings", "max_position_embeddings", int),
    Field("rms_norm_eps", "norm_eps", float, 1e-6),
    Field("tie_word_embeddings", "tie_embeddings", bool, False),
    Field("bos_token_id", "bos_token_id", default=None),
    Field("eos_token_id", "eos_token_id", default=None),
    Field("pad_token_id", "pad_token_id", default=None),
)
# What such a family's config.json says that the IR takes as given (refused elsewhere when the model differs)
DECODER_CONSTANTS = {"norm": "rmsnorm", "activation": "swiglu", "position_embedding": "rope"}
# What transformers writes for such a family and the IR has no field for
DECODER_WRITTEN = {"attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02, "use_cache": True}


def fields_from_hf(hf: dict[str, Any], fields: tuple[Field, ...]) -> dict[str, Any]:
    """ModelConfig fields from config.json by `fields` (a missing required one raises KeyError, see `parse`)."""
    out = {}
    for f in fields:
        value = hf.get(f.hf)
        if value is None and f.default is REQUIRED:
            raise KeyError(f.hf)
        out[f.ir] = f.default if value is None else f.kind(value)
    return out


def fields_to_hf(c: ModelConfig, fields: tuple[Field, ...]) -> dict[str, Any]:
    return {f.hf: getattr(c, f.ir) for f in fields}


def rope_decoder_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields every RoPE/RMSNorm/SwiGLU family reads alike from config.json (defaults already merged)."""
    fields = fields_from_hf(hf, DECODER_FIELDS)
    heads, hidden = fields["num_attention_heads"], fields["hidden_size"]
    theta, scaling = rope_from_hf(hf)
    return fields | DECODER_CONSTANTS | dict(
        num_query_groups=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads), rope_theta=theta, rope_scaling=scaling,
        dtype=config_dtype(hf))


def rope_decoder_config(c: ModelConfig, architecture: str, model_type: str) -> dict[str, Any]:
    """The config.json fields every RoPE/RMSNorm/SwiGLU decoder family (Llama, Mistral, Mixtral, Qwen) shares."""
    return {"architectures": [architecture], "model_type": model_type, **DECODER_WRITTEN,
            **fields_to_hf(c, DECODER_FIELDS), "num_key_value_heads": c.num_query_groups, "head_dim": c.head_dim,
            "dtype": c.dtype, "torch_dtype": c.dtype, **rope_to_hf(c)}


def parse(where: str, build: Callable[[], ModelConfig]) -> ModelConfig:
    """Run `build`, turning a missing or mistyped config.json field into an error naming the file."""
    try:
        return build()
    except KeyError as e:
        raise ConvertError(f"{where}: missing field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ConvertError(f"{where}: a field has a value of the wrong kind: {e}") from None
