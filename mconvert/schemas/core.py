"""Megatron-core GPT checkpoints (`torch` format): key table, directory layout, and the args <-> config mapping.

Keys are flat and local to each file: `decoder.layers.{l}` counts from 0 in every pipeline chunk. The local
spec names norms as modules (`input_layernorm.weight`); the Transformer Engine spec fuses them into the next
linear (`self_attention.linear_qkv.layer_norm_weight`, `mlp.linear_fc1.layer_norm_weight`). Linears carry an
`_extra_state` entry (None for the local spec). MoE layers (router and experts) are in `core_moe`.

    latest_checkpointed_iteration.txt      the iteration number, or "release"
    iter_0000001/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt
        {"args", "checkpoint_version": 3.0, "iteration", "model" (or "model0".."model{V-1}"), ...}

`mp_rank_00_001` is PP stage 1 when PP>1 and EP=1, but EP rank 1 when PP=1 and EP>1: only the stored args
(pipeline/expert_model_parallel_size) tell them apart. Every EP rank's file repeats the dense weights.
"""

from __future__ import annotations

import argparse
import re
from typing import Any, Literal

import torch

from mconvert.errors import ConvertError
from mconvert.formats.hf_dir import tokenizer_vocab_size
from mconvert.ir import ModelConfig
from mconvert.layout import ParallelLayout
from mconvert.options import ExpertLayout
from mconvert.rules import COLUMN, GATE_UP, GATED_COLUMN, IDENTITY, QKV, REPLICATE, ROW, VOCAB, Rule, Table
from mconvert.schemas import core_moe

Impl = Literal["local", "te"]
TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_FILE = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0
RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")


def iteration_dir(iteration: int | Literal["release"]) -> str:
    return "release" if iteration == "release" else f"iter_{iteration:07d}"


def rank_dir(tp: int, pp: int, ep: int, layout: ParallelLayout) -> str:
    """`mp_rank_{tp:02d}`, plus `_{pp:03d}` when pipelined, plus `_{ep:03d}` with expert parallelism."""
    name = f"mp_rank_{tp:02d}"
    if layout.pp > 1:
        name += f"_{pp:03d}"
    if layout.ep > 1:
        name += f"_{ep:03d}"
    return name


def _norm(module_local: str, module_te: str, impl: Impl, ir: str) -> list[Rule]:
    """A norm's weight and bias: a module of its own (local) or fused into the next linear (TE)."""
    if impl == "local":
        return [Rule(f"{module_local}.{kind}", (f"{ir}.{kind}",)) for kind in ("weight", "bias")]
    return [Rule(f"{module_te}.layer_norm_{kind}", (f"{ir}.{kind}",)) for kind in ("weight", "bias")]


def _linear(module: str, ir: str, join, shard, bias_shard) -> list[Rule]:
    """A linear's weight and bias; `ir` may name several IR tensors joined into one (`a+b` templates)."""
    names = tuple(ir.split("+"))
    join = join or IDENTITY
    return [
        Rule(f"{module}.weight", tuple(f"{n}.weight" for n in names), join, shard),
        Rule(f"{module}.bias", tuple(f"{n}.bias" for n in names), join, bias_shard),
    ]


