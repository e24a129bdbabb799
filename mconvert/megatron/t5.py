"""Megatron T5 (encoder-decoder) checkpoints, megatron-core and legacy, `torch` format: key tables, args, reading
and writing. Loader `t5` (detected); the `core` and `legacy` savers write a T5 model through here.

megatron-core `T5Model` (local spec), keys flat, `{l}` the layer:

    embedding.word_embeddings.weight        [V_pad/tp, h]    shared by encoder, decoder and (tied) the LM head
    embedding.position_embeddings.weight    [S, h]           learned absolute positions, shared by both stacks
    position_embeddings.weight              the same module again (T5Model.position_embeddings)
    encoder.layers.{l}.input_layernorm, self_attention.linear_qkv, self_attention.linear_proj, pre_mlp_layernorm,
        mlp.linear_fc1, mlp.linear_fc2      as GPT's layers
    encoder.final_layernorm
    decoder.layers.{l}.input_layernorm, self_attention.{linear_qkv,linear_proj}
    decoder.layers.{l}.pre_cross_attn_layernorm
    decoder.layers.{l}.cross_attention.linear_q     [nh*hd/tp, h]
    decoder.layers.{l}.cross_attention.linear_kv    [2*nh*hd/tp, h]   rows per head [k ; v] (transforms.fuse_kv)
    decoder.layers.{l}.cross_attention.linear_proj  [h, nh*hd/tp]
    decoder.layers.{l}.pre_mlp_layernorm, mlp.linear_fc1, mlp.linear_fc2
    decoder.final_layernorm
    lm_head.output_layer.bias               [V_pad/tp]       tied embeddings only (T5LMHead: bias=tied)
    lm_head.output_layer.weight             [V_pad/tp, h]    untied only
    output_layer.*                          the same module again (T5Model.output_layer)

Transformer Engine's spec fuses the input and pre-MLP norms into linear_qkv / linear_fc1 (`layer_norm_weight`),
as for GPT; the pre-cross-attention norm stays a module. Both specs are read and written (`--transformer-impl`).

Legacy `megatron.legacy.model.T5Model`, nested as the legacy GPT (see mconvert.megatron.legacy):

    language_model.embedding.{word_embeddings,position_embeddings}.weight
    language_model.encoder   (flat) layers.{l}.{input_layernorm, self_attention.{query_key_value,dense},
                             post_attention_layernorm, mlp.{dense_h_to_4h,dense_4h_to_h}}, final_layernorm
    language_model.decoder   (flat) layers.{l}.{input_layernorm, self_attention.{query_key_value,dense},
                             post_attention_layernorm (before cross-attention), inter_attention.{query,key_value,
                             dense}, post_inter_attention_layernorm (before the MLP), mlp.*}, final_layernorm
    lm_head.bias             [V_pad/tp]                       always tied to the word embeddings

Pipeline parallelism: megatron-core 0.16.1's and 0.19.2's Megatron-LM build T5 on one pipeline stage only
(pretrain_t5.py raises "Pipeline parallelism is not supported for T5"; --encoder-pipeline-model-parallel-size and
--pipeline-model-parallel-split-rank are gone), so T5 is read and written at PP 1, any TP. pretrain_t5.py also
builds the decoder with args.num_layers layers (the encoder's count; decoder_num_layers is ignored), so a core T5
has as many decoder layers as encoder layers; the legacy model takes args.decoder_num_layers.
"""

from __future__ import annotations

import argparse
import re
import types
from pathlib import Path
from typing import Any

from mconvert.errors import ConvertError
from mconvert.io.torch_archive import is_tensor
from mconvert.ir import sizes
from mconvert.ir.checks import with_where
from mconvert.ir.config import ModelConfig
from mconvert.ir.dtypes import dtype_name
from mconvert.ir.tensors import LazyTensor, LoadCache, ModelIR, SourceInfo
from mconvert.lazy import torch
from mconvert.megatron import arguments, core, legacy, model_kind, rank_files
from mconvert.megatron.rank_files import RankFiles, find_iteration, first_model, has_markers, read_parts, tokenizer
from mconvert.megatron.rank_plan import Part
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.registry import register_loader, register_saver
from mconvert.rules.layout import Chunk
from mconvert.rules.mapping import Row, expand, to_ir, verify_copies
from mconvert.rules.table import (
    COLUMN,
    GATE_UP,
    GATED_COLUMN,
    KV,
    QKV,
    REPLICATE,
    ROW,
    VOCAB,
    Ctx,
    Rule,
    Table,
    linear,
    norm,
)

