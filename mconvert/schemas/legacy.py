"""Megatron-LM legacy GPT checkpoints (`megatron.legacy.model`, `torch` format): key table, names, nesting, args.

The directory and rank files are those of core (see `schemas.core`); the model dict nests instead of being flat:

    model (or model0 .. model{V-1} with virtual pipelining)
      language_model
        embedding
          word_embeddings      {weight [V_pad/tp, h]}               first stage
          position_embeddings  {weight [S, h]}                      first stage, learned positions, every TP rank
        encoder                                                     flat: a ParallelTransformer state_dict
          layers.{l}.input_layernorm.{weight,bias}                  l local to the pipeline chunk
          layers.{l}.self_attention.query_key_value.{weight,bias}   [3·np·hn/tp, h] (order: checkpoint_version)
          layers.{l}.self_attention.dense.{weight,bias}             [h, np·hn/tp]
          layers.{l}.post_attention_layernorm.{weight,bias}
          layers.{l}.mlp.dense_h_to_4h.{weight,bias}                [f/tp, h]; SwiGLU: [gate_r ; up_r], 2f/tp rows
          layers.{l}.mlp.dense_4h_to_h.{weight,bias}                [h, f/tp]
          final_layernorm.{weight,bias}                             last stage
        output_layer           {weight [V_pad/tp, h]}               last stage, untied only
      word_embeddings_for_head {weight [V_pad/tp, h]}               last stage, tied, when it lacks the embedding

Two naming generations exist. Older files (and the third-party HF scripts) say `transformer` for `encoder`,
`attention` for `self_attention` and `*_layernorm`; Megatron's later legacy model says `input_norm`,
`post_attention_norm`, `final_norm`. Megatron loads either (its ParallelTransformer renames "layernorm" to
"norm" on load), while the HF scripts read only the `*_layernorm` names, so those are the names we write and
`canonical()` maps every spelling onto them when reading.

Grouped-query models (`num_query_groups`) use core's grouped QKV layout; plain multi-head files are the same
layout with one head per group (`[np, 3, hn]`) from checkpoint_version 2 on, see `transforms` for 0 and 1.
"""

from __future__ import annotations

import re
from typing import Any

from mconvert import transforms
from mconvert.errors import ConvertError
from mconvert.ir import ModelConfig
from mconvert.layout import ParallelLayout
from mconvert.rules import (
    COLUMN,
    GATE_UP,
    GATED_COLUMN,
    QKV,
    REPLICATE,
    ROW,
    VOCAB,
    Ctx,
    Rule,
    Shard,
    Table,
    linear,
    norm,
)
from mconvert.schemas import core

CHECKPOINT_VERSION = 3.0
KNOWN_VERSIONS = (0, 1, 2, 3)  # the values Megatron-LM ever wrote (0 = no key at all)
EMBEDDING = "language_model.embedding"
ENCODER = "language_model.encoder"
LAYER_KEY = re.compile(rf"{re.escape(ENCODER)}\.layers\.(\d+)\.")
# Module state dicts stored flat (dotted keys) rather than nested one dict per dot.
FLAT_MODULES = (ENCODER,)

# Every spelling of a key -> the one we write (applied in order to the flattened key).
ALIASES = tuple((re.compile(p), r) for p, r in (
    (r"^language_model\.transformer\.", "language_model.encoder."),
    (r"\.attention\.", ".self_attention."),
    (r"\.input_norm\.", ".input_layernorm."),
    (r"\.post_attention_norm\.", ".post_attention_layernorm."),
    (r"^language_model\.encoder\.final_norm\.", "language_model.encoder.final_layernorm."),
))

# Not weights: module extra state (None, or TE's FP8 metadata) and rotary frequencies rebuilt from args.
DROP = (r".*\._extra_state", r".*inv_freq")
TIED_HEAD_KEY = "word_embeddings_for_head.weight"
# The last stage's copy of the (padded) word embeddings when they are tied to the output layer.
TIED_HEAD = Rule(TIED_HEAD_KEY, ("embed.weight",), VOCAB, COLUMN)


def canonical(key: str) -> str:
    for pattern, replacement in ALIASES:
        key = pattern.sub(replacement, key)
    return key


