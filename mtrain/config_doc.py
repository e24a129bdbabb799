"""`mtrain config`: every section and field of the configuration as commented YAML.

    data:  # dataset prefixes and blend weights, split, sequence length, tokenizer
      seq_len: 1024                       # int: tokens per sample (at most the model's max_position_embeddings)

Each line shows the value (the default, or the resolved value of a given config), the type and one line of
meaning. The output is itself a config file: `mtrain config > run.yaml`, fill in the model, edit. docs/mtrain.md shows
this output verbatim (tests/mtrain/test_mtrain_config.py keeps the two the same).

mtrain's own sections carry their help in the dataclass fields (config.opt); the model section is mconvert's
ModelConfig, described here so the IR stays free of trainer text.
"""

from __future__ import annotations

import dataclasses
import textwrap
import types
import typing
from typing import Any, Literal

import yaml

from mconvert.ir.config import ModelConfig
from mtrain.config import SECTION_HELP, SECTIONS, Config, field_key

MODEL_HELP = {
    "family": "model family (HF / Megatron naming of exports)",
    "num_layers": "transformer layers",
    "hidden_size": "width of the residual stream",
    "ffn_hidden_size": "MLP inner size (the experts' too unless moe_ffn_hidden_size)",
    "num_attention_heads": "query heads",
    "num_query_groups": "key/value heads (GQA; = heads for plain MHA)",
    "head_dim": "size of one attention head",
    "vocab_size": "vocabulary size (no padding)",
    "max_position_embeddings": "longest sequence the model takes",
    "padded_vocab_size": "informational: a Megatron source's padded vocabulary",
    "norm": "the norms of the layers and the final norm",
    "norm_eps": "epsilon of the norms",
    "activation": "MLP activation (swiglu, geglu_tanh and quick_geglu have a gate projection)",
    "position_embedding": "rotary (rope) or learned absolute positions",
    "rope_theta": "rotary base",
    "rope_scaling": "HF's rope_scaling, e.g. {rope_type: linear, factor: 2.0}",
    "qkv_bias": "biases on the q, k, v projections",
    "proj_bias": "bias on the attention output projection",
    "mlp_bias": "biases on the MLP projections",
    "tie_embeddings": "the output head reuses the input embedding",
    "sliding_window": "keys a query sees, itself included (null: all)",
    "full_attention_layers": "layers exempt from the sliding window",
    "qk_norm": "per-head norms of queries and keys before rotary (Qwen3)",
    "num_experts": "MoE: experts per layer (null: a dense model)",
    "moe_top_k": "MoE: experts each token is routed to",
    "moe_aux_loss_coeff": "MoE: weight of the load-balancing loss",
    "moe_jitter_eps": "MoE: multiplicative router input jitter in training",
    "moe_ffn_hidden_size": "MoE: each expert's FFN size (null: ffn_hidden_size)",
    "dense_layers": "MoE: layers with a dense MLP of ffn_hidden_size",
    "moe_norm_topk": "MoE: renormalize the top-k routing weights to sum to 1",
    "q_lora_rank": "MLA: rank of the query's low-rank projection (null: one q projection)",
    "kv_lora_rank": "MLA: size of the key/value latent (null: multi-head attention)",
    "qk_rope_head_dim": "MLA: rotary part of each query/key head (head_dim holds it)",
    "v_head_dim": "MLA: size of a value head",
    "moe_shared_expert_ffn_hidden_size": "MoE: FFN of the shared expert(s) every token uses",
    "moe_router_score": "MoE: router scores by softmax or sigmoid (DeepSeek-V3)",
    "moe_router_expert_bias": "MoE: per-expert bias on the scores that choose experts",
    "moe_router_groups": "MoE: experts split in groups for group-limited routing",
    "moe_router_group_topk": "MoE: groups each token may choose experts from",
    "moe_router_scaling_factor": "MoE: the routed experts' weights are scaled by it",
    "mtp_layers": "multi-token-prediction modules after the last layer",
    "rotary_percent": "fraction of each query/key head rotary turns (GLM-4.5: 0.5)",
    "encoder_num_layers": "layers of the encoder stack of an encoder-decoder (Megatron T5); 0 for decoder-only",
    "sandwich_norms": "norms of the attention and MLP outputs before the residual adds (Gemma)",
    "norm_zero_centered": "norms scale by (1 + weight) (Gemma; Megatron apply_layernorm_1p)",
    "embedding_multiplier": "token embeddings times this (Gemma: sqrt(hidden_size))",
    "local_rope_theta": "rotary base of the windowed layers (null: rope_theta)",
    "query_pre_attn_scalar": "scores scaled by its -1/2 power (null: head_dim's)",
    "attn_logit_softcap": "attention scores soft-capped: cap * tanh(s / cap) (null: none)",
    "final_logit_softcap": "logits soft-capped: cap * tanh(l / cap) (null: none)",
    "attention_sinks": "a learned logit per head joins each attention softmax (GPT-OSS)",
    "moe_router_bias": "MoE: the router's linear has a bias (GPT-OSS)",
    "glu_linear_offset": "gated unit: act(gate) * (up + offset) (GPT-OSS: 1)",
    "activation_clamp": "gated unit: gate clamped above, up to [-it, it] (GPT-OSS)",
    "num_tokentypes": "BERT: token-type (segment) embeddings (0: none)",
    "pooler": "BERT: tanh(pooler(h[:, 0])), the pooled first token",
    "binary_head": "BERT: next-sentence logits from the pooled output (NSP loss)",
    "post_norm": "BERT: post-LN layers and an embedding norm (HF bert)",
    "lm_head_bias": "a bias on the LM head's logits (BERT, Megatron T5)",
    "mlm_head_activation": "BERT: activation of the MLM head's transform",
    "dtype": "dtype of stored weights (training: fp32 master)",
    "bos_token_id": "beginning-of-sequence token id",
    "eos_token_id": "end-of-sequence id(s): generation stops there",
    "pad_token_id": "padding token id",
}