ENTRY = "model"
DROP = (r".*\._extra_state",)


def _mlp(fc1: str, fc2: str, ir: str) -> tuple[Rule, ...]:
    """fc1 (gated first: it wins when the model has a gate) and fc2 of one layer."""
    return (*linear(fc1, f"{ir}.gate", f"{ir}.up", join=GATE_UP, shard=GATED_COLUMN),
            *linear(fc1, f"{ir}.up", shard=COLUMN), *linear(fc2, f"{ir}.down", shard=ROW, bias_shard=REPLICATE))


def _core_layer(block: str, impl: str, *, cross: bool) -> tuple[Rule, ...]:
    k, n = f"{block}.layers.{{l}}", f"{block}.layers.{{L}}"
    te = impl == "te"
    rules = [*norm(f"{k}.self_attention.linear_qkv" if te else f"{k}.input_layernorm", f"{n}.attn_norm", fused=te),
             *linear(f"{k}.self_attention.linear_qkv", f"{n}.attn.q", f"{n}.attn.k", f"{n}.attn.v", join=QKV,
                     shard=COLUMN),
             *linear(f"{k}.self_attention.linear_proj", f"{n}.attn.o", shard=ROW, bias_shard=REPLICATE)]
    if cross:
        rules += [*norm(f"{k}.pre_cross_attn_layernorm", f"{n}.xattn_norm"),
                  *linear(f"{k}.cross_attention.linear_q", f"{n}.xattn.q", shard=COLUMN),
                  *linear(f"{k}.cross_attention.linear_kv", f"{n}.xattn.k", f"{n}.xattn.v", join=KV, shard=COLUMN),
                  *linear(f"{k}.cross_attention.linear_proj", f"{n}.xattn.o", shard=ROW, bias_shard=REPLICATE)]
    rules += [*norm(f"{k}.mlp.linear_fc1" if te else f"{k}.pre_mlp_layernorm", f"{n}.mlp_norm", fused=te),
              *_mlp(f"{k}.mlp.linear_fc1", f"{k}.mlp.linear_fc2", f"{n}.mlp")]
    return tuple(rules)


def core_table(impl: str) -> Table:
    """megatron-core's T5Model under one transformer implementation (`local` or `te`)."""
    return Table(embedding=core.EMBEDDING, encoder_layer=_core_layer("encoder", impl, cross=False),
                 encoder_head=norm("encoder.final_layernorm", "encoder.final_norm"),
                 layer=_core_layer("decoder", impl, cross=True), head=(
                     *norm("decoder.final_layernorm", "decoder.final_norm"),
                     Rule("lm_head.output_layer.weight", ("lm_head.weight",), VOCAB, COLUMN),
                     Rule("lm_head.output_layer.bias", ("lm_head.bias",), VOCAB, COLUMN)))


# The modules T5Model registers twice (T5Model.position_embeddings, T5Model.output_layer): the second name of each
# stores a copy, which Megatron's strict load requires and a reader checks against the first.
CORE_COPIES = (
    Rule("position_embeddings.weight", ("pos_embed.weight",)),
    Rule("output_layer.weight", ("lm_head.weight",), VOCAB, COLUMN),
    Rule("output_layer.bias", ("lm_head.bias",), VOCAB, COLUMN),
)

_L_ENC, _L_DEC = "language_model.encoder.layers.{l}", "language_model.decoder.layers.{l}"


def _legacy_layer(k: str, block: str, *, cross: bool) -> tuple[Rule, ...]:
    n = f"{block}.layers.{{L}}"
    rules = [*norm(f"{k}.input_layernorm", f"{n}.attn_norm"),
             *linear(f"{k}.self_attention.query_key_value", f"{n}.attn.q", f"{n}.attn.k", f"{n}.attn.v", join=QKV,
                     shard=legacy.LEGACY_QKV),
             *linear(f"{k}.self_attention.dense", f"{n}.attn.o", shard=ROW, bias_shard=REPLICATE)]
    if cross:  # the legacy decoder layer names its norms by what they follow
        rules += [*norm(f"{k}.post_attention_layernorm", f"{n}.xattn_norm"),
                  *linear(f"{k}.inter_attention.query", f"{n}.xattn.q", shard=COLUMN),
                  *linear(f"{k}.inter_attention.key_value", f"{n}.xattn.k", f"{n}.xattn.v", join=KV, shard=COLUMN),
                  *linear(f"{k}.inter_attention.dense", f"{n}.xattn.o", shard=ROW, bias_shard=REPLICATE),
                  *norm(f"{k}.post_inter_attention_layernorm", f"{n}.mlp_norm")]
    else:
        rules += norm(f"{k}.post_attention_layernorm", f"{n}.mlp_norm")
    return (*rules, *_mlp(f"{k}.mlp.dense_h_to_4h", f"{k}.mlp.dense_4h_to_h", f"{n}.mlp"))


