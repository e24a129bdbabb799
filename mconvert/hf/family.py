"""Hugging Face families: the registry, the `hf` loader and saver that dispatch on it, and what every family
shares (config.json to IR config, weights to lazy IR tensors and back, tokenizer files).

One module of this package is one family (`qwen.py`, `gpt2.py`, ...): its tensor table with the checkpoint's
names written out, its config.json mapping, its loader and saver, and at the end

    FAMILY = register_family(HFFamily("qwen_hf", ARCHITECTURES, load, save, aliases=("qwen",)))

which registers the loader and the saver under the family's name, makes the family's model types known to the
`hf` loader (by config.json's `model_type`) and to the `hf` saver (by the IR family), and lets format detection
recognise its directories (by config.json's `model_type`). Nothing else lists the families: a new module in
this package is a new family (see docs/adding-a-family.md).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mconvert import workers
from mconvert.errors import ConvertError
from mconvert.hf.config import generation_config
from mconvert.io import file_views, hf_dir
from mconvert.io.file_views import FileViews
from mconvert.io.safetensors import Entry
from mconvert.ir import dtypes, sizes
from mconvert.ir.blocks import Blocks, ByteBlocks
from mconvert.ir.checks import HF_INTEGERS, check_integers, with_where
from mconvert.ir.config import ModelConfig
from mconvert.ir.dtypes import dtype_name
from mconvert.ir.tensors import LazyTensor, ModelIR, SourceInfo
from mconvert.lazy import torch
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.registry import missing_features, register_loader, register_saver, savers
from mconvert.rules import fp8 as mfp8
from mconvert.rules.mapping import check_plan, expand, from_ir, take_copies, to_ir, verify_copies
from mconvert.rules.row_plan import RowPlanner
from mconvert.rules.table import Ctx, Rule, Table

# config.json's counts of things a reader loops over: layers, experts, MTP modules, dense layers
HF_COUNTS = ("num_hidden_layers", "n_layer", "num_local_experts", "num_experts", "n_routed_experts",
             "num_nextn_predict_layers", "first_k_dense_replace", "max_window_layers", "n_shared_experts")
TIED_HEAD = Rule("lm_head.weight", ("embed.weight",))  # a stored copy of the tied embedding


def load_hf(path: Path, options: Options, *, name: str, config_from_hf: Callable[[dict, str], ModelConfig],
            table: Table | Callable[[dict[str, LazyTensor]], Table], embed_key: str, drop: tuple[str, ...],
            fix_source: Callable[[dict[str, LazyTensor]], dict[str, LazyTensor]] = lambda s: s,
            layout: Callable[[dict[str, LazyTensor]], dict[str, Any]] = lambda s: {},
            stored_copies: Callable[[ModelConfig], dict[str, str]] = lambda c: {}) -> ModelIR:
    """An HF model directory (or hub id) through one family's table, strictly.

    The weights' dtype wins over config.json's; with tied embeddings a stored `lm_head.weight` must equal the
    embedding (checked when it is read). `table` may depend on the stored keys (a family stored in two layouts).
    `stored_copies` names other keys that, when stored, copy an IR tensor (key -> IR name): checked likewise.
    """
    root = hf_dir.resolve(path)
    stored = hf_dir.open_weights(root)  # headers only: what the config's sizes are checked against
    _, config = read_config(root, config_from_hf, stored)
    source = fix_source(stored)
    if embed_key in source:
        config = config.replace(dtype=dtype_name(source[embed_key].dtype_name))
    pieces = {k: [v] for k, v in source.items()}
    # Tied: a stored lm_head.weight must be the embedding again (checked when the embedding is read), never a
    # distinct matrix silently dropped.
    copies = take_copies(pieces, r"lm_head\.weight") if config.tie_embeddings else []
    others = {k: (name, pieces.pop(k)) for k, name in stored_copies(config).items() if k in pieces}
    rows = expand(table(source) if callable(table) else table, config)
    ctx = Ctx(config, config.vocab_size)
    tensors = to_ir(pieces, rows, ctx, where=str(root), drop=drop)
    verify_copies(tensors, "embed.weight", copies, TIED_HEAD, ctx)
    for key, (name, copy) in others.items():
        verify_copies(tensors, name, [copy], Rule(key, (name,)), ctx, kept_for="older transformers")
    assets = hf_dir.tokenizer_files(options.tokenizer or root)
    return ModelIR(config, tensors, SourceInfo(f"{name} (Hugging Face)", root, layout(source)), assets)


def read_config(root: Path, config_from_hf: Callable[[dict, str], ModelConfig],
                stored: dict[str, LazyTensor]) -> tuple[dict[str, Any], ModelConfig]:
    """(config.json as read, its IR config): counts that are not whole numbers, values the IR refuses and sizes
    beyond what the `stored` tensors hold (mconvert.ir.sizes) are reported against the file."""
    where = str(root / "config.json")
    raw = hf_dir.read_json(root / "config.json")
    check_integers(raw, HF_INTEGERS, where)
    values = sizes.stored_elements(t.shape for t in stored.values())
    sizes.check_counts(raw, HF_COUNTS, values, where)
    config = with_where(where, lambda: config_from_hf(raw, where))
    sizes.check_fits(config, values, where, mtp=False)  # deepseek.py counts them from the tensors
    return raw, config


def save_hf(ir: ModelIR, out: Path, options: Options, progress: Progress, *, table: Table,
            config_to_hf: Callable[[ModelConfig], dict[str, Any]], where: str,
            fp8: Callable[[str], bool] | None = None) -> None:
    """Sharded safetensors (+ index), config.json, generation_config.json and the tokenizer files.

    `config_to_hf` runs first, so a model the family cannot express is refused before anything is written. The
    weights `fp8` picks are written FP8 block-quantized (see mconvert.rules.fp8), each with its `weight_scale_inv`.
    """
    config = with_token_ids(ir, options)
    hf_config = config_to_hf(config)
    ctx = Ctx(config, config.vocab_size)
    rows = expand(table, config)
    check_plan(ir.tensors, [("model", rows)], where=where)
    plan = {p.key: p for p in from_ir(ir, rows, ctx)}
    planner = RowPlanner(ctx)
    quantize = {key for key in plan if fp8 is not None and fp8(key)}
    views = FileViews()  # the source maps, shared by the byte path and the placement of the data (`_mapped`)
    view = views.view if file_views.enabled() else None  # bytes moved without torch where they allow
    if view is None or quantize or not all(planner.moves_bytes(p.row.rule, [ir[n] for n in p.row.ir])
                                           for p in plan.values()):
        torch.get_num_threads()  # the plan needs torch: imported now, so that its jobs run it on one thread each
    def tensor(key: str):
        return plan[key].produce(ir, planner, None if key in quantize else view)

    entries, produce = _entries(plan, tensor, fp8)
    jobs, index = hf_dir.weight_jobs(out, entries, produce, options.max_shard_size,
                                     parallel=workers.slots(options.workers),
                                     sources=functools.partial(_mapped, plan, ir, planner, quantize, views.view))

    def finish(_) -> None:
        if index is not None:
            hf_dir.write_json(out / hf_dir.SAFE_INDEX, index)
        hf_dir.write_json(out / "config.json", hf_config)
        hf_dir.write_json(out / "generation_config.json", generation_config(config))
        write_tokenizer(ir, out, options, progress)

    workers.run(jobs, workers=options.workers, progress=progress, finish=finish)


def _mapped(plan: dict, ir: ModelIR, planner: RowPlanner, quantize: set[str], view, e: Entry) -> ByteBlocks | None:
    """Entry `e` as byte views of the files its IR tensors lie in whole (HF files, DCP chunks in order), asked only
    for their provenance, to place the data (see `safetensors_io.layout`): nothing computed, no torch, on both
    paths alike; None for a tensor a loader's rule rearranges (its pieces joined in memory on the way)."""
    p = plan.get(e.name)
    if p is None or e.name in quantize:
        return None
    tensors = [ir[n] for n in p.row.ir]
    if any(t.file_bytes is None and t.byte_blocks is not None for t in tensors):
        return None
    found = planner.forward_bytes(p.row.rule, tensors, view)
    return found[0] if found else None