def table(impl: Impl, *, moe: bool = False, expert_layout: ExpertLayout = "sequential", local_experts: int = 1,
          etp: int = 1) -> Table:
    """The core key table for one transformer implementation (`local` or `te`).

    MoE models add the router and the experts in `expert_layout` (see mconvert.schemas.core_moe), with
    `local_experts` experts per expert-parallel rank split over `etp` expert tensor-parallel ranks.
    """
    experts, expert_stack = core_moe.expert_rules(expert_layout, local_experts=local_experts, etp=etp)
    layer = "decoder.layers.{l}"
    attn, mlp = f"{layer}.self_attention", f"{layer}.mlp"
    fused_mlp_norm = impl == "te" and not moe  # MoE layers keep a separate pre_mlp_layernorm under TE
    return Table(
        embedding=(
            Rule("embedding.word_embeddings.weight", ("embed.weight",), VOCAB, COLUMN),
            Rule("embedding.position_embeddings.weight", ("pos_embed.weight",)),
        ),
        layer=(
            *_norm(f"{layer}.input_layernorm", f"{attn}.linear_qkv", impl, "layers.{L}.attn_norm"),
            *_linear(f"{attn}.linear_proj", "layers.{L}.attn.o", None, ROW, REPLICATE),
            *_linear(f"{attn}.linear_qkv", "layers.{L}.attn.q+layers.{L}.attn.k+layers.{L}.attn.v", QKV, COLUMN,
                     COLUMN),
            *_norm(f"{layer}.pre_mlp_layernorm", f"{mlp}.linear_fc1", "te" if fused_mlp_norm else "local",
                   "layers.{L}.mlp_norm"),
            *_linear(f"{mlp}.linear_fc1", "layers.{L}.mlp.gate+layers.{L}.mlp.up", GATE_UP, GATED_COLUMN,
                     GATED_COLUMN),
            *_linear(f"{mlp}.linear_fc1", "layers.{L}.mlp.up", None, COLUMN, COLUMN),
            *_linear(f"{mlp}.linear_fc2", "layers.{L}.mlp.down", None, ROW, REPLICATE),
            core_moe.ROUTER,
        ),
        expert=experts,
        expert_stack=expert_stack,
        head=(
            Rule("decoder.final_layernorm.weight", ("final_norm.weight",)),
            Rule("decoder.final_layernorm.bias", ("final_norm.bias",)),
            Rule("output_layer.weight", ("lm_head.weight",), VOCAB, COLUMN),
        ),
    )


# With tied embeddings and several pipeline stages the last stage keeps its own copy of the (padded) word
# embeddings as output_layer.weight, kept in sync by Megatron during training.
TIED_OUTPUT = Rule("output_layer.weight", ("embed.weight",), VOCAB, COLUMN)


def extra_state_modules(impl: Impl, *, expert_layout: ExpertLayout | None = None,
                        local_experts: int = 0) -> tuple[str, ...]:
    """Modules (templates) that store an `_extra_state` entry in every layer (MoE layers: give the layout)."""
    modules = ("self_attention.linear_proj", "self_attention.linear_qkv")
    if expert_layout is None:
        modules += ("mlp.linear_fc1", "mlp.linear_fc2")
    if impl == "te":
        modules = ("self_attention.core_attention", *modules)
    moe = core_moe.extra_state_modules(expert_layout, impl, local_experts) if expert_layout else ()
    return tuple(f"decoder.layers.{{l}}.{m}" for m in modules) + moe


GPT2_BPE_VOCAB = 50257  # the GPT2BPETokenizer's vocabulary


def true_vocab_size(args: Any, given: int | None, assets: dict, padded: int, where: str) -> tuple[int, list[str]]:
    """The unpadded vocabulary, from the first that says: --true-vocab-size, args.vocab_size (Megatron),
    args.orig_vocab_size (HF's megatron_gpt2 script), the checkpoint's tokenizer (what Megatron padded from),
    GPT2BPETokenizer's 50257 when args name that tokenizer; else all `padded` rows. Notes say what was guessed."""
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
    ("rotary_percent", False, lambda v: v is None or float(v) == 1.0),
    ("rotary_seq_len_interpolation_factor", False, lambda v: v in (None, 1, 1.0)),
    ("no_rope_freq", False, lambda v: not v),
    ("qk_layernorm", False, lambda v: not v),
    ("layernorm_zero_centered_gamma", False, lambda v: not v),
    ("apply_layernorm_1p", False, lambda v: not v),
    ("apply_residual_connection_post_layernorm", False, lambda v: not v),
    ("squared_relu", False, lambda v: not v),
    ("window_attn_skip_freq", False, lambda v: v in (None, 1)),
    ("moe_shared_expert_intermediate_size", True, lambda v: not v),
    ("moe_layer_freq", True, lambda v: v is None or _every_layer(v)),
    ("moe_router_enable_expert_bias", True, lambda v: not v),
    ("moe_router_pre_softmax", True, lambda v: not v),
    ("moe_router_score_function", True, lambda v: v in (None, "softmax")),
    ("moe_router_topk_scaling_factor", True, lambda v: v in (None, 1, 1.0)),
    ("moe_router_num_groups", True, lambda v: not v),
    ("moe_router_group_topk", True, lambda v: not v),
)