LEGACY_TABLE = Table(embedding=legacy.TABLE.embedding, encoder_layer=_legacy_layer(_L_ENC, "encoder", cross=False),
                     encoder_head=norm("language_model.encoder.final_layernorm", "encoder.final_norm"),
                     layer=_legacy_layer(_L_DEC, "decoder", cross=True), head=(
                         *norm("language_model.decoder.final_layernorm", "decoder.final_norm"),
                         Rule("lm_head.bias", ("lm_head.bias",), VOCAB, COLUMN)))
# legacy.canonical maps the older spellings of the encoder's names; the decoder's own ones here
LEGACY_ALIASES = tuple((re.compile(p), r) for p, r in (
    (r"\.post_inter_attention_norm\.", ".post_inter_attention_layernorm."),
    (r"^language_model\.decoder\.final_norm\.", "language_model.decoder.final_layernorm."),
))


def _core_copies(c: ModelConfig) -> list[Row]:
    return expand(Table(embedding=CORE_COPIES), c, layers=[], head=False)


def is_t5_checkpoint(path: Path) -> bool:
    model = first_model(path) if has_markers(path) else None
    return model is not None and model_kind.kind(model) == "t5"


def config_from_args(args: Any, *, encoder_layers: int, decoder_layers: int, tied: bool, vocab: int, padded: int,
                     dtype: str, where: str, stored: int) -> ModelConfig:
    """The IR config of a T5 from its Megatron args (the stack sizes as the files hold them, checked against the
    args by the caller): the decoder read as a GPT's layers, then the encoder and the LM head bias added."""
    sizes.check_counts(vars(args), ("encoder_num_layers", "decoder_num_layers", "num_layers"), stored, where, "args.")
    if getattr(args, "num_experts", None):
        raise ConvertError(f"{where}: a T5 with experts (args.num_experts={args.num_experts}) is not read: the IR's "
                           "T5 has dense layers")
    decoder_view = types.SimpleNamespace(**(vars(args) | {"num_layers": decoder_layers,
                                                            "untie_embeddings_and_output_weights": not tied}))
    gpt = arguments.config_from_args(decoder_view, vocab_size=vocab, padded_vocab_size=padded, dtype=dtype,
                                     where=where, stored=stored)
    config = with_where(where, lambda: gpt.replace(family="t5", encoder_num_layers=encoder_layers, lm_head_bias=tied))
    sizes.check_fits(config, stored, where)
    return config


def args_from_config(c: ModelConfig, options: Options, *, padded: int, divisor: int, impl: str, legacy_model: bool,
                     tokenizer_model: str | None) -> argparse.Namespace:
    """Megatron args of a T5: the decoder's as a GPT's, then the stack sizes under every name Megatron-LM reads."""
    decoder_view = c.replace(family="llama", encoder_num_layers=0, lm_head_bias=False)
    args = arguments.args_from_config(decoder_view, options.layout, padded_vocab_size=padded,
                                      divisible_by=divisor, impl=impl, tokenizer_model=tokenizer_model)
    args.num_layers, args.encoder_num_layers, args.decoder_num_layers = c.num_layers, c.encoder_num_layers, c.num_layers
    args.encoder_seq_length = args.seq_length = c.max_position_embeddings
    args.decoder_seq_length = c.max_position_embeddings
    args.use_legacy_models = legacy_model
    if legacy_model:
        args.orig_vocab_size = c.vocab_size
    if not tokenizer_model:
        args.tokenizer_type = None  # the run's own (pretrain_t5.py defaults to BertWordPieceLowerCase)
    return args