def _entries(plan: dict, tensor: Callable[[str], Any], fp8: Callable[[str], bool] | None):
    """The safetensors entries and the function producing each: a quantized weight is quantized once, its
    `weight_scale_inv` (the next entry) taken from that. Workers may write the two in different ranges, in either
    order: a scale whose weight was not quantized yet quantizes it itself (the same bytes)."""
    entries, pending, lock = [], {}, threading.Lock()
    for key, p in plan.items():
        if fp8 is not None and fp8(key):
            entries += [Entry(key, p.shape, mfp8.FP8), Entry(key + mfp8.SCALE_SUFFIX, mfp8.scale_shape(p.shape),
                                                             torch.float32)]
        else:
            entries.append(Entry(key, p.shape, p.dtype))

    def quantized(key: str):
        value = tensor(key)
        return mfp8.quantize(value.join() if isinstance(value, Blocks) else value)

    def produce(e: Entry):
        weight = e.name[:-len(mfp8.SCALE_SUFFIX)]
        if e.name.endswith(mfp8.SCALE_SUFFIX) and fp8 is not None and weight in plan and fp8(weight):
            with lock:
                found = pending.pop(weight, None)
            return (found or quantized(weight))[1]
        if dtypes.name_of(e.dtype) == mfp8.FP8_NAME:
            q = quantized(e.name)
            with lock:
                pending[e.name] = q
            return q[0]
        return tensor(e.name)

    return entries, produce


def with_token_ids(ir: ModelIR, options: Options) -> ModelConfig:
    """The config, with bos/eos/pad ids the source did not record (Megatron) filled in from the tokenizer."""
    assets = hf_dir.tokenizer_files(options.tokenizer) if options.tokenizer else ir.assets
    found = hf_dir.special_token_ids(assets)
    return ir.config.replace(**{k: v for k, v in found.items() if getattr(ir.config, k) is None})