def check_version(value: Any, where: str) -> int:
    """The QKV order a checkpoint_version implies: 0, 1, or 2 (for 2.0 and 3.0, which share the order)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value in KNOWN_VERSIONS:
        return min(int(value), 2)
    raise ConvertError(f"{where}: checkpoint_version {value!r} is not one Megatron-LM writes (expected 0, 1.0, 2.0 "
                       "or 3.0); it decides the row order of query_key_value, so the file cannot be read safely")


def _legacy_qkv_pieces(t, ctx: Ctx):
    heads = ctx.config.num_attention_heads // ctx.tp
    return [transforms.per_head_to_legacy_qkv(p, ctx.qkv_version, heads) for p in COLUMN.shard(t, ctx)]


def _per_head_pieces(pieces, ctx: Ctx):
    heads = ctx.config.num_attention_heads // len(pieces)
    return COLUMN.unshard([transforms.legacy_qkv_to_per_head(p, ctx.qkv_version, heads) for p in pieces], ctx)


# Column-parallel QKV whose rows, on each TP rank, are in the order of `ctx.qkv_version` (checkpoint_version
# 0 or 1; from version 2 on the order is core's grouped one, a plain column split).
_QKV_V0_V1 = Shard("column_legacy_qkv", _legacy_qkv_pieces, _per_head_pieces)
LEGACY_QKV = Shard(
    "column_qkv_by_version",
    lambda t, ctx: (COLUMN if ctx.qkv_version >= 2 else _QKV_V0_V1).shard(t, ctx),
    lambda ps, ctx: (COLUMN if ctx.qkv_version >= 2 else _QKV_V0_V1).unshard(ps, ctx),
)

# The key table, relative to one chunk's model dict (`{l}` local to the chunk).
TABLE = Table(
    embedding=(
        Rule("language_model.embedding.word_embeddings.weight", ("embed.weight",), VOCAB, COLUMN),
        Rule("language_model.embedding.position_embeddings.weight", ("pos_embed.weight",)),
    ),
    layer=(
        *norm("language_model.encoder.layers.{l}.input_layernorm", "layers.{L}.attn_norm"),
        *linear("language_model.encoder.layers.{l}.self_attention.query_key_value", "layers.{L}.attn.q",
                "layers.{L}.attn.k", "layers.{L}.attn.v", join=QKV, shard=LEGACY_QKV),
        *linear("language_model.encoder.layers.{l}.self_attention.dense", "layers.{L}.attn.o", shard=ROW,
                bias_shard=REPLICATE),
        *norm("language_model.encoder.layers.{l}.post_attention_layernorm", "layers.{L}.mlp_norm"),
        # SwiGLU first: when gate exists the fused rule wins (see rules.active)
        *linear("language_model.encoder.layers.{l}.mlp.dense_h_to_4h", "layers.{L}.mlp.gate", "layers.{L}.mlp.up",
                join=GATE_UP, shard=GATED_COLUMN),
        *linear("language_model.encoder.layers.{l}.mlp.dense_h_to_4h", "layers.{L}.mlp.up", shard=COLUMN),
        *linear("language_model.encoder.layers.{l}.mlp.dense_4h_to_h", "layers.{L}.mlp.down", shard=ROW,
                bias_shard=REPLICATE),
    ),
    head=(
        *norm("language_model.encoder.final_layernorm", "final_norm"),
        Rule("language_model.output_layer.weight", ("lm_head.weight",), VOCAB, COLUMN),
    ),
)


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """Nested module dicts -> dotted keys (flat sub-dicts such as the encoder's come out the same)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """Inverse of `flatten` for the keys we write: one dict per module, the encoder's keys kept dotted."""
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        path = key.split(".")
        for module in FLAT_MODULES:
            if key.startswith(module + "."):
                path = [*module.split("."), key[len(module) + 1:]]
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return tree


def args_from_config(c: ModelConfig, layout: ParallelLayout, *, padded_vocab_size: int,
                     divisible_by: int) -> Any:
    """Core's Megatron args (Megatron's loaders read the same fields), marked legacy, plus `orig_vocab_size`,
    which HF's megatron_gpt2 scripts read to strip the vocabulary padding."""
    args = core.args_from_config(c, layout, padded_vocab_size=padded_vocab_size, divisible_by=divisible_by,
                                 impl="local")
    args.use_legacy_models = True
    args.orig_vocab_size = c.vocab_size
    return args