def _t5_problems(c: ModelConfig, options: Options, *, legacy_model: bool) -> list[str]:
    layout, problems = options.layout, []
    if layout.pp > 1 or layout.vpp > 1:
        problems.append(f"T5 over {layout.pp} pipeline stages: megatron-core 0.16.1 and 0.19.2 (pretrain_t5.py) build "
                        "T5 on one pipeline stage only; use --pp 1")
    if legacy_model and not (c.tie_embeddings and c.lm_head_bias):
        problems.append("the legacy T5 model always ties its LM head to the word embeddings and adds a bias; this "
                        f"model has tie_embeddings={c.tie_embeddings}, lm_head_bias={c.lm_head_bias}")
    if not legacy_model and c.lm_head_bias != c.tie_embeddings:
        problems.append("megatron-core's T5LMHead has a bias exactly when the output layer is tied to the word "
                        f"embeddings; this model has tie_embeddings={c.tie_embeddings}, "
                        f"lm_head_bias={c.lm_head_bias}")
    if not legacy_model and c.encoder_num_layers != c.num_layers:
        problems.append(f"{c.encoder_num_layers} encoder and {c.num_layers} decoder layers: Megatron-LM's "
                        "pretrain_t5.py builds megatron-core's T5 decoder with args.num_layers, the encoder's count; "
                        "save it with --saver legacy (decoder_num_layers)")
    return problems


# Reading ----------------------------------------------------------------------------------------------------------


@register_loader("t5", aliases=("megatron_t5",), detect=is_t5_checkpoint, options=("true_vocab_size", "tokenizer"))
def load(path: Path, options: Options) -> ModelIR:
    """Megatron T5 (encoder-decoder), megatron-core T5Model (local or Transformer-Engine names) or legacy, `torch`
    format, any TP (one pipeline stage)."""
    it_dir, iteration = find_iteration(Path(path))
    if core.is_dist_checkpoint(it_dir) or core.is_dcp_checkpoint(it_dir):
        raise ConvertError(f"{it_dir}: a distributed checkpoint; T5 is read from the torch format (save it from "
                           "Megatron-LM with --ckpt-format torch)")
    files = RankFiles(it_dir)
    model = files.model(0, 0, 0, files.chunk_names()[0])
    model_kind.refuse_other(model, files.rel((0, 0, 0)), "t5", "t5")
    if files.pp > 1 or files.chunk_names() != [ENTRY]:
        raise ConvertError(f"{it_dir}: T5 over {files.pp} pipeline stages ({', '.join(files.chunk_names())}): "
                           "megatron-core 0.16.1 and 0.19.2 build T5 on one stage only, and older encoder/decoder "
                           "pipeline splits are not read; reshard it to --pp 1 with the Megatron-LM that wrote it")
    is_legacy = isinstance(model.get("language_model"), dict)
    cached: dict[int, dict[str, LazyTensor]] = {}

    def tensors_of(tp: int, pp: int, ep: int, entry: str) -> dict[str, LazyTensor]:
        if tp not in cached:
            cached[tp] = _legacy_tensors(files, tp) if is_legacy else _core_tensors(files, tp)
        return cached[tp]

    first = tensors_of(0, 0, 0, ENTRY)
    embed_key = "language_model.embedding.word_embeddings.weight" if is_legacy else "embedding.word_embeddings.weight"
    if embed_key not in first:
        raise ConvertError(f"{files.rel((0, 0, 0))}: no {embed_key}")
    padded = first[embed_key].shape[0] * files.tp
    prefix = "language_model.encoder.layers." if is_legacy else "encoder.layers."
    encoder_layers = _count(first, prefix)
    decoder_layers = _count(first, prefix.replace("encoder", "decoder"))
    impl = "te" if any(k.endswith("linear_qkv.layer_norm_weight") for k in first) else "local"
    tied = is_legacy or "lm_head.output_layer.weight" not in first  # the legacy T5 is always tied
    _check_layer_args(files.args, encoder_layers, decoder_layers, is_legacy, files.rel((0, 0, 0)))
    notes: list[str] = []
    assets = tokenizer(options, it_dir, files.args, notes)
    vocab, vocab_notes = arguments.true_vocab_size(files.args, options.true_vocab_size, assets, padded,
                                                   where=str(it_dir))
    notes += vocab_notes
    config = config_from_args(files.args, encoder_layers=encoder_layers, decoder_layers=decoder_layers, tied=tied,
                              vocab=vocab, padded=padded, dtype=dtype_name(first[embed_key].dtype), where=str(it_dir),
                              stored=files.stored_elements())
    order, version = legacy.qkv_order(files) if is_legacy else (2, 3.0)
    if order < 2:
        raise ConvertError(f"{files.rel((0, 0, 0))}: checkpoint_version {version}: legacy T5 files before version 2.0 "
                           "order query_key_value and key_value rows otherwise; load and save it once with the "
                           "Megatron-LM that wrote it to reach version 3.0")
    ctx = Ctx(config, padded, tp=files.tp, qkv_version=order)
    chunk = Chunk(0, 0, range(config.num_layers), has_embedding=True, has_head=True)
    wanted = expand(LEGACY_TABLE if is_legacy else core_table(impl), config)
    source, found, _ = read_parts(files, [Part(chunk, 0, ENTRY, tuple(wanted))], tensors_of)
    stored_as = f"{files.files[(0, 0, 0)].parent.name}/{ENTRY}/"  # read_parts' prefix of every source key
    copies = [(row, source.pop(stored_as + row.key)) for row in ([] if is_legacy else _core_copies(config))
              if stored_as + row.key in source]
    tensors = to_ir(source, found, ctx, where=str(it_dir), drop=DROP, cache=LoadCache(4))
    for row, pieces in copies:
        verify_copies(tensors, row.ir[0], [pieces], row.rule, ctx, kept_for=f"{row.key}, the same module under its "
                      "second name in T5Model")
    layout = {"tp": files.tp, "pp": 1, "encoder_layers": encoder_layers, "decoder_layers": decoder_layers,
              "padded_vocab": padded} | ({"checkpoint_version": version} if is_legacy else {"transformer_impl": impl})
    what = "legacy T5 (Megatron-LM legacy T5Model)" if is_legacy else "core T5 (Megatron torch, T5Model)"
    return ModelIR(config, tensors, SourceInfo(what, it_dir, layout, iteration, notes), assets)