def config_from_args(args: Any, *, vocab_size: int, padded_vocab_size: int, dtype: str,
                     where: str) -> ModelConfig:
    """The IR config from a Megatron `args` namespace (names as Megatron stores them)."""

    def get(name: str, default: Any = None) -> Any:
        value = getattr(args, name, None)
        return default if value is None else value

    moe = bool(get("num_experts"))
    unsupported = [f"{name}={get(name)!r}" for name, applies, ok in _SETTINGS
                   if (moe or not applies) and not ok(get(name))]
    position = get("position_embedding_type", "learned_absolute")
    if position not in ("rope", "learned_absolute"):
        unsupported.append(f"position_embedding_type={position!r}")
    if unsupported:
        raise ConvertError(f"{where}: Megatron settings that change what the model computes and that mconvert "
                           f"cannot carry (yet): {', '.join(unsupported)}; refusing rather than converting to a "
                           "different model")
    try:
        hidden, heads, layers = int(args.hidden_size), int(args.num_attention_heads), int(args.num_layers)
    except AttributeError as e:
        raise ConvertError(f"{where}: args lack {e.name!r}; is this a Megatron GPT checkpoint?") from None
    rope = position == "rope"
    experts = get("num_experts")
    window = get("window_size")
    ffn = get("moe_ffn_hidden_size") if experts else None
    ffn = ffn or get("ffn_hidden_size") or 4 * hidden
    family = "mixtral" if experts else "mistral" if window else "llama" if rope else "gpt2"
    return ModelConfig(
        family=family,
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=int(ffn),
        num_attention_heads=heads,
        num_query_groups=int(get("num_query_groups", heads)) if get("group_query_attention") else heads,
        head_dim=int(get("kv_channels", hidden // heads)),
        vocab_size=vocab_size,
        padded_vocab_size=padded_vocab_size,
        max_position_embeddings=int(get("max_position_embeddings", get("seq_length", 2048))),
        norm="rmsnorm" if get("normalization", "LayerNorm") == "RMSNorm" else "layernorm",
        norm_eps=float(get("layernorm_epsilon", get("norm_epsilon", 1e-5))),
        # Megatron's fused bias-GELU (bias_gelu_fusion, on by default with biases) computes the tanh approximation
        activation="swiglu" if get("swiglu") else "gelu_tanh" if get("openai_gelu") or (
            get("bias_gelu_fusion") and get("add_bias_linear", True)) else "gelu",
        position_embedding="rope" if rope else "learned",
        rope_theta=float(get("rotary_base", 10000)),
        rope_scaling=LLAMA3_SCALING | {"factor": float(get("rope_scaling_factor", 8.0))}
        if get("use_rope_scaling") else None,
        qkv_bias=bool(get("add_bias_linear", True) or get("add_qkv_bias", False)),
        proj_bias=bool(get("add_bias_linear", True)),
        mlp_bias=bool(get("add_bias_linear", True)),
        tie_embeddings=not get("untie_embeddings_and_output_weights", False),
        sliding_window=int(window[0]) + 1 if window and int(window[0]) >= 0 else None,  # see args_from_config
        num_experts=int(experts) if experts else None,
        moe_top_k=int(get("moe_router_topk", 2)) if experts else None,
        moe_aux_loss_coeff=_first(get("moe_aux_loss_coeff")) if experts else None,
        moe_jitter_eps=float(get("moe_input_jitter_eps")) if experts and get("moe_input_jitter_eps") else None,
        dtype=dtype,
    )


# Megatron hard-codes these for --use-rope-scaling (Llama 3.1); only the factor is an argument.
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def _every_layer(freq: Any) -> bool:
    """moe_layer_freq: 1 (or a pattern of ones) puts experts in every layer, which is all the IR describes."""
    return freq == 1 or (isinstance(freq, (list, tuple)) and all(f == 1 for f in freq))


def _first(value: Any) -> float | None:
    if isinstance(value, (list, tuple)):
        return float(value[0]) if value else None
    return None if value is None else float(value)


def args_from_config(c: ModelConfig, layout: ParallelLayout, *, padded_vocab_size: int, divisible_by: int,
                     impl: Impl, ckpt_format: str = "torch", expert_layout: ExpertLayout = "sequential",
                     tokenizer_model: str | None = None) -> argparse.Namespace:
    """A Megatron `args` namespace describing the model, so Megatron-LM can resume or finetune from it.

    Only plain values and torch dtypes: Megatron's own loader refuses anything else under weights_only.
    With --use-checkpoint-args Megatron-LM takes tokenizer_type and tokenizer_model from here: `tokenizer_model`
    is the tokenizer directory the checkpoint carries (a HuggingFaceTokenizer); without one, tokenizer_type is
    left unset (None) so that the run's own --tokenizer-type applies, except GPT-2's GPT2BPETokenizer, Megatron's
    own tokenizer for that family (it then needs --vocab-file/--merge-file). The norm epsilon goes under both
    names Megatron-LM has used: `layernorm_epsilon` (megatron-core's config field, the args name since 2024) and
    `norm_epsilon` (the older args name, still read by tools/checkpoint's loaders).
    """
    if c.rope_scaling and c.rope_scaling.get("rope_type") != "llama3":
        raise ConvertError(f"Megatron supports only Llama 3 rope scaling; this model has {c.rope_scaling}")
    if c.rope_scaling and {k: v for k, v in c.rope_scaling.items() if k != "factor"} != \
            {k: v for k, v in LLAMA3_SCALING.items() if k != "factor"}:
        raise ConvertError(f"Megatron hard-codes the Llama 3 rope scaling parameters {LLAMA3_SCALING} except the "
                           f"factor; this model has {c.rope_scaling}")
    if c.proj_bias != c.mlp_bias or (c.proj_bias and not c.qkv_bias):
        raise ConvertError("Megatron's add_bias_linear puts a bias on every linear (add_qkv_bias on q/k/v alone); "
                           f"this model has qkv_bias={c.qkv_bias}, proj_bias={c.proj_bias}, mlp_bias={c.mlp_bias}")
    rope = c.position_embedding == "rope"
    vpp = layout.vpp if layout.vpp > 1 else None
    dtype = c.torch_dtype
    values = dict(
        num_layers=c.num_layers, encoder_num_layers=c.num_layers, hidden_size=c.hidden_size,
        ffn_hidden_size=c.ffn_hidden_size, num_attention_heads=c.num_attention_heads,
        group_query_attention=c.num_query_groups != c.num_attention_heads, num_query_groups=c.num_query_groups,
        kv_channels=c.head_dim, seq_length=c.max_position_embeddings, encoder_seq_length=c.max_position_embeddings,
        max_position_embeddings=c.max_position_embeddings,
        # Megatron's defaults for the next two whatever the position embedding (resuming compares them)
        position_embedding_type="rope" if rope else "learned_absolute", add_position_embedding=True,
        use_rotary_position_embeddings=False, rotary_base=int(c.rope_theta), rotary_percent=1.0,
        rotary_interleaved=False, use_rope_scaling=bool(c.rope_scaling),
        rope_scaling_factor=float(c.rope_scaling["factor"]) if c.rope_scaling else 8.0,
        normalization="RMSNorm" if c.norm == "rmsnorm" else "LayerNorm", layernorm_epsilon=c.norm_eps,
        norm_epsilon=c.norm_eps,
        apply_layernorm_1p=False, layernorm_zero_centered_gamma=False, qk_layernorm=False,
        swiglu=c.gated, openai_gelu=c.activation == "gelu_tanh", squared_relu=False, bias_gelu_fusion=False,
        add_bias_linear=c.proj_bias, add_qkv_bias=c.qkv_bias,
        untie_embeddings_and_output_weights=not c.tie_embeddings,
        # Megatron's window (left, right) lets a query see `left` earlier keys and itself; the IR's (and HF's)
        # sliding_window counts the query too
        window_size=(c.sliding_window - 1, 0) if c.sliding_window else None,
        num_experts=c.num_experts, moe_router_topk=c.moe_top_k or 2,
        moe_ffn_hidden_size=c.ffn_hidden_size if c.is_moe else None,
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
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
        ckpt_format=ckpt_format, transformer_impl="transformer_engine" if impl == "te" else "local",
        use_legacy_models=False, bert_binary_head=True,
        no_load_optim=True, no_load_rng=True, no_save_optim=True, no_save_rng=True,
        consumed_train_samples=0, skipped_train_samples=0, consumed_valid_samples=0,
    )
    if c.is_moe and expert_layout == "legacy_grouped":
        # Megatron-LM before March 2026 (the GroupedMLP's last version) picks it under TE only with this flag
        values["moe_use_legacy_grouped_gemm"] = True
    if c.is_moe and expert_layout == "single_grouped":  # megatron-core requires the TE op fuser for it
        values |= {"moe_single_grouped_weight": True, "use_transformer_engine_op_fuser": True}
    return argparse.Namespace(**values)
