"""Sanity of configuration values, wherever they come from (config.json, Megatron args, params.json, mtrain).

A checkpoint's config is untrusted input like its tensors: JSON admits `NaN` and `Infinity`, a hand-edited file
can say `hidden_size: 64.5` (which `int()` would quietly turn into 64) or a negative rope theta. Such a model
would convert without complaint and compute garbage, so:

- `check_model_config` (run by every `ModelConfig`) refuses non-finite or out-of-range values;
- `check_integers` refuses, in a raw source mapping, integer fields holding fractions, text or booleans, before
  a reader converts them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from mconvert.errors import ConvertError

# Fields of the raw sources that hold counts or sizes (HF config.json, Megatron args, Meta params.json).
HF_INTEGERS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
               "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "sliding_window",
               "num_local_experts", "num_experts_per_tok", "num_experts", "moe_intermediate_size", "max_window_layers",
               "decoder_sparse_step", "n_layer", "n_embd", "n_head", "n_inner", "n_positions",
               "n_ctx",
               # DeepSeek-V3/V2
               "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
               "n_routed_experts", "n_shared_experts", "n_group", "topk_group", "first_k_dense_replace",
               "num_nextn_predict_layers", "moe_layer_freq",
               # BERT
               "type_vocab_size")
MEGATRON_INTEGERS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                     "kv_channels", "max_position_embeddings", "seq_length", "num_experts", "moe_router_topk",
                     "moe_ffn_hidden_size", "padded_vocab_size", "vocab_size", "orig_vocab_size",
                     "tensor_model_parallel_size", "model_parallel_size", "pipeline_model_parallel_size",
                     "expert_model_parallel_size", "expert_tensor_parallel_size", "make_vocab_size_divisible_by",
                     # multi-latent attention, DeepSeek routing, MTP
                     "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                     "moe_shared_expert_intermediate_size", "moe_router_num_groups", "moe_router_group_topk",
                     "mtp_num_layers", "original_max_position_embeddings")
META_INTEGERS = ("dim", "n_layers", "n_heads", "n_kv_heads", "multiple_of")  # vocab_size -1: from the tokenizer


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_integers(values: Mapping[str, Any], names: Iterable[str], where: str, label: str = "") -> None:
    """Each of `names` present in `values` as a number (or a boolean) must be a non-negative whole number; text
    is left to the reader, whose conversion reports it."""
    bad = []
    for name in names:
        value = values.get(name)
        if value is None or isinstance(value, str):
            continue
        whole = _is_number(value) and math.isfinite(value) and float(value).is_integer() and value >= 0
        if not whole:
            bad.append(f"{label}{name}={value!r}")
    if bad:
        raise ConvertError(f"{where}: {', '.join(bad)}: expected a whole number >= 0")


def check_model_config(c) -> None:
    """Refuse a ModelConfig whose numbers are non-finite or out of range (one error lists them all)."""
    bad = []

    def need(name: str, ok: bool, expected: str) -> None:
        if not ok:
            bad.append(f"{name}={getattr(c, name)!r} ({expected})")

    for name in ("norm_eps", "rope_theta", "embedding_multiplier"):
        v = getattr(c, name)
        need(name, _is_number(v) and math.isfinite(v) and v > 0, "a finite number > 0")
    for name in ("local_rope_theta", "query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap"):
        v = getattr(c, name)
        need(name, v is None or (_is_number(v) and math.isfinite(v) and v > 0), "a finite number > 0, or null")
    for name in ("moe_aux_loss_coeff", "moe_jitter_eps"):
        v = getattr(c, name)
        need(name, v is None or (_is_number(v) and math.isfinite(v) and v >= 0), "a finite number >= 0, or null")
    for name in ("sliding_window", "moe_top_k", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim",
                 "moe_shared_expert_ffn_hidden_size", "moe_router_groups", "moe_router_group_topk"):
        v = getattr(c, name)
        need(name, v is None or (_is_integer(v) and v > 0), "a positive integer, or null")
    for name in ("num_experts", "mtp_layers"):
        v = getattr(c, name)
        need(name, (v is None and name == "num_experts") or (_is_integer(v) and v >= 0),
             "a whole number, or null" if name == "num_experts" else "a whole number >= 0")
    v = c.moe_router_scaling_factor
    need("moe_router_scaling_factor", _is_number(v) and math.isfinite(v) and v > 0, "a finite number > 0")
    v = c.padded_vocab_size
    need("padded_vocab_size", v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= c.vocab_size),
         f"an integer >= vocab_size {c.vocab_size}, or null")
    v = c.glu_linear_offset
    need("glu_linear_offset", _is_number(v) and math.isfinite(v), "a finite number")
    v = c.activation_clamp
    need("activation_clamp", v is None or (_is_number(v) and math.isfinite(v) and v > 0),
         "a finite number > 0, or null")
    for name in ("qkv_bias", "proj_bias", "mlp_bias", "tie_embeddings", "moe_norm_topk", "qk_norm",
                 "moe_router_expert_bias", "sandwich_norms", "norm_zero_centered", "attention_sinks",
                 "moe_router_bias"):
        need(name, isinstance(getattr(c, name), bool), "true or false")
    if c.rope_scaling is not None:
        scaling = c.rope_scaling
        numbers_ok = isinstance(scaling, dict) and all(
            not _is_number(x) or math.isfinite(x) for x in scaling.values())
        factor = scaling.get("factor", 1.0) if isinstance(scaling, dict) else None
        need("rope_scaling", numbers_ok and _is_number(factor) and factor > 0,
             "a mapping of finite numbers with factor > 0")
        if isinstance(scaling, dict):
            bad += _rope_scaling_problems(scaling)
    if bad:
        raise ConvertError(f"config values out of range: {'; '.join(bad)}")


# transformers' rope types besides "default" (modeling_rope_utils), and the fields each cannot do without
ROPE_TYPES = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor", "original_max_position_embeddings"),
              "longrope": ("original_max_position_embeddings",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def _rope_scaling_problems(scaling: dict[str, Any]) -> list[str]:
    """What is wrong with a rope_scaling mapping besides non-finite numbers: an unknown rope_type, a field its type
    needs left out, a value of the wrong kind (text, a mapping), original_max_position_embeddings not a whole
    number > 0. Each would either be dropped by a saver or stop a reader halfway."""
    kind = scaling.get("rope_type")
    if kind not in ROPE_TYPES:
        return [f"rope_scaling.rope_type={kind!r} (one of {', '.join(ROPE_TYPES)})"]
    out = [f"rope_scaling.{name} missing (a {kind} rope needs it)" for name in ROPE_TYPES[kind] if name not in scaling]
    for name, value in scaling.items():
        plain = value is None or isinstance(value, bool) or _is_number(value)
        listed = name in ("short_factor", "long_factor") and isinstance(value, list) and \
            all(_is_number(x) and math.isfinite(x) for x in value)  # longrope's per-frequency factors
        if name != "rope_type" and not (plain or listed):
            out.append(f"rope_scaling.{name}={value!r} (a number)")
    original = scaling.get("original_max_position_embeddings")
    if original is not None and not (_is_number(original) and float(original).is_integer() and original > 0):
        out.append(f"rope_scaling.original_max_position_embeddings={original!r} (a whole number > 0)")
    return out


def check_true_vocab_size(given: int | None, args: Any, tokenizer_size: int | None, where: str) -> None:
    """--true-vocab-size may fill in a size the checkpoint does not record, never contradict one it does: a
    smaller value would silently drop the rows of real tokens."""
    if given is None:
        return
    recorded = getattr(args, "vocab_size", None) or getattr(args, "orig_vocab_size", None)
    if recorded and given != recorded:
        name = "args.vocab_size" if getattr(args, "vocab_size", None) else "args.orig_vocab_size"
        raise ConvertError(f"{where}: --true-vocab-size {given} contradicts the vocabulary recorded in the checkpoint "
                           f"({name} = {recorded}); drop the option to use the recorded size")
    if tokenizer_size and given < tokenizer_size:
        raise ConvertError(f"{where}: --true-vocab-size {given} is smaller than the checkpoint's tokenizer "
                           f"({tokenizer_size} tokens): the rows of its last {tokenizer_size - given} tokens would be "
                           "dropped")


def with_where(where: str, build: Callable[[], Any]) -> Any:
    """`build()`, with a ConvertError that does not say where (a value ModelConfig refuses) prefixed by `where`."""
    try:
        return build()
    except ConvertError as e:
        raise ConvertError(str(e) if str(e).startswith(where) else f"{where}: {e}") from None