def _count(tensors: dict[str, LazyTensor], prefix: str) -> int:
    found = {int(m.group(1)) for k in tensors for m in [re.match(re.escape(prefix) + r"(\d+)\.", k)] if m}
    return max(found) + 1 if found else 0


def _check_layer_args(args: Any, encoder: int, decoder: int, is_legacy: bool, where: str) -> None:
    """The stacks the files hold against the args: the encoder's count is args.encoder_num_layers (else num_layers);
    the decoder's is args.decoder_num_layers for the legacy model and args.num_layers for megatron-core's (which
    pretrain_t5.py builds with num_layers; see the module docstring)."""
    if not encoder or not decoder:
        raise ConvertError(f"{where}: a T5 checkpoint needs encoder and decoder layers; found {encoder} encoder and "
                           f"{decoder} decoder layers")
    said_encoder = getattr(args, "encoder_num_layers", None) or getattr(args, "num_layers", None)
    said_decoder = getattr(args, "decoder_num_layers" if is_legacy else "num_layers", None) or \
        getattr(args, "num_layers", None)
    bad = [f"the {what} has {n} layers but args say {said}" for what, n, said in (
        ("encoder", encoder, said_encoder), ("decoder", decoder, said_decoder)) if said not in (None, n)]
    if bad:
        raise ConvertError(f"{where}: {'; '.join(bad)}")


def _core_tensors(files: RankFiles, tp: int) -> dict[str, LazyTensor]:
    idx = (tp, 0, 0)
    return {k: files.lazy(idx, v, f"{files.rel(idx)}:{ENTRY}.{k}") for k, v in files.model(tp, 0, 0, ENTRY).items()
            if is_tensor(v)}


def _legacy_tensors(files: RankFiles, tp: int) -> dict[str, LazyTensor]:
    idx = (tp, 0, 0)
    out: dict[str, LazyTensor] = {}
    for key, value in legacy.flatten(files.model(tp, 0, 0, ENTRY)).items():
        if not is_tensor(value):
            continue
        canon = legacy.canonical(key)
        for pattern, replacement in LEGACY_ALIASES:
            canon = pattern.sub(replacement, canon)
        if canon in out:
            raise ConvertError(f"{files.rel(idx)}: {key} and another key name the same tensor {canon} (two naming "
                               "generations mixed in one file)")
        out[canon] = files.lazy(idx, value, f"{files.rel(idx)}:{ENTRY}.{key}")
    return out


# Writing ----------------------------------------------------------------------------------------------------------