HEADER = """\
# mtrain configuration: every section and field, with its default, type and meaning (`mtrain config`).
# A run's file sets what it needs; `--section.field VALUE` overrides any field on the command line
# (lists as a,b or [a, b]; null for none). Fields marked required have no default."""
UNDOCUMENTED = "(not described yet)"  # tests/mtrain/test_mtrain_config.py requires a description for every field
VALUE_COLUMN = 34
MAX_WIDTH = 118


def reference(config: Config | None = None) -> str:
    """The commented YAML of every section and field (values of `config`, or the defaults)."""
    lines = [HEADER]
    for section, cls in SECTIONS.items():
        lines.append(f"{section}:  # {SECTION_HELP[section]}")
        current = getattr(config, section) if config is not None else None
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if current is not None:
                value = getattr(current, f.name)
            else:
                value = None if required else f.default if f.default is not dataclasses.MISSING else f.default_factory()
            entry = f"  {field_key(f.name)}: {_yaml(value)}"
            entry = f"{entry:<{max(VALUE_COLUMN, len(entry) + 1)}}# "  # a long name still gets a space before #
            kind, need = type_name(hints[f.name]), ", required" if required else ""
            line = f"{entry}{kind}{need}: {field_help(cls, f)}"
            if len(line) > MAX_WIDTH:  # a long list of choices: the meaning goes on the line above
                lines.append(f"  # {field_help(cls, f)}")
                line = f"{entry}{kind}{need}"
            if len(line) > MAX_WIDTH:  # and a very long one on a line of its own
                lines += textwrap.wrap(f"one of: {kind}", MAX_WIDTH, initial_indent="  # ", subsequent_indent="  #   ",
                                       break_on_hyphens=False)
                line = f"{entry}choice{need}"
            lines.append(line)
    return "\n".join(lines) + "\n"


def field_help(cls: type, f: dataclasses.Field) -> str:
    return MODEL_HELP.get(f.name, UNDOCUMENTED) if cls is ModelConfig else f.metadata.get("help", UNDOCUMENTED)


def type_name(hint: Any) -> str:
    """`int | null`, `list of str`, `fp32 | bf16`: how a user writes the field's values."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else type_name(a) for a in args)
    if origin is Literal:
        return " | ".join(map(str, args))
    if origin in (tuple, list):
        return f"list of {type_name(args[0])}"
    if origin is dict or hint is dict:
        return "mapping"
    return {bool: "bool", int: "int", float: "float", str: "str"}.get(hint, str(hint))


def _yaml(value: Any) -> str:
    if isinstance(value, tuple):
        value = list(value)
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").strip()
