"""Megatron-LM legacy GPT checkpoints (`megatron.legacy.model`, `torch` format): key table, names, nesting, args.

Plugin `legacy` (loader and saver), any TP / PP / VPP. The directory and rank files are those of core (see
`mconvert.megatron.core`); the model dict nests instead of being flat:

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

Reading: GPT-2 style (LayerNorm, GELU, learned positions, biases, tied output) and Llama style (RMSNorm, SwiGLU, RoPE,
GQA, untied output) alike, both naming generations, every `checkpoint_version` (its QKV row order). Files go
through the safe unpickler (args pickled as argparse or SimpleNamespace with Megatron enums inside).

Writing: checkpoint_version 3.0 with the older module names (`encoder`, `self_attention`, `*_layernorm`), which
Megatron's legacy model and the well-known third-party converters both read. As in `mconvert.megatron.torch_format`,
the TP files of one pipeline stage are written together, tensor by tensor, so peak memory is about one layer.
`word_embeddings_for_head` is written where Megatron writes it: in the chunk holding the head when embeddings are
tied and that chunk does not also hold the embedding (so not at PP 1).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mconvert.errors import ConvertError
from mconvert.io.torch_archive import is_tensor
from mconvert.ir.config import ModelConfig
from mconvert.ir.dtypes import dtype_name
from mconvert.ir.tensors import LazyTensor, LoadCache, ModelIR, SourceInfo
from mconvert.megatron import arguments, model_kind, rank_files, rank_plan
from mconvert.megatron.rank_files import (
    RankFiles,
    chunks_in_files,
    find_iteration,
    first_model,
    read_parts,
    tokenizer,
)
from mconvert.megatron.rank_files import config as megatron_config
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.registry import get_saver, missing_features, register_loader, register_saver
from mconvert.rules import row_maps, transforms
from mconvert.rules.layout import ParallelLayout
from mconvert.rules.mapping import to_ir, verify_copies
from mconvert.rules.table import (
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

CHECKPOINT_VERSION = 3.0
KNOWN_VERSIONS = (0, 1, 2, 3)  # the values Megatron-LM ever wrote (0 = no key at all)
EMBEDDING = "language_model.embedding"
ENCODER = "language_model.encoder"
LAYER_KEY = re.compile(rf"{re.escape(ENCODER)}\.layers\.(\d+)\.")
# Module state dicts stored flat (dotted keys) rather than nested one dict per dot (BERT's pooler and MLM head are
# plain modules' state dicts).
FLAT_MODULES = (ENCODER, "language_model.pooler", "lm_head")

# Every spelling of a key -> the one we write (applied in order to the flattened key).
ALIASES = tuple((re.compile(p), r) for p, r in (
    (r"^language_model\.transformer\.", "language_model.encoder."),
    (r"\.attention\.", ".self_attention."),
    (r"\.input_norm\.", ".input_layernorm."),
    (r"\.post_attention_norm\.", ".post_attention_layernorm."),
    (r"^language_model\.encoder\.final_norm\.", "language_model.encoder.final_layernorm."),
    (r"^lm_head\.norm\.", "lm_head.layernorm."),  # BERT's MLM head, the later legacy model's name
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
def _by_head_shape(shape: tuple[int, ...], ctx: Ctx) -> list[tuple[int, ...]] | None:
    """A column split whose pieces hold whole heads (their rows reordered within each piece, shapes unchanged;
    versions 0 and 1 order q, k and v per head, which needs as many key/value heads as query heads)."""
    c = ctx.config
    if c.num_attention_heads % ctx.tp or (ctx.qkv_version < 2 and c.num_query_groups != c.num_attention_heads):
        return None
    return COLUMN.shape(shape, ctx)


_QKV_V0_V1 = Shard("column_legacy_qkv", _legacy_qkv_pieces, _per_head_pieces, shape=_by_head_shape)
LEGACY_QKV = Shard(
    "column_qkv_by_version",
    lambda t, ctx: (COLUMN if ctx.qkv_version >= 2 else _QKV_V0_V1).shard(t, ctx),
    lambda ps, ctx: (COLUMN if ctx.qkv_version >= 2 else _QKV_V0_V1).unshard(ps, ctx),
    shape=_by_head_shape,
    rows=lambda rows, ctx: row_maps.column(rows, ctx) if ctx.qkv_version >= 2 else None,
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


# Megatron-LM's legacy BertModel: GPT's language model with token types and the pooler (`add_pooler`, with the
# binary head), then beside `language_model` its MLM head (`lm_head`: the transform and the output bias, split over
# TP like the vocabulary; the output layer is always the word embedding) and `binary_head`.
BERT_TABLE = Table(
    embedding=(*TABLE.embedding, Rule("language_model.embedding.tokentype_embeddings.weight",
                                      ("token_type_embed.weight",))),
    layer=TABLE.layer,
    head=(
        *norm("language_model.encoder.final_layernorm", "final_norm"),
        *linear("language_model.pooler.dense", "pooler"),
        *linear("lm_head.dense", "mlm_head.dense"),
        *norm("lm_head.layernorm", "mlm_head.norm"),
        Rule("lm_head.bias", ("lm_head.bias",), VOCAB, COLUMN),
        *linear("binary_head", "nsp_head"),
    ),
)


def is_bert(last_stage: dict[str, Any]) -> bool:
    """A legacy BertModel's last stage keeps `lm_head` beside `language_model` (GPT's keeps none)."""
    return any(k.startswith("lm_head.") for k in last_stage)


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
    args = arguments.args_from_config(c, layout, padded_vocab_size=padded_vocab_size, divisible_by=divisible_by,
                                 impl="local")
    args.use_legacy_models = True
    args.orig_vocab_size = c.vocab_size
    if c.is_bert:
        vars(args).update(arguments.bert_gelu_args(c))
    return args


def is_legacy_checkpoint(path: Path) -> bool:
    """Legacy files nest their weights under `language_model` (core's keys are flat: `decoder.`, `embedding.`)."""
    model = first_model(path)
    return model is not None and any(k == "language_model" or k.startswith("language_model.") for k in model) \
        and model_kind.kind(model) != "t5"


@register_loader("legacy", aliases=("megatron_legacy",), detect=is_legacy_checkpoint,
                 options=("true_vocab_size", "tokenizer"))
def load(path: Path, options: Options) -> ModelIR:
    """Megatron-LM legacy GPT (nested language_model dicts), GPT-2 or Llama style, and BERT, any
    checkpoint_version."""
    it_dir, iteration = find_iteration(Path(path))
    files = RankFiles(it_dir)
    model_kind.refuse_other(files.model(0, 0, 0, files.chunk_names()[0]), files.rel((0, 0, 0)), "legacy",
                            ("gpt", "bert"))
    model = first_model(Path(path))
    if model is not None and not is_legacy_checkpoint(Path(path)):
        kind = "BertModel" if any(k.startswith("encoder.") for k in model) else "GPTModel"
        raise ConvertError(f"{it_dir}: a megatron-core {kind} (flat keys such as {next(iter(model))}), not a "
                           "Megatron-LM legacy model (nested language_model); read it with --loader core")
    names = files.chunk_names()
    order, version = qkv_order(files)
    cached: dict[tuple[int, int, str], dict[str, LazyTensor]] = {}

    def tensors_of(tp: int, pp: int, ep: int, entry: str) -> dict[str, LazyTensor]:
        if (tp, pp, entry) not in cached:
            cached[(tp, pp, entry)] = _canonical_tensors(files, tp, pp, entry)
        return cached[(tp, pp, entry)]

    chunks = chunks_in_files(files, LAYER_KEY, tensors_of)
    embed_key = f"{EMBEDDING}.word_embeddings.weight"
    first = tensors_of(0, 0, 0, names[0])
    if embed_key not in first:
        raise ConvertError(f"{files.rel((0, 0, 0))}: no model.{embed_key} in the first pipeline stage")
    padded = first[embed_key].shape[0] * files.tp
    notes: list[str] = []
    assets = tokenizer(options, it_dir, files.args, notes)
    config, config_notes = megatron_config(files.args, options, padded, dtype_name(first[embed_key].dtype_name), it_dir,
                                           assets, files.stored_elements())
    notes += config_notes
    last = tensors_of(0, files.pp - 1, 0, names[-1])
    bert = is_bert(last)
    if bert:
        types = first.get("language_model.embedding.tokentype_embeddings.weight")
        config = arguments.bert_config(config, num_tokentypes=0 if types is None else int(types.shape[0]),
                                       binary_head="binary_head.weight" in last, where=str(it_dir),
                                       mlm_head_activation="gelu_tanh" if getattr(files.args, "openai_gelu", False)
                                       else "gelu")
    if order < 2 and config.num_query_groups != config.num_attention_heads:
        raise ConvertError(f"{files.rel((0, 0, 0))}: checkpoint_version {version} predates grouped-query attention, "
                           f"but the args say num_query_groups={config.num_query_groups}")
    ctx = Ctx(config, padded, tp=files.tp, qkv_version=order)
    parts = rank_plan.plan(BERT_TABLE if bert else TABLE, config, chunks, ep=1, entry_names=names,
                           tied_copy=TIED_HEAD)
    # With tied embeddings the last stage may keep its own copy for the head: Megatron writes it when that stage
    # lacks the embedding (PP > 1); HF's script writes it at PP 1 too. Copies are checked against the embedding.
    source, rows, copies = read_parts(files, parts, tensors_of,
                                      extra_copy_key=TIED_HEAD_KEY if config.tie_embeddings else None)
    tensors = to_ir(source, rows, ctx, where=str(it_dir), drop=DROP, cache=LoadCache(4))
    verify_copies(tensors, "embed.weight", copies, TIED_HEAD, ctx)
    layout = {"tp": files.tp, "pp": files.pp, "vpp": len(names) if names != ["model"] else 1,
              "stage_layers": [sum(len(c.layers) for c in chunks if c.pp == p) for p in range(files.pp)],
              "checkpoint_version": version, "padded_vocab": padded}
    kind = "BERT" if bert else "GPT"
    return ModelIR(config, tensors, SourceInfo(f"legacy (Megatron-LM legacy {kind})", it_dir, layout, iteration,
                                               notes), assets)


def qkv_order(files: RankFiles) -> tuple[int, Any]:
    """The checkpoint_version every rank file carries (they must agree) and the QKV order it implies."""
    versions = {idx: state.get("checkpoint_version", 0) for idx, state in files.states.items()}
    first = versions[(0, 0, 0)]
    for idx, value in versions.items():
        check_version(value, str(files.files[idx]))
        if value != first:
            raise ConvertError(f"{files.files[idx]}: checkpoint_version {value!r}, but {files.rel((0, 0, 0))} has "
                               f"{first!r}; the rank files come from different checkpoints")
    return check_version(first, str(files.files[(0, 0, 0)])), first


def _canonical_tensors(files: RankFiles, tp: int, pp: int, name: str) -> dict[str, LazyTensor]:
    """One rank file's tensors under the names we write (any naming generation), each remembering its origin."""
    model = files.model(tp, pp, 0, name)
    if not isinstance(model, dict):
        raise ConvertError(f"{files.rel((tp, pp, 0))}: {name!r} is a {type(model).__name__}, expected a dict")
    out: dict[str, LazyTensor] = {}
    for key, value in flatten(model).items():
        if not is_tensor(value):
            continue  # `_extra_state` None and the like
        canon = canonical(key)
        if canon in out:
            raise ConvertError(f"{files.rel((tp, pp, 0))}: {key} and {out[canon].origin.rsplit(':', 1)[1]} name "
                               "the same tensor (two naming generations mixed in one file)")
        # rows that go out unchanged are copied file to file (the lazy tensor knows where its bytes lie)
        out[canon] = files.lazy((tp, pp, 0), value, f"{files.rel((tp, pp, 0))}:{name}.{key}")
    return out


# The IR features (mconvert.ir.features.FEATURES) the legacy model holds: BERT and T5's encoder-decoder (its MoE
# and q/k norms are refused above with their own advice)
SUPPORTS: frozenset[str] = frozenset({"bert", "encoder_decoder"})


def _bert_problems(c: ModelConfig) -> list[str]:
    return [what for what, bad in (
        ("post-LN layers (HF 'bert'): Megatron's BERT normalizes before each sublayer", c.post_norm),
        ("a pooler without the binary head: Megatron's BertModel builds both or neither", c.pooler != c.binary_head),
        ("an output layer of its own: the legacy BertModel's is the word embedding", not c.tie_embeddings)) if bad]


@register_saver("legacy", aliases=("megatron_legacy",),
                options=("tp", "pp", "vpp", "first_stage_layers", "last_stage_layers", "make_vocab_size_divisible_by",
                         "iteration"),
                supports=SUPPORTS)
def save(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    """Megatron-LM legacy GPT or BERT, `torch` format, checkpoint_version 3.0 (mp_rank_TT[_PPP]/model_optim_rng.pt)."""
    c, layout = ir.config, options.layout
    if c.is_encoder_decoder:
        return get_saver("legacy_t5").func(ir, out, options, progress)  # mconvert.megatron.t5
    if c.is_moe:
        raise ConvertError("the legacy saver writes dense models only; save a mixture-of-experts model with "
                           "--saver core")
    if c.qk_norm:
        raise ConvertError("Megatron's legacy model has no per-head q/k norms (qk_layernorm); save this model with "
                           "--saver core")
    if missing := missing_features(c, SUPPORTS):
        raise ConvertError(f"Megatron's legacy model cannot hold this model: {', '.join(missing)}")
    layout.check_model(c)
    divisor, padded = rank_files.vocab_padding(c, layout.tp, options, progress)
    args = args_from_config(c, layout, padded_vocab_size=padded, divisible_by=divisor)
    iteration = rank_files.iteration(ir, options)
    ctx = Ctx(c, padded, tp=layout.tp)  # version 3.0 keeps version 2's QKV order (the default)
    if c.is_bert and (problems := _bert_problems(c)):
        raise ConvertError("Megatron's legacy BERT cannot hold this model: " + "; ".join(problems))
    parts = rank_plan.plan(BERT_TABLE if c.is_bert else TABLE, c, layout.chunks(c.num_layers), ep=1,
                           entry_names=rank_plan.entries(layout.vpp), tied_copy=TIED_HEAD)
    top = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}
    rank_files.write_checkpoint(ir, out, options, progress, ctx=ctx, parts=parts, top=top, where="saver legacy",
                                    chunk_dict=lambda part, flat: nest(flat))