LEGACY_FLAT = ("language_model.encoder", "language_model.decoder")


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    """The legacy model dict: one dict per module, the encoder's and decoder's keys kept dotted."""
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        block = next((b for b in LEGACY_FLAT if key.startswith(b + ".")), None)
        path = [*block.split("."), key[len(block) + 1:]] if block else key.split(".")
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return tree


def _extra_states(c: ModelConfig, impl: str) -> dict[str, Any]:
    """The `_extra_state` entries of megatron-core's T5 modules: None for Megatron's own, TE's empty bytes."""
    te = impl == "te"
    value = torch.empty(0, dtype=torch.uint8) if te else None
    modules = [*(f"{b}.layers.{L}.{m}" for b, n in (("encoder", c.encoder_num_layers), ("decoder", c.num_layers))
                 for L in range(n) for m in ("self_attention.linear_proj", "self_attention.linear_qkv",
                                             *(("self_attention.core_attention",) if te else ()),
                                             *(("cross_attention.linear_proj", "cross_attention.linear_q",
                                                "cross_attention.linear_kv", "pre_cross_attn_layernorm",
                                                *(("cross_attention.core_attention",) if te else ()))
                                               if b == "decoder" else ()),
                                             "mlp.linear_fc1", "mlp.linear_fc2"))]
    out = {f"{m}._extra_state": value for m in modules if te or not m.endswith("pre_cross_attn_layernorm")}
    if te:
        out |= {"encoder.final_layernorm._extra_state": value, "decoder.final_layernorm._extra_state": value}
    return out | {"lm_head.output_layer._extra_state": None, "output_layer._extra_state": None}


@register_saver("core_t5", options=("tp", "pp", "transformer_impl", "ckpt_format", "make_vocab_size_divisible_by",
                                   "iteration"), supports=frozenset({"encoder_decoder"}))
def save_core(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    """Megatron-core T5Model, `torch` format (mp_rank_TT/model_optim_rng.pt, local or TE names), any TP, one
    pipeline stage; `--saver core` writes a T5 model through it."""
    _save(ir, out, options, progress, legacy_model=False)


@register_saver("legacy_t5", options=("tp", "pp", "make_vocab_size_divisible_by", "iteration"),
                supports=frozenset({"encoder_decoder"}))
def save_legacy(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    """Megatron-LM legacy T5Model, `torch` format, checkpoint_version 3.0, any TP, one pipeline stage; `--saver
    legacy` writes a T5 model through it."""
    _save(ir, out, options, progress, legacy_model=True)


def _save(ir: ModelIR, out: Path, options: Options, progress: Progress, *, legacy_model: bool) -> None:
    c = ir.config
    where = f"saver {'legacy' if legacy_model else 'core'}"
    if not c.is_encoder_decoder:
        raise ConvertError(f"{where}: a {c.family} model is not T5 (encoder-decoder); save it with --saver "
                           f"{'legacy' if legacy_model else 'core'}")
    problems = _t5_problems(c, options, legacy_model=legacy_model)
    if not legacy_model and options.ckpt_format != "torch":
        problems.append(f"T5 in --ckpt-format {options.ckpt_format}: T5 is written in the torch format")
    if not legacy_model and options.layout.ep > 1:
        problems.append("expert parallelism for a dense T5")
    if problems:
        raise ConvertError(f"{where}: " + "; ".join(problems))
    options.layout.check_model(c)
    impl = "local" if legacy_model else options.transformer_impl
    divisor, padded = rank_files.vocab_padding(c, options.layout.tp, options, progress)
    iteration = rank_files.iteration(ir, options)
    args = args_from_config(c, options, padded=padded, divisor=divisor, impl=impl, legacy_model=legacy_model,
                            tokenizer_model=rank_files.tokenizer_model(ir, out, options, iteration))
    planned = expand(LEGACY_TABLE if legacy_model else core_table(impl), c) + ([] if legacy_model else _core_copies(c))
    chunk = Chunk(0, 0, range(c.num_layers), has_embedding=True, has_head=True)
    top = {"args": args, "checkpoint_version": legacy.CHECKPOINT_VERSION, "iteration": iteration}

    def chunk_dict(part: Part, flat: dict) -> dict:
        return _nest(flat) if legacy_model else flat | _extra_states(c, impl)

    rank_files.write_checkpoint(ir, out, options, progress, ctx=Ctx(c, padded, tp=options.layout.tp),
                                parts=[Part(chunk, 0, ENTRY, tuple(planned))], top=top, chunk_dict=chunk_dict,
                                where=where)