def write_tokenizer(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    assets = hf_dir.tokenizer_files(options.tokenizer) if options.tokenizer else ir.assets
    if not assets:
        progress.note("note: no tokenizer files in the source; pass --tokenizer DIR to include them")
    hf_dir.copy_assets(assets, out)


@dataclass(frozen=True)
class HFFamily:
    """One Hugging Face family, as the registry knows it.

    `model_types` maps each config.json `model_type` the family reads to the `architectures` entry it writes;
    the IR families it writes are those model types and `ir_families` (an IR family named otherwise: Blenderbot
    writes Megatron's T5). `load` and `save` are the family's loader and saver
    (registered under `name` and `aliases`); their docstrings' first paragraphs are what `mconvert plugins`
    shows. `detect` recognises the family's directories (default: an HF directory whose config.json names one of
    `model_types`).
    """

    name: str
    model_types: dict[str, str]
    load: Callable[[Path, Options], ModelIR]
    save: Callable[[ModelIR, Path, Options, Progress], None]
    supports: frozenset[str] = frozenset()  # names from mconvert.ir.features.FEATURES
    aliases: tuple[str, ...] = ()
    detect: Callable[[Path], bool] | None = None
    load_options: tuple[str, ...] = ("tokenizer",)
    save_options: tuple[str, ...] = ("max_shard_size", "tokenizer")
    ir_families: tuple[str, ...] = ()

    def is_mine(self, path: Path) -> bool:
        return hf_dir.is_hf_dir(path, tuple(self.model_types))


FAMILIES: dict[str, HFFamily] = {}  # name -> family, in registration order


def register_family(family: HFFamily) -> HFFamily:
    """Register `family`'s loader and saver, and its model types with the `hf` loader and saver."""
    taken = {t: f.name for f in FAMILIES.values() for t in f.model_types}
    clash = sorted(t for t in family.model_types if t in taken and taken[t] != family.name)
    if clash:
        raise ValueError(f"family {family.name}: model types {clash} are already {taken[clash[0]]}'s")
    FAMILIES[family.name] = family
    register_loader(family.name, aliases=family.aliases, detect=family.detect or family.is_mine,
                    options=family.load_options)(family.load)

    @functools.wraps(family.save)
    def save(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
        if ir.config.is_encoder_decoder and "encoder_decoder" not in family.supports:  # before the family's checks,
            # which speak of decoder-only models
            raise ConvertError(f"the {family.name} saver writes a decoder-only model and cannot write this one: "
                               f"{'; '.join(missing_features(ir.config, family.supports))}")
        family.save(ir, out, options, progress)

    register_saver(family.name, aliases=family.aliases, options=family.save_options, supports=family.supports)(save)
    return family


def family_of(model_type: str | None) -> HFFamily | None:
    """The family that reads config.json's `model_type` (which is also the IR family it writes, spelled with `_`
    for `-`: `megatron-bert` is IR family `megatron_bert`)."""
    wanted = str(model_type).replace("-", "_")
    return next((f for f in FAMILIES.values() if any(t.replace("-", "_") == wanted for t in f.model_types)), None)


def writer_of(ir_family: str) -> HFFamily | None:
    """The family whose saver writes IR family `ir_family`."""
    return family_of(ir_family) or next((f for f in FAMILIES.values() if ir_family in f.ir_families), None)


def not_my_family(saver: str, family: str) -> ConvertError:
    """The error of a family's saver given another family's model: it names the saver that writes that family."""
    savers()  # every family registered, not only those imported so far
    owner = writer_of(family)
    hint = (f"use --saver {owner.name} (or --saver hf, which picks it)" if owner
            else f"no Hugging Face saver writes {family} models (`mconvert plugins` lists the savers)")
    return ConvertError(f"the {saver} saver cannot write a {family} model; {hint}")


def model_types() -> list[str]:
    return sorted(t for f in FAMILIES.values() for t in f.model_types)


@register_loader("hf", aliases=("huggingface",), options=("tokenizer",))
def load(path: Path, options: Options) -> ModelIR:
    """Any Hugging Face model directory we support, by its config.json model_type."""
    root = hf_dir.resolve(path)
    model_type = hf_dir.read_json(root / "config.json").get("model_type")
    family = family_of(model_type)
    if family is None:
        raise ConvertError(f"{root / 'config.json'}: model_type {model_type!r} is not supported; the hf loader "
                           f"reads {', '.join(model_types())}")
    return family.load(root, options)


@register_saver("hf", aliases=("huggingface",), options=("max_shard_size", "tokenizer", "fp8_weights"))
def save(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    """Hugging Face directory in the model family's own format (llama_mistral, gpt2_hf, ...)."""
    family = writer_of(ir.config.family)
    if family is None:
        raise ConvertError(f"the hf saver cannot write a {ir.config.family} model yet; it writes "
                           f"{', '.join(model_types())}")
    if options.fp8_weights and "fp8_weights" not in family.save_options:
        writers = [f.name for f in FAMILIES.values() if "fp8_weights" in f.save_options]
        raise ConvertError(f"--fp8-weights: the {family.name} saver writes no FP8 weights "
                           f"({' and '.join(writers) or 'no family'} does)")
    family.save(ir, out, options, progress)
