"""Hugging Face Gemma 3: `gemma3_text` (Gemma3ForCausalLM) and the language model of `gemma3`
(Gemma3ForConditionalGeneration, whose vision tower is not read). Per layer i:

    model.layers.{i}.input_layernorm.weight               attn_norm        every norm scales by (1 + weight)
    model.layers.{i}.self_attn.{q,k,v,o}_proj.{weight,bias}                  bias: attention_bias
    model.layers.{i}.self_attn.{q,k}_norm.weight [hd]     per-head q/k norms
    model.layers.{i}.post_attention_layernorm.weight      post_attn_norm   the attention output's norm (sandwich)
    model.layers.{i}.pre_feedforward_layernorm.weight     mlp_norm
    model.layers.{i}.mlp.{gate,up,down}_proj.weight       down(gelu_tanh(gate(x)) * up(x))
    model.layers.{i}.post_feedforward_layernorm.weight    post_mlp_norm    the MLP output's norm (sandwich)

Embeddings are multiplied by sqrt(hidden_size); `layer_types` says which layers slide (`sliding_window`, the rope
theta of `rope_parameters["sliding_attention"]`, transformers 4's `rope_local_base_freq`) and which attend fully
(`rope_parameters["full_attention"]`, with its scaling); queries are scaled by `query_pre_attn_scalar`**-0.5;
logits are soft-capped when `final_logit_softcapping` is set. `attn_logit_softcapping` is refused: transformers'
Gemma 3 keeps it in its config but does not apply it (Gemma 2 did).

A `gemma3` directory keeps the language model under `model.language_model.` (transformers 5) or
`language_model.model.` (transformers 4) and the vision tower and projector beside it: those are left out, and
`mconvert inspect` says so (layout "vision tower"). Writing always gives the text model (`gemma3_text`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mconvert.errors import ConvertError
from mconvert.hf.config import (
    DECODER_FIELDS,
    config_dtype,
    fields_from_hf,
    fields_to_hf,
    parse,
    rope_from_hf,
)
from mconvert.hf.family import HFFamily, load_hf, register_family, save_hf
from mconvert.ir.config import ModelConfig
from mconvert.ir.tensors import LazyTensor, ModelIR
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.registry import missing_features
from mconvert.rules.table import Rule, Table, linear

MODEL_TYPE = "gemma3_text"
ARCHITECTURE = "Gemma3ForCausalLM"
MULTIMODAL = "gemma3"  # read only: its language model
SUPPORTS = frozenset({"qk_norm", "sandwich_norms", "norm_zero_centered", "embedding_multiplier", "geglu",
                      "local_rope", "query_pre_attn_scalar", "final_softcap"})

TABLE = Table(
    embedding=(Rule("model.embed_tokens.weight", ("embed.weight",)),),
    layer=(
        Rule("model.layers.{L}.input_layernorm.weight", ("layers.{L}.attn_norm.weight",)),
        *linear("model.layers.{L}.self_attn.q_proj", "layers.{L}.attn.q"),
        *linear("model.layers.{L}.self_attn.k_proj", "layers.{L}.attn.k"),
        *linear("model.layers.{L}.self_attn.v_proj", "layers.{L}.attn.v"),
        *linear("model.layers.{L}.self_attn.o_proj", "layers.{L}.attn.o"),
        Rule("model.layers.{L}.self_attn.q_norm.weight", ("layers.{L}.attn.q_norm.weight",)),
        Rule("model.layers.{L}.self_attn.k_norm.weight", ("layers.{L}.attn.k_norm.weight",)),
        Rule("model.layers.{L}.post_attention_layernorm.weight", ("layers.{L}.post_attn_norm.weight",)),
        Rule("model.layers.{L}.pre_feedforward_layernorm.weight", ("layers.{L}.mlp_norm.weight",)),
        Rule("model.layers.{L}.mlp.gate_proj.weight", ("layers.{L}.mlp.gate.weight",)),
        Rule("model.layers.{L}.mlp.up_proj.weight", ("layers.{L}.mlp.up.weight",)),
        Rule("model.layers.{L}.mlp.down_proj.weight", ("layers.{L}.mlp.down.weight",)),
        Rule("model.layers.{L}.post_feedforward_layernorm.weight", ("layers.{L}.post_mlp_norm.weight",)),
    ),
    head=(
        Rule("model.norm.weight", ("final_norm.weight",)),
        Rule("lm_head.weight", ("lm_head.weight",)),
    ),
)

# Present in some checkpoints, never model weights: rotary frequencies (recomputed from the thetas).
DROP = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)
# The language model of a gemma3 (multimodal) checkpoint, by the prefixes transformers 5 and 4 save it under
LANGUAGE_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                     ("language_model.lm_head.", "lm_head."))
VISION = re.compile(r"(model\.)?(vision_tower|multi_modal_projector)\.")

# Gemma3TextConfig's defaults (transformers 5), for fields config.json leaves out
DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
            "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
            "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True,
            "attention_bias": False, "query_pre_attn_scalar": 256, "sliding_window": 4096,
            "final_logit_softcapping": None, "attn_logit_softcapping": None, "use_bidirectional_attention": False,
            "sliding_window_pattern": 6}
DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
# transformers' names of the tanh approximation of GELU (ACT2FN); Gemma 3 ships gelu_pytorch_tanh
TANH_GELU = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")


def text_config(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """The text model's config.json fields: the file's own (gemma3_text) or its `text_config` (gemma3)."""
    model_type = hf.get("model_type")
    if model_type == MODEL_TYPE:
        return hf
    if model_type != MULTIMODAL:
        raise ConvertError(f"{where}: model_type {model_type!r} is not a Gemma 3 model (expected {MODEL_TYPE} or "
                           f"{MULTIMODAL})")
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ConvertError(f"{where}: a {MULTIMODAL} config needs a text_config mapping (its language model)")
    if text.get("final_logit_softcapping") is not None:
        raise ConvertError(f"{where}: text_config.final_logit_softcapping={text['final_logit_softcapping']!r}: "
                           "Gemma3ForConditionalGeneration does not apply it (Gemma3ForCausalLM does); refusing rather "
                           "than guessing which of the two models is meant")
    inherited = {k: hf[k] for k in ("dtype", "torch_dtype", "tie_word_embeddings") if k in hf and k not in text}
    return text | inherited


def config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    """The IR config of a Gemma 3 config.json (the language model of a multimodal one)."""
    text = text_config(hf, where)
    # null means none for these (transformers keeps it): never the class default
    nullable = ("final_logit_softcapping", "attn_logit_softcapping", "sliding_window")
    text = DEFAULTS | {k: v for k, v in text.items() if v is not None or k in nullable}
    act = text.get("hidden_activation") or text.get("hidden_act")
    if act not in TANH_GELU:
        raise ConvertError(f"{where}: hidden_activation {act!r} is not supported for Gemma 3 (expected one of "
                           f"{', '.join(TANH_GELU)}, the tanh approximation of GELU)")
    if text["attn_logit_softcapping"] is not None:
        raise ConvertError(f"{where}: attn_logit_softcapping={text['attn_logit_softcapping']!r}: transformers' Gemma 3 "
                           "does not apply it (Gemma 2 did; Gemma 3 replaced it by the q/k norms), so what this "
                           "checkpoint computes is not settled; refusing")
    if text["use_bidirectional_attention"]:
        raise ConvertError(f"{where}: use_bidirectional_attention=true (EmbeddingGemma's encoder) is not a causal "
                           "language model; mconvert converts decoders only")

    def build() -> ModelConfig:
        fields = fields_from_hf(text, DECODER_FIELDS)
        layers, hidden = fields["num_layers"], fields["hidden_size"]
        full = _full_layers(text, layers, where)
        window = _window(text, layers, full, fields["max_position_embeddings"], where)
        (theta, scaling), local_theta = _rope(text, where)
        bias = bool(text["attention_bias"])
        return ModelConfig(
            family=MODEL_TYPE, **fields, norm="rmsnorm", activation="geglu_tanh", position_embedding="rope",
            num_query_groups=int(text["num_key_value_heads"]), head_dim=int(text["head_dim"]), rope_theta=theta,
            rope_scaling=scaling, dtype=config_dtype(text), qkv_bias=bias, proj_bias=bias, qk_norm=True,
            sliding_window=window, full_attention_layers=full, sandwich_norms=True, norm_zero_centered=True,
            embedding_multiplier=hidden ** 0.5, local_rope_theta=local_theta,
            query_pre_attn_scalar=float(text["query_pre_attn_scalar"]),
            final_logit_softcap=_cap(text["final_logit_softcapping"]))

    return parse(where, build)


def _cap(value: Any) -> float | None:
    return None if value is None else float(value)


def _full_layers(text: dict[str, Any], layers: int, where: str) -> tuple[int, ...]:
    """The layers `layer_types` calls full_attention (without it: every sliding_window_pattern-th layer)."""
    types = text.get("layer_types")
    if types is None:
        pattern = text["sliding_window_pattern"]
        if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
            raise ConvertError(f"{where}: sliding_window_pattern must be a positive integer, got {pattern!r}")
        return tuple(i for i in range(layers) if (i + 1) % pattern == 0)
    if not isinstance(types, list) or len(types) != layers or not set(types) <= set(LAYER_TYPES):
        raise ConvertError(f"{where}: layer_types must list 'full_attention' or 'sliding_attention' for each of the "
                           f"{layers} layers (num_hidden_layers), got {types!r}")
    return tuple(i for i, kind in enumerate(types) if kind == "full_attention")


def _window(text: dict[str, Any], layers: int, full: tuple[int, ...], positions: int, where: str) -> int | None:
    """sliding_window, refused where it cannot mean what Gemma 3 means: sliding layers without a window, or a
    window longer than the positions the model has (max_position_embeddings)."""
    if len(full) == layers:
        return None
    window = text.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ConvertError(f"{where}: sliding_window must be a positive integer for the sliding_attention layers, "
                           f"got {window!r}")
    if window > positions:
        raise ConvertError(f"{where}: sliding_window={window} is larger than max_position_embeddings={positions}: "
                           "no sequence is long enough for the window to matter")
    return window


def _rope(text: dict[str, Any], where: str) -> tuple[tuple[float, dict[str, Any] | None], float]:
    """((theta, scaling) of the full-attention layers, theta of the sliding ones), from transformers 5's
    `rope_parameters` by layer type or transformers 4's rope_theta / rope_scaling / rope_local_base_freq."""
    params = text.get("rope_parameters")
    if params is not None and (not isinstance(params, dict) or not set(params) <= set(LAYER_TYPES)):
        raise ConvertError(f"{where}: rope_parameters must map {' and '.join(LAYER_TYPES)} to rope parameters, got "
                           f"{params!r}")
    params = params or {}
    full = dict(params.get("full_attention") or {})
    full.setdefault("rope_theta", text.get("rope_theta", DEFAULT_THETA["full_attention"]))
    if text.get("rope_scaling") and "rope_type" not in full:
        full |= text["rope_scaling"]
    local = dict(params.get("sliding_attention") or {})
    local.setdefault("rope_theta", text.get("rope_local_base_freq", DEFAULT_THETA["sliding_attention"]))
    local_theta, local_scaling = rope_from_hf({"rope_parameters": local})
    if local_scaling is not None:
        raise ConvertError(f"{where}: rope_parameters.sliding_attention {local!r}: the sliding layers' rope must be "
                           "the default one (a theta of their own, no scaling)")
    return rope_from_hf({"rope_parameters": full}), local_theta


