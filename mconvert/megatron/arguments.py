"""Megatron-LM's arguments <-> the IR config, both ways.

A Megatron checkpoint describes its model only through the training arguments it was saved with (`args`, an
argparse.Namespace in `torch`-format files, in the common state of distributed ones). `config_from_args` reads
them into a `ModelConfig`, refusing settings the IR has no place for; `args_from_config` writes the arguments a
saved checkpoint needs for Megatron-LM to load it (and for mconvert to read it back).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mconvert.errors import ConvertError
from mconvert.io.hf_dir import tokenizer_vocab_size
from mconvert.io.torch_archive import TorchDType
from mconvert.ir import sizes
from mconvert.ir.checks import check_true_vocab_size, with_where
from mconvert.ir.config import ModelConfig
from mconvert.megatron import mla as mla_keys
from mconvert.megatron.core import Impl
from mconvert.options import ExpertLayout
from mconvert.rules.layout import ParallelLayout

GPT2_BPE_VOCAB = 50257  # the GPT2BPETokenizer's vocabulary


def true_vocab_size(args: Any, given: int | None, assets: dict, padded: int, where: str) -> tuple[int, list[str]]:
    """The unpadded vocabulary, from the first that says: --true-vocab-size, args.vocab_size (Megatron),
    args.orig_vocab_size (HF's megatron_gpt2 script), the checkpoint's tokenizer (what Megatron padded from),
    GPT2BPETokenizer's 50257 when args name that tokenizer; else all `padded` rows. Notes say what was guessed."""
    check_true_vocab_size(given, args, tokenizer_vocab_size(assets), where)
    recorded = given or getattr(args, "vocab_size", None) or getattr(args, "orig_vocab_size", None)
    if recorded:
        vocab, notes = int(recorded), []
    elif (from_tokenizer := tokenizer_vocab_size(assets)) is not None:
        vocab, notes = from_tokenizer, [f"vocabulary size {from_tokenizer} taken from the checkpoint's tokenizer"]
    elif getattr(args, "tokenizer_type", None) == "GPT2BPETokenizer" and padded >= GPT2_BPE_VOCAB:
        vocab, notes = GPT2_BPE_VOCAB, [f"the true vocabulary size is not recorded; using {GPT2_BPE_VOCAB}, the size "
                                        "of the GPT2BPETokenizer named by args.tokenizer_type (pass "
                                        "--true-vocab-size to change)"]
    else:
        vocab, notes = padded, [f"the true vocabulary size is not recorded; keeping all {padded} (padded) rows — "
                                "pass --true-vocab-size to strip the padding"]
    if vocab > padded:
        raise ConvertError(f"{where}: vocabulary size {vocab} exceeds the {padded} embedding rows")
    return vocab, notes


# Megatron settings with no place in the IR: (arg, MoE-only, accepted value). Anything else is refused, never
# silently dropped; defaults (and None, "unset") are accepted.
_SETTINGS = (
    ("rotary_interleaved", False, lambda v: not v),
    ("no_rope_freq", False, lambda v: not v),
    ("apply_residual_connection_post_layernorm", False, lambda v: not v),
    ("squared_relu", False, lambda v: not v),
    ("moe_shared_expert_gate", True, lambda v: not v),  # a sigmoid gate on the shared experts' output
)


@dataclass(frozen=True)
class Arg:
    """A Megatron argument that is one ModelConfig field. Read: the first of `name` and `fallbacks` that is set,
    through `kind`, else `default(fields read so far)` (no default: a Megatron GPT checkpoint always has it).
    Written: `write(value)` under `name` and under the other names Megatron-LM has used (`also`)."""

    name: str
    field: str
    kind: Callable[[Any], Any]
    default: Callable[[dict[str, Any]], Any] | None = None
    fallbacks: tuple[str, ...] = ()
    also: tuple[str, ...] = ()
    write: Callable[[Any], Any] = lambda value: value


# The arguments that map one to one, both ways; what is computed from several (family, activation, biases,
# windows, experts, rope scaling) is in `_config_from_args` and `args_from_config` below.
ARGS = (
    Arg("hidden_size", "hidden_size", int),
    Arg("num_attention_heads", "num_attention_heads", int),
    Arg("num_layers", "num_layers", int, also=("encoder_num_layers",)),
    Arg("kv_channels", "head_dim", int, default=lambda f: f["hidden_size"] // f["num_attention_heads"]),
    Arg("max_position_embeddings", "max_position_embeddings", int, default=lambda f: 2048,
        fallbacks=("seq_length",), also=("seq_length", "encoder_seq_length")),
    # `layernorm_epsilon` is megatron-core's config field and the args name since 2024; `norm_epsilon` the older
    # args name, still read by tools/checkpoint's loaders
    Arg("layernorm_epsilon", "norm_eps", float, default=lambda f: 1e-5, fallbacks=("norm_epsilon",),
        also=("norm_epsilon",)),
    Arg("rotary_base", "rope_theta", float, default=lambda f: 10000.0, write=int),
    Arg("rotary_percent", "rotary_percent", float, default=lambda f: 1.0),
)


def _fields_from_args(args: Any, where: str) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for arg in ARGS:
        value = next((v for v in (getattr(args, n, None) for n in (arg.name, *arg.fallbacks)) if v is not None),
                     None)
        if value is None and arg.default is None:
            raise ConvertError(f"{where}: args lack {arg.name!r}; is this a Megatron GPT checkpoint?")
        fields[arg.field] = arg.default(fields) if value is None else _read(arg, value, where)
    return fields


def _read(arg: Arg, value: Any, where: str) -> Any:
    """`value` through the arg's kind; a bool or anything the kind cannot read is refused, naming the arg."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return arg.kind(value)
    except (TypeError, ValueError):
        raise ConvertError(f"{where}: args.{arg.name}={value!r}: expected a number") from None


def _args_from_fields(c: ModelConfig) -> dict[str, Any]:
    return {name: arg.write(getattr(c, arg.field)) for arg in ARGS for name in (arg.name, *arg.also)}


# args a reader loops over (layers, experts, MTP modules): none may exceed the values the files hold
COUNTS = ("num_layers", "num_experts", "mtp_num_layers")


def config_from_args(args: Any, *, vocab_size: int, padded_vocab_size: int, dtype: str, where: str,
                     stored: int) -> ModelConfig:
    """The IR config from a Megatron `args` namespace (names as Megatron stores them); a value ModelConfig refuses
    (NaN epsilon, ...) or sizes beyond the `stored` values of the checkpoint's tensors (mconvert.ir.sizes) are
    reported against `where`."""
    sizes.check_counts(vars(args) if hasattr(args, "__dict__") else {}, COUNTS, stored, where, "args.")
    config = with_where(where, lambda: _config_from_args(args, vocab_size=vocab_size,
                                                         padded_vocab_size=padded_vocab_size, dtype=dtype,
                                                         where=where))
    sizes.check_fits(config, stored, where)
    return config


def _config_from_args(args: Any, *, vocab_size: int, padded_vocab_size: int, dtype: str,
                      where: str) -> ModelConfig:

    def get(name: str, default: Any = None) -> Any:
        value = getattr(args, name, None)
        return default if value is None else value

    moe = bool(get("num_experts"))
    unsupported = [f"{name}={get(name)!r}" for name, applies, ok in _SETTINGS
                   if (moe or not applies) and not ok(get(name))]
    position = get("position_embedding_type", "learned_absolute")
    softmax = get("softmax_type", "vanilla")
    if softmax not in ("vanilla", "learnable"):
        unsupported.append(f"softmax_type={softmax!r}")
    if position not in ("rope", "learned_absolute", "yarn"):
        unsupported.append(f"position_embedding_type={position!r}")
    if unsupported:
        raise ConvertError(f"{where}: Megatron settings that change what the model computes and that mconvert "
                           f"cannot carry (yet): {', '.join(unsupported)}; refusing rather than converting to a "
                           "different model")
    plain = _fields_from_args(args, where)
    hidden, heads, layers = plain["hidden_size"], plain["num_attention_heads"], plain["num_layers"]
    rope = position in ("rope", "yarn")
    experts = get("num_experts")
    window = get("window_size")
    sliding_window = int(window[0]) + 1 if window and int(window[0]) >= 0 else None  # see args_from_config
    ffn = get("ffn_hidden_size") or 4 * hidden
    dense = _dense_layers(get("moe_layer_freq", 1), layers, where) if experts else ()
    qkv_bias_only = bool(get("add_qkv_bias", False)) and not get("add_bias_linear", True)
    mla = bool(get("multi_latent_attention"))
    fields = dict(
        family="gpt_oss" if softmax == "learnable" else _family(
            moe=bool(experts), mla=mla, sigmoid=get("moe_router_score_function") == "sigmoid",
            qk_norm=bool(get("qk_layernorm")), qkv_bias_only=qkv_bias_only, window=bool(sliding_window), rope=rope,
            glm=_glm(get, plain["rotary_percent"])),
        ffn_hidden_size=int(ffn),
        moe_ffn_hidden_size=int(get("moe_ffn_hidden_size", ffn)) if experts else None,
        dense_layers=dense,
        # Megatron's default takes the top-k of the logits, then softmax over them (the weights sum to 1);
        # pre-softmax routing keeps the softmax over all experts
        moe_norm_topk=not get("moe_router_pre_softmax", False),
        num_query_groups=int(get("num_query_groups", heads)) if get("group_query_attention") else heads,
        vocab_size=vocab_size,
        padded_vocab_size=padded_vocab_size,
        norm="rmsnorm" if get("normalization", "LayerNorm") == "RMSNorm" else "layernorm",
        # Megatron's fused bias-GELU (bias_gelu_fusion, on by default with biases) computes the tanh approximation
        activation="quick_geglu" if get("quick_geglu") else "swiglu" if get("swiglu") else "gelu_tanh" if get(
            "openai_gelu") or (
            get("bias_gelu_fusion") and get("add_bias_linear", True)) else "gelu",
        position_embedding="rope" if rope else "learned",
        rope_scaling=_yarn_from_args(get) if position == "yarn" else LLAMA3_SCALING | {
            "factor": float(get("rope_scaling_factor", 8.0))} if get("use_rope_scaling") else _linear_scaling(
            get("rotary_seq_len_interpolation_factor")),
        qkv_bias=bool(get("add_bias_linear", True) or get("add_qkv_bias", False)),
        proj_bias=bool(get("add_bias_linear", True)),
        mlp_bias=bool(get("add_bias_linear", True)),
        # GPT-OSS: the learnable softmax offset is the attention sink; the router takes add_bias_linear too
        attention_sinks=softmax == "learnable",
        moe_router_bias=bool(experts) and bool(get("add_bias_linear", True)),
        glu_linear_offset=float(get("glu_linear_offset", 0.0)),
        activation_clamp=None if get("activation_func_clamp_value") is None
        else float(get("activation_func_clamp_value")),
        tie_embeddings=not get("untie_embeddings_and_output_weights", False),
        sliding_window=sliding_window,
        full_attention_layers=_full_attention_layers(get("window_attn_skip_freq"), layers, where),
        # with multi-latent attention qk_layernorm names the norms of its latents (see core_deepseek)
        qk_norm=bool(get("qk_layernorm")) and not mla,
        num_experts=int(experts) if experts else None,
        moe_top_k=int(get("moe_router_topk", 2)) if experts else None,
        moe_aux_loss_coeff=_first(get("moe_aux_loss_coeff")) if experts else None,
        moe_jitter_eps=float(get("moe_input_jitter_eps")) if experts and get("moe_input_jitter_eps") else None,
        dtype=dtype,
        **token_ids_from_args(args),
    )
    deepseek = mla_keys.config_fields(get, heads=heads, top_k=fields["moe_top_k"], where=where)
    extras = _extras_from_args(args, where)
    if extras.get("sandwich_norms"):
        fields["family"] = "gemma3_text"
    if fields["activation"] == "gelu_tanh" and get("gated_linear_unit"):
        fields["activation"] = "geglu_tanh"
    fields["norm_zero_centered"] = bool(get("apply_layernorm_1p") or get("layernorm_zero_centered_gamma"))
    if get("softmax_scale") is not None and "query_pre_attn_scalar" not in extras:
        extras["query_pre_attn_scalar"] = float(get("softmax_scale")) ** -2
    return ModelConfig(**(plain | fields | deepseek | extras))


# What megatron-core's GPT model cannot compute (Gemma 3's sandwich norms, embedding multiplier, rope theta of
# the windowed layers, soft-capping) and the exact query_pre_attn_scalar (softmax_scale is its -1/2 power) are kept
# in one extra attribute, so a round trip through Megatron keeps them; megatron-core ignores it (see docs/formats.md).
EXTRAS_ARG = "mconvert_model_extras"
EXTRA_FIELDS = ("sandwich_norms", "embedding_multiplier", "local_rope_theta", "query_pre_attn_scalar",
                "attn_logit_softcap", "final_logit_softcap")


def _extras_from_args(args: Any, where: str) -> dict[str, Any]:
    stored = getattr(args, EXTRAS_ARG, None)
    if stored is None:
        return {}
    if not isinstance(stored, dict) or not set(stored) <= set(EXTRA_FIELDS):
        raise ConvertError(f"{where}: args.{EXTRAS_ARG} must map some of {', '.join(EXTRA_FIELDS)} to values, got "
                           f"{stored!r}")
    return dict(stored)


def _extras_to_args(c: ModelConfig) -> dict[str, Any]:
    default = ModelConfig.__dataclass_fields__
    return {name: getattr(c, name) for name in EXTRA_FIELDS if getattr(c, name) != default[name].default}


# Megatron's args have no special token ids; mconvert keeps the IR's in one extra attribute so that a round trip
# through Megatron keeps them (Megatron ignores attributes it does not know).
TOKEN_IDS_ARG = "mconvert_token_ids"
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def token_ids_from_args(args: Any) -> dict[str, Any]:
    stored = getattr(args, TOKEN_IDS_ARG, None)
    if not isinstance(stored, dict):
        return {}
    return {k: stored[k] for k in TOKEN_ID_FIELDS if stored.get(k) is not None}


# Megatron hard-codes these for --use-rope-scaling (Llama 3.1); only the factor is an argument.
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def _glm(get: Callable[..., Any], rotary_percent: float) -> bool:
    """Standard attention with experts routed and shared as DeepSeek's, MTP modules or partial rotary: GLM-4.5's
    recipes (`--rotary-percent 0.5`, sigmoid routing with the expert bias, shared experts), which no other HF
    family with standard attention holds."""
    return bool(get("num_experts")) and not get("multi_latent_attention") and (
        get("moe_router_score_function") == "sigmoid" or bool(get("moe_router_enable_expert_bias"))
        or bool(get("moe_shared_expert_intermediate_size")) or bool(get("mtp_num_layers")) or rotary_percent != 1)


def _family(*, moe: bool, mla: bool, sigmoid: bool, qk_norm: bool, qkv_bias_only: bool, window: bool,
            rope: bool, glm: bool) -> str:
    """The IR family Megatron args describe (which HF format `--saver hf` writes): Megatron's DeepSeek recipes use
    `--multi-latent-attention` (V3 routes with sigmoid scores, V2 with softmax), GLM-4.5's standard attention with
    DeepSeek's routing (see `_glm`), its Qwen recipes `--qk-layernorm` (Qwen3, Qwen3-MoE) or `--add-qkv-bias
    --disable-bias-linear` (Qwen2 / 2.5)."""
    if mla:
        return "deepseek_v3" if sigmoid else "deepseek_v2"
    if glm:
        return "glm4_moe"
    if qk_norm:
        return "qwen3_moe" if moe else "qwen3"
    if moe:
        return "mixtral"
    if qkv_bias_only:
        return "qwen2"
    return "mistral" if window else "llama" if rope else "gpt2"


def _linear_scaling(factor: Any) -> dict[str, Any] | None:
    """HF's linear rope scaling (positions divided by `factor`) is megatron-core's seq_len_interpolation_factor."""
    return None if factor in (None, 1, 1.0) else {"rope_type": "linear", "factor": float(factor)}
# GPT models' YaRN (position_embedding_type "yarn"): IR field -> Megatron-LM's argument and the config field
# megatron-core's GPTModel reads (megatron/training/argument_utils.py `_apply_yarn_config_from_args` maps the one onto
# the other); both are written, the argument read first.
YARN_ARGS = (("factor", "rotary_scaling_factor", "yarn_rotary_scaling_factor"),
             ("original_max_position_embeddings", "yarn_original_max_position_embeddings",
              "yarn_original_max_position_embeddings"),
             ("beta_fast", "yarn_beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow", "yarn_beta_slow"),
             ("mscale", "mscale", "yarn_mscale"), ("mscale_all_dim", "mscale_all_dim", "yarn_mscale_all_dim"))
# transformers' YaRN defaults, left out when read (Megatron spells every value out)
_YARN_UNSAID = {"mscale": 1.0, "mscale_all_dim": 0.0, "truncate": True}


def _yarn_from_args(get: Callable[..., Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"rope_type": "yarn"}
    for field, arg, config_field in YARN_ARGS:
        value = get(arg) if get(arg) is not None else get(config_field)
        if value is not None:
            out[field] = value
    if get("yarn_correction_range_round_to_int") is not None:
        out["truncate"] = bool(get("yarn_correction_range_round_to_int"))
    return {k: v for k, v in out.items() if k not in _YARN_UNSAID or v != _YARN_UNSAID[k]}


def _yarn_args(c: ModelConfig) -> dict[str, Any]:
    """Megatron's YaRN arguments and config fields of a GPT model (every one named, so nothing falls to a
    default)."""
    s = c.rope_scaling
    extra = sorted(set(s) - {"rope_type", "truncate", *(f for f, _, _ in YARN_ARGS)})
    if extra:
        raise ConvertError(f"Megatron's YaRN has no place for rope_scaling {', '.join(extra)} of {s}")
    defaults = {"mscale": 1.0, "mscale_all_dim": 0.0, "beta_fast": 32.0, "beta_slow": 1.0}
    values = {field: s.get(field) if s.get(field) is not None else defaults.get(field) for field, _, _ in YARN_ARGS}
    return {name: values[field] for field, arg, config_field in YARN_ARGS for name in (arg, config_field)} | {
        "yarn_correction_range_round_to_int": bool(s.get("truncate", True))}


def _full_attention_layers(freq: Any, num_layers: int, where: str) -> tuple[int, ...]:
    """The layers without the window, from window_attn_skip_freq: every N-th layer (counting from 1) for an int N,
    or the zeros of a 0/1 pattern with one entry per layer (1 = sliding window); None: every layer slides."""
    if freq is None:
        return ()
    if isinstance(freq, int) and not isinstance(freq, bool) and freq >= 1:
        return tuple(i for i in range(num_layers) if (i + 1) % freq == 0)
    if isinstance(freq, (list, tuple)) and len(freq) == num_layers and all(f in (0, 1) for f in freq):
        return tuple(i for i, f in enumerate(freq) if not f)
    raise ConvertError(f"{where}: window_attn_skip_freq={freq!r} is neither a positive integer nor a 0/1 pattern "
                       f"with one entry per layer ({num_layers})")


def _dense_layers(freq: Any, num_layers: int, where: str) -> tuple[int, ...]:
    """The layers without experts, from moe_layer_freq: every k-th layer (from layer 0) has experts for an int k,
    or a 0/1 pattern with one entry per layer (what `--moe-layer-freq "([0]*3+[1]*58)"` parses into)."""
    if isinstance(freq, int) and not isinstance(freq, bool) and freq >= 1:
        return tuple(i for i in range(num_layers) if i % freq)
    if isinstance(freq, (list, tuple)) and len(freq) == num_layers and all(f in (0, 1) for f in freq):
        return tuple(i for i, f in enumerate(freq) if not f)
    raise ConvertError(f"{where}: moe_layer_freq={freq!r} is neither a positive integer nor a 0/1 pattern with one "
                       f"entry per layer ({num_layers})")


def _first(value: Any) -> float | None:
    if isinstance(value, (list, tuple)):
        return float(value[0]) if value else None
    return None if value is None else float(value)


def args_from_config(c: ModelConfig, layout: ParallelLayout, *, padded_vocab_size: int, divisible_by: int,
                     impl: Impl, ckpt_format: str = "torch", expert_layout: ExpertLayout = "sequential",
                     tokenizer_model: str | None = None) -> argparse.Namespace:
    """A Megatron `args` namespace describing the model, so Megatron-LM can resume or finetune from it.

    Only plain values and torch dtypes: Megatron's own loader refuses anything else under weights_only. The
    dtype is named by a `TorchDType` (no torch needed): mconvert's writers pickle it as the torch dtype
    (`mconvert.io.torch_zip`, `dcp_writer.object_bytes`).
    With --use-checkpoint-args Megatron-LM takes tokenizer_type and tokenizer_model from here: `tokenizer_model`
    is the tokenizer directory the checkpoint carries (a HuggingFaceTokenizer); without one, tokenizer_type is
    left unset (None) so that the run's own --tokenizer-type applies, except GPT-2's GPT2BPETokenizer, Megatron's
    own tokenizer for that family (it then needs --vocab-file/--merge-file). The one-to-one arguments come from
    `ARGS` (the norm epsilon under both names Megatron-LM has used).
    """
    linear = c.rope_scaling is not None and c.rope_scaling.get("rope_type") == "linear" and not c.is_mla
    yarn = bool(c.rope_scaling) and c.rope_scaling.get("rope_type") == "yarn" and not c.is_mla
    if linear and set(c.rope_scaling) != {"rope_type", "factor"}:
        raise ConvertError(f"Megatron's linear rope scaling (rotary_seq_len_interpolation_factor) has a factor only; "
                           f"this model has {c.rope_scaling}")
    if c.rope_scaling and c.rope_scaling.get("rope_type") != "llama3" and not c.is_mla and not linear and not yarn:
        raise ConvertError(f"Megatron supports only Llama 3, linear and YaRN rope scaling; this model has "
                           f"{c.rope_scaling}")
    if c.rope_scaling and not c.is_mla and not linear and not yarn and {k: v for k, v in c.rope_scaling.items()
                                                                        if k != "factor"} != \
            {k: v for k, v in LLAMA3_SCALING.items() if k != "factor"}:
        raise ConvertError(f"Megatron hard-codes the Llama 3 rope scaling parameters {LLAMA3_SCALING} except the "
                           f"factor; this model has {c.rope_scaling}")
    if c.proj_bias != c.mlp_bias or (c.proj_bias and not c.qkv_bias):
        raise ConvertError("Megatron's add_bias_linear puts a bias on every linear (add_qkv_bias on q/k/v alone); "
                           f"this model has qkv_bias={c.qkv_bias}, proj_bias={c.proj_bias}, mlp_bias={c.mlp_bias}")
    if c.is_moe and c.moe_router_bias != c.mlp_bias:
        raise ConvertError("Megatron's add_bias_linear puts a bias on the router too; this model has "
                           f"moe_router_bias={c.moe_router_bias}, mlp_bias={c.mlp_bias}")
    if c.attention_sinks and c.is_mla:
        raise ConvertError("Megatron's learnable softmax offset (attention sinks) with multi-latent attention")
    if c.rope_theta != int(c.rope_theta):
        raise ConvertError(f"Megatron's rotary_base is an integer; this model's rope_theta is {c.rope_theta}")
    rope = c.position_embedding == "rope"
    vpp = layout.vpp if layout.vpp > 1 else None
    values = dict(
        **_args_from_fields(c), ffn_hidden_size=c.ffn_hidden_size,
        group_query_attention=c.num_query_groups != c.num_attention_heads, num_query_groups=c.num_query_groups,
        # Megatron's defaults for the next two whatever the position embedding (resuming compares them)
        position_embedding_type=("yarn" if yarn else "rope") if rope else "learned_absolute",
        add_position_embedding=True,
        use_rotary_position_embeddings=False,
        rotary_interleaved=False, use_rope_scaling=bool(c.rope_scaling) and not linear and not yarn,
        rope_scaling_factor=float(c.rope_scaling["factor"]) if c.rope_scaling and not linear else 8.0,
        rotary_seq_len_interpolation_factor=float(c.rope_scaling["factor"]) if linear else None,
        normalization="RMSNorm" if c.norm == "rmsnorm" else "LayerNorm",
        apply_layernorm_1p=c.norm_zero_centered, layernorm_zero_centered_gamma=c.norm_zero_centered,
        qk_layernorm=c.qk_norm, swiglu=c.activation == "swiglu", quick_geglu=c.activation == "quick_geglu",
        glu_linear_offset=c.glu_linear_offset, activation_func_clamp_value=c.activation_clamp,
        softmax_type="learnable" if c.attention_sinks else "vanilla",
        openai_gelu=c.activation in ("gelu_tanh", "geglu_tanh"), squared_relu=False, bias_gelu_fusion=False,
        add_bias_linear=c.proj_bias, add_qkv_bias=c.qkv_bias,
        untie_embeddings_and_output_weights=not c.tie_embeddings,
        # Megatron's window (left, right) lets a query see `left` earlier keys and itself; the IR's (and HF's)
        # sliding_window counts the query too
        window_size=(c.sliding_window - 1, 0) if c.sliding_window else None,
        # per layer (from 1): 1 slides, 0 attends to everything (no effect without window_size, but kept: it is
        # the Qwen config's max_window_layers)
        window_attn_skip_freq=[0 if i in c.full_attention_layers else 1 for i in range(c.num_layers)]
        if c.full_attention_layers else None,
        num_experts=c.num_experts, moe_router_topk=c.moe_top_k or 2,
        moe_ffn_hidden_size=c.expert_ffn_hidden_size if c.is_moe else None,
        moe_layer_freq=[0 if i in c.dense_layers else 1 for i in range(c.num_layers)] if c.dense_layers else 1,
        moe_router_pre_softmax=c.is_moe and not c.moe_norm_topk,
        # Megatron applies jitter whenever the value is not None, and Uniform(1, 1) fails: no jitter is None
        moe_aux_loss_coeff=c.moe_aux_loss_coeff or 0.0, moe_input_jitter_eps=c.moe_jitter_eps or None,
        moe_grouped_gemm=c.is_moe and expert_layout != "sequential",
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        transformer_pipeline_model_parallel_size=layout.pp, virtual_pipeline_model_parallel_size=vpp,
        num_virtual_stages_per_pipeline_rank=vpp, num_layers_per_virtual_pipeline_stage=None,
        decoder_first_pipeline_num_layers=layout.first_stage_layers,
        decoder_last_pipeline_num_layers=layout.last_stage_layers,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.expert_tp,
        world_size=layout.tp * layout.pp * layout.ep, data_parallel_size=1,
        vocab_size=c.vocab_size, padded_vocab_size=padded_vocab_size, make_vocab_size_divisible_by=divisible_by,
        tokenizer_model=tokenizer_model,
        tokenizer_type="HuggingFaceTokenizer" if tokenizer_model else "GPT2BPETokenizer" if c.family == "gpt2"
        else None,
        bf16=c.dtype == "bfloat16", fp16=c.dtype == "float16", params_dtype=TorchDType(c.dtype),
        ckpt_format=ckpt_format, transformer_impl="transformer_engine" if impl == "te" else "local",
        use_legacy_models=False, bert_binary_head=c.binary_head or not c.is_bert,
        no_load_optim=True, no_load_rng=True, no_save_optim=True, no_save_rng=True,
        consumed_train_samples=0, skipped_train_samples=0, consumed_valid_samples=0,
    )
    values[TOKEN_IDS_ARG] = {k: getattr(c, k) for k in TOKEN_ID_FIELDS}
    if extras := _extras_to_args(c):
        values[EXTRAS_ARG] = extras
    # TransformerConfig fields that Megatron-LM 0.19 takes from no command-line argument (its argparse skips them;
    # --swiglu is the SiLU gate only): recorded for what they mean to megatron-core
    if c.attention_scale is not None:
        values["softmax_scale"] = c.attention_scale
    if c.activation == "geglu_tanh":
        values["gated_linear_unit"] = True
    values |= mla_keys.args_fields(c)
    if yarn:
        values |= _yarn_args(c)
    if c.is_moe and expert_layout == "legacy_grouped":
        # Megatron-LM before March 2026 (the GroupedMLP's last version) picks it under TE only with this flag
        values["moe_use_legacy_grouped_gemm"] = True
    if c.is_moe and expert_layout == "single_grouped":  # megatron-core requires the TE op fuser for it
        values |= {"moe_single_grouped_weight": True, "use_transformer_engine_op_fuser": True}
    return argparse.Namespace(**values)


def bert_config(gpt: ModelConfig, *, num_tokentypes: int, binary_head: bool, where: str,
                mlm_head_activation: str = "gelu") -> ModelConfig:
    """The config of a Megatron BERT from its args (read as for a GPT model, `gpt`) and what only its tensors say:
    the rows of its token-type embedding (Megatron-LM's pretrain_bert makes 2 with the binary head, 0 without; no
    argument records it) and whether it has the binary head and pooler. megatron-core's MLM head (BertLMHead)
    computes exact gelu whatever the MLP's activation; the legacy one the tanh approximation with openai_gelu."""
    return with_where(where, lambda: gpt.replace(
        family="megatron_bert", num_tokentypes=num_tokentypes, pooler=binary_head, binary_head=binary_head,
        lm_head_bias=True, mlm_head_activation=mlm_head_activation))


def bert_gelu_args(c: ModelConfig) -> dict[str, bool]:
    """The legacy BERT's openai_gelu / bias_gelu_fusion for its MLP and MLM-head activations: openai_gelu turns
    both to gelu's tanh approximation, the fused bias-GELU only the MLP's."""
    acts = c.activation, c.mlm_head_activation
    if acts == ("gelu", "gelu_tanh"):
        raise ConvertError("Megatron's legacy BERT cannot approximate gelu in its MLM head (mlm_head_activation "
                           "gelu_tanh) and not in its MLP (activation gelu)")
    return {"openai_gelu": acts == ("gelu_tanh", "gelu_tanh"), "bias_gelu_fusion": acts == ("gelu_tanh", "gelu")}
