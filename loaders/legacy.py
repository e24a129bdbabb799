"""Loader `legacy`: Megatron-LM legacy GPT checkpoints (nested `language_model` dicts), any TP / PP / VPP.

GPT-2 style (LayerNorm, GELU, learned positions, biases, tied output) and Llama style (RMSNorm, SwiGLU, RoPE,
GQA, untied output) alike, both naming generations, every `checkpoint_version` (its QKV row order). Files go
through the safe unpickler (args pickled as argparse or SimpleNamespace with Megatron enums inside).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mconvert.errors import ConvertError
from mconvert.ir import LazyTensor, LoadCache, ModelIR, SourceInfo, dtype_name
from mconvert.lazy import torch
from mconvert.loaders.megatron_files import (
    RankFiles,
    chunks_in_files,
    find_iteration,
    first_model,
    read_parts,
    tokenizer,
)
from mconvert.loaders.megatron_files import config as megatron_config
from mconvert.mapping import to_ir, verify_copies
from mconvert.options import Options
from mconvert.registry import register_loader
from mconvert.rules import Ctx
from mconvert.schemas import legacy, rank_plan


def is_legacy_checkpoint(path: Path) -> bool:
    """Legacy files nest their weights under `language_model` (core's keys are flat: `decoder.`, `embedding.`)."""
    model = first_model(path)
    return model is not None and any(k == "language_model" or k.startswith("language_model.") for k in model)


@register_loader("legacy", aliases=("megatron_legacy",), detect=is_legacy_checkpoint,
                 options=("true_vocab_size", "tokenizer"))
def load(path: Path, options: Options) -> ModelIR:
    """Megatron-LM legacy GPT (nested language_model dicts), GPT-2 or Llama style, any checkpoint_version."""
    it_dir, iteration = find_iteration(Path(path))
    files = RankFiles(it_dir)
    order, version = _qkv_order(files)
    names = files.chunk_names()
    cached: dict[tuple[int, int, str], dict[str, LazyTensor]] = {}

    def tensors_of(tp: int, pp: int, ep: int, entry: str) -> dict[str, LazyTensor]:
        if (tp, pp, entry) not in cached:
            cached[(tp, pp, entry)] = _canonical_tensors(files, tp, pp, entry)
        return cached[(tp, pp, entry)]

    chunks = chunks_in_files(files, legacy.LAYER_KEY, tensors_of)
    embed_key = f"{legacy.EMBEDDING}.word_embeddings.weight"
    first = tensors_of(0, 0, 0, names[0])
    if embed_key not in first:
        raise ConvertError(f"{files.rel((0, 0, 0))}: no model.{embed_key} in the first pipeline stage")
    padded = first[embed_key].shape[0] * files.tp
    notes: list[str] = []
    assets = tokenizer(options, it_dir, files.args, notes)
    config, config_notes = megatron_config(files.args, options, padded, dtype_name(first[embed_key].dtype), it_dir,
                                           assets)
    notes += config_notes
    if order < 2 and config.num_query_groups != config.num_attention_heads:
        raise ConvertError(f"{files.rel((0, 0, 0))}: checkpoint_version {version} predates grouped-query attention, "
                           f"but the args say num_query_groups={config.num_query_groups}")
    ctx = Ctx(config, padded, tp=files.tp, qkv_version=order)
    parts = rank_plan.plan(legacy.TABLE, config, chunks, ep=1, entry_names=names, tied_copy=legacy.TIED_HEAD)
    # With tied embeddings the last stage may keep its own copy for the head: Megatron writes it when that stage
    # lacks the embedding (PP > 1); HF's script writes it at PP 1 too. Copies are checked against the embedding.
    source, rows, copies = read_parts(files, parts, tensors_of,
                                      extra_copy_key=legacy.TIED_HEAD_KEY if config.tie_embeddings else None)
    tensors = to_ir(source, rows, ctx, where=str(it_dir), drop=legacy.DROP, cache=LoadCache(4))
    verify_copies(tensors, "embed.weight", copies, legacy.TIED_HEAD, ctx)
    layout = {"tp": files.tp, "pp": files.pp, "vpp": len(names) if names != ["model"] else 1,
              "stage_layers": [sum(len(c.layers) for c in chunks if c.pp == p) for p in range(files.pp)],
              "checkpoint_version": version, "padded_vocab": padded}
    return ModelIR(config, tensors, SourceInfo("legacy (Megatron-LM legacy GPT)", it_dir, layout, iteration, notes),
                   assets)


def _qkv_order(files: RankFiles) -> tuple[int, Any]:
    """The checkpoint_version every rank file carries (they must agree) and the QKV order it implies."""
    versions = {idx: state.get("checkpoint_version", 0) for idx, state in files.states.items()}
    first = versions[(0, 0, 0)]
    for idx, value in versions.items():
        legacy.check_version(value, str(files.files[idx]))
        if value != first:
            raise ConvertError(f"{files.files[idx]}: checkpoint_version {value!r}, but {files.rel((0, 0, 0))} has "
                               f"{first!r}; the rank files come from different checkpoints")
    return legacy.check_version(first, str(files.files[(0, 0, 0)])), first


def _canonical_tensors(files: RankFiles, tp: int, pp: int, name: str) -> dict[str, LazyTensor]:
    """One rank file's tensors under the names we write (any naming generation), each remembering its origin."""
    model = files.model(tp, pp, 0, name)
    if not isinstance(model, dict):
        raise ConvertError(f"{files.rel((tp, pp, 0))}: {name!r} is a {type(model).__name__}, expected a dict")
    out: dict[str, LazyTensor] = {}
    for key, value in legacy.flatten(model).items():
        if not isinstance(value, torch.Tensor):
            continue  # `_extra_state` None and the like
        canon = legacy.canonical(key)
        if canon in out:
            raise ConvertError(f"{files.rel((tp, pp, 0))}: {key} and {out[canon].origin.rsplit(':', 1)[1]} name "
                               "the same tensor (two naming generations mixed in one file)")
        out[canon] = LazyTensor.of(value, f"{files.rel((tp, pp, 0))}:{name}.{key}")
    return out