def config_to_hf(c: ModelConfig) -> dict[str, Any]:
    """A Gemma3ForCausalLM config.json for the IR config; refuses what Gemma 3 cannot compute."""
    if c.family != MODEL_TYPE:
        raise ConvertError(f"the Gemma 3 saver cannot write a {c.family} model; use the saver for that family")
    unsupported = [what for what, bad in (
        (f"activation {c.activation} (Gemma 3 uses a gated GELU, tanh approximation)", c.activation != "geglu_tanh"),
        (f"{c.norm} (Gemma 3 uses RMSNorm)", c.norm != "rmsnorm"),
        ("norms scaling by their weight alone (Gemma 3's scale by 1 + weight)", not c.norm_zero_centered),
        ("no sandwich norms (Gemma 3 normalizes the attention and MLP outputs)", not c.sandwich_norms),
        ("no per-head q/k norms", not c.qk_norm),
        (f"embeddings multiplied by {c.embedding_multiplier} (Gemma 3: sqrt(hidden_size) = "
         f"{c.hidden_size ** 0.5})", c.embedding_multiplier != c.hidden_size ** 0.5),
        ("learned position embeddings (it uses rotary)", c.position_embedding != "rope"),
        ("MLP biases", c.mlp_bias),
        ("biases on q/k/v without o (attention_bias covers all four)", c.qkv_bias != c.proj_bias),
        ("experts", c.is_moe),
        ("a window that applies to no layer", c.sliding_window is not None
         and len(c.full_attention_layers) == c.num_layers),
    ) if bad] + missing_features(c, SUPPORTS)
    if unsupported:
        raise ConvertError(f"HF Gemma 3 cannot hold this model: {', '.join(unsupported)}")
    full: dict[str, Any] = {"rope_type": "default"} | (c.rope_scaling or {}) | {"rope_theta": c.rope_theta}
    local = {"rope_type": "default", "rope_theta": c.local_rope_theta or c.rope_theta}
    kinds = ["full_attention" if c.layer_window(i) is None else "sliding_attention" for i in range(c.num_layers)]
    scalar = c.query_pre_attn_scalar if c.query_pre_attn_scalar is not None else float(c.head_dim)
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, **fields_to_hf(c, DECODER_FIELDS),
        "num_key_value_heads": c.num_query_groups, "head_dim": c.head_dim, "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": c.qkv_bias, "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
        "query_pre_attn_scalar": int(scalar) if scalar == int(scalar) else scalar,
        "sliding_window": c.sliding_window if c.sliding_window is not None else DEFAULTS["sliding_window"],
        "layer_types": kinds, "rope_parameters": {"full_attention": full, "sliding_attention": local},
        "attn_logit_softcapping": None, "final_logit_softcapping": c.final_logit_softcap,
        "use_bidirectional_attention": False, "dtype": c.dtype, "torch_dtype": c.dtype,
    }


def language_model(source: dict[str, LazyTensor]) -> dict[str, LazyTensor]:
    """A gemma3 checkpoint's language model under the text model's names (vision tower and projector left out);
    a gemma3_text checkpoint as it is."""
    out = {}
    for key, tensor in source.items():
        if VISION.match(key):
            continue
        for prefix, text in LANGUAGE_PREFIXES:
            if key.startswith(prefix):
                key = text + key[len(prefix):]
                break
        out[key] = tensor
    return out


def _layout(source: dict[str, LazyTensor]) -> dict[str, Any]:
    vision = sum(1 for key in source if VISION.match(key))
    return {"vision tower": f"{vision} tensors not read (the language model only)"} if vision else {}


def load(path: Path, options: Options) -> ModelIR:
    """Hugging Face Gemma 3: gemma3_text, or the language model of gemma3 (the vision tower is left out, and
    `inspect` says so); safetensors or .bin, sharded or not."""
    layouts: dict[str, Any] = {}

    def fix(source: dict[str, LazyTensor]) -> dict[str, LazyTensor]:
        layouts.update(_layout(source))
        return language_model(source)

    return load_hf(path, options, name="gemma3_hf", config_from_hf=config_from_hf, table=TABLE,
                   embed_key="model.embed_tokens.weight", drop=DROP, fix_source=fix, layout=lambda _: layouts)


def save(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    """Hugging Face Gemma 3 text model (Gemma3ForCausalLM): sharded safetensors + index, config, generation config,
    tokenizer."""
    save_hf(ir, out, options, progress, table=TABLE, config_to_hf=config_to_hf, where="saver gemma3_hf")


FAMILY = register_family(HFFamily("gemma3_hf", {MODEL_TYPE: ARCHITECTURE, MULTIMODAL: ARCHITECTURE}, load, save,
                                  SUPPORTS, aliases=("gemma3",)))
