"""Loader `core`: Megatron-core GPT checkpoints in the `torch` format, any TP / PP / VPP / EP layout.

Every rank file is opened memory-mapped through the safe unpickler (no Megatron needed, no code executed);
the pieces of each tensor across TP ranks are combined only when the tensor is asked for.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from mconvert.loaders.core_dcp import is_dcp_checkpoint, load_dcp
from mconvert.loaders.core_dist import load_dist
from mconvert.loaders.megatron_files import (
    RankFiles,
    check_layer_count,
    chunk_starts,
    find_iteration,
    first_model,
    is_dist_checkpoint,
    num_local_layers,
    tokenizer,
)
from mconvert.loaders.megatron_files import config as megatron_config

from mconvert.errors import ConvertError, format_names
from mconvert.ir import LazyTensor, LoadCache, ModelIR, SourceInfo, dtype_name
from mconvert.mapping import Row, expand, take_copies, to_ir, verify_copies
from mconvert.options import Options
from mconvert.registry import register_loader
from mconvert.rules import Ctx
from mconvert.schemas import core, core_moe

LAYER_KEY = re.compile(r"decoder\.layers\.(\d+)\.")
# Not weights: module extra state (FP8 metadata or None) and rotary frequencies Megatron recomputes.
DROP = (r".*\._extra_state", r".*rotary_pos_emb\.inv_freq")


def is_core_checkpoint(path: Path) -> bool:
    try:
        it_dir, _ = find_iteration(path)
    except ConvertError:
        return False
    if is_dist_checkpoint(it_dir) or is_dcp_checkpoint(it_dir):
        return True
    model = first_model(it_dir)  # core keys are flat (`embedding.`, `decoder.`); legacy ones nest
    return model is not None and any(k.startswith(("decoder.", "embedding.", "output_layer")) for k in model)


@register_loader("core", aliases=("megatron", "mcore"), detect=is_core_checkpoint,
                 options=("true_vocab_size", "tokenizer"))
def load(path: Path, options: Options) -> ModelIR:
    """Megatron-core GPT: `torch` (local or Transformer-Engine names), `torch_dist`, `zarr`, `torch_dcp` or
    `fsdp_dtensor`, detected."""
    it_dir, iteration = find_iteration(Path(path))
    if is_dist_checkpoint(it_dir):
        return load_dist(it_dir, iteration, options)
    if is_dcp_checkpoint(it_dir):
        return load_dcp(it_dir, iteration, options)
    files = RankFiles(it_dir)
    chunks = files.chunk_names()
    # Global layer order is chunk-major: chunk v of every stage, then chunk v+1 (see mconvert.layout).
    counts = {(pp, v): num_local_layers(files.model(0, pp, 0, name), LAYER_KEY)
              for v, name in enumerate(chunks) for pp in range(files.pp)}
    starts, total = chunk_starts(counts, files.pp, len(chunks))
    check_layer_count(files, total)
    first_model = files.model(0, 0, 0, chunks[0])
    impl = "te" if any(k.endswith("linear_qkv.layer_norm_weight") for k in first_model) else "local"
    embed_key = "embedding.word_embeddings.weight"
    if embed_key not in first_model:
        raise ConvertError(f"{files.rel((0, 0, 0))}: no {embed_key} in the first pipeline stage")
    embed = first_model[embed_key]
    padded = embed.shape[0] * files.tp
    notes: list[str] = []
    assets = tokenizer(options, it_dir, files.args, notes)
    config, config_notes = megatron_config(files.args, options, padded, dtype_name(embed.dtype), it_dir, assets)
    notes += config_notes
    expert_layout, etp = _experts(files, chunks, config, notes) if config.is_moe else (None, files.tp)
    table = core.table(impl, moe=config.is_moe, expert_layout=expert_layout or "sequential",
                       local_experts=(config.num_experts or 0) // files.ep, etp=etp)

    source: dict[str, list[LazyTensor]] = {}
    rows: list[Row] = []
    last = (files.pp - 1, len(chunks) - 1)
    for v, name in enumerate(chunks):
        for pp in range(files.pp):
            for ep in range(files.ep):
                rows += _chunk_source(files, config, table, name, pp, v, ep, starts[(pp, v)], counts[(pp, v)],
                                      (pp, v) == last, source)
    ctx = Ctx(config, padded)
    # With tied embeddings and PP > 1 the last stage keeps a copy of the embedding as output_layer.weight
    copies = take_copies(source, r".*/output_layer\.weight") if config.tie_embeddings and files.pp > 1 else []
    tensors = to_ir(source, rows, ctx, where=str(it_dir), drop=DROP, cache=LoadCache(4))
    verify_copies(tensors, "embed.weight", copies, core.TIED_OUTPUT, ctx)
    layout = {"tp": files.tp, "pp": files.pp, "vpp": len(chunks) if chunks != ["model"] else 1, "ep": files.ep,
              "stage_layers": [sum(counts[(p, v)] for v in range(len(chunks))) for p in range(files.pp)],
              "transformer_impl": impl, "padded_vocab": padded}
    if config.is_moe:
        layout |= {"etp": etp, "expert_layout": expert_layout}
    return ModelIR(config, tensors, SourceInfo("core (Megatron torch)", it_dir, layout, iteration, notes), assets)


def _experts(files: RankFiles, chunks: list[str], config, notes: list[str]) -> tuple[str | None, int]:
    """(expert layout, expert tensor-parallel size) of an MoE checkpoint, detected from its tensors."""
    if config.num_experts % files.ep:
        raise ConvertError(f"{files.it_dir}: args.expert_model_parallel_size={files.ep} does not divide "
                           f"num_experts={config.num_experts}: expert-parallel ranks must hold equal numbers of "
                           "experts")
    local = config.num_experts // files.ep
    shapes = {k: tuple(t.shape) for pp in range(files.pp) for name in chunks
              for k, t in files.model(0, pp, 0, name).items() if isinstance(t, torch.Tensor)}
    layout = core_moe.detect_layout(shapes, str(files.it_dir))
    etp = core_moe.detect_expert_tp(shapes, layout, ffn=config.ffn_hidden_size, local_experts=local,
                                    where=files.rel((0, 0, 0))) if layout else None
    etp = etp or files.tp
    if files.tp % etp:
        raise ConvertError(f"{files.it_dir}: the expert weights are split over {etp} tensor-parallel ranks, which "
                           f"does not divide the tensor-parallel size {files.tp}")
    stored = getattr(files.args, "expert_tensor_parallel_size", None)
    if stored and stored != etp:
        notes.append(f"args.expert_tensor_parallel_size is {stored} but the expert weights are split over {etp} "
                     "rank(s); using the tensors' split")
    return layout, etp


def _is_expert(row: Row) -> bool:
    return any(".moe.experts." in n for n in row.ir)


def _chunk_source(files: RankFiles, config, table, name, pp, v, ep, start, count, has_head, source) -> list[Row]:
    """Add one chunk's tensors (pieces across TP) to `source` under chunk-qualified keys; return its rows."""
    prefix = f"{files.files[(0, pp, ep)].parent.name}/{name}/"  # names TP rank 0's folder: keys agree over TP
    models = [files.model(tp, pp, ep, name) for tp in range(files.tp)]
    keys = [k for k, val in models[0].items() if isinstance(val, torch.Tensor)]
    for tp in range(1, files.tp):
        other = [k for k, val in models[tp].items() if isinstance(val, torch.Tensor)]
        if set(other) != set(keys):
            diff = sorted(set(keys) ^ set(other))
            raise ConvertError(f"{files.rel((tp, pp, ep))} and {files.rel((0, pp, ep))} hold different tensors: "
                               f"{', '.join(diff[:5])}")
    per_rank = (config.num_experts or 0) // files.ep
    rows = expand(table, config, layers=[(start + l, l) for l in range(count)],
                  experts=[(ep * per_rank + e, e) for e in range(per_rank)],
                  embedding=(pp == 0 and v == 0), head=has_head)
    if ep > 0:  # dense tensors repeat in every EP file: read them from EP rank 0, take only experts here
        dense = {r.key for r in rows if not _is_expert(r)}
        here = {k: tuple(models[0][k].shape) for k in keys if k in dense}
        ref = {k: tuple(t.shape) for k, t in files.model(0, pp, 0, name).items()
               if k in dense and isinstance(t, torch.Tensor)}
        if here != ref:
            diff = sorted(k for k in set(here) | set(ref) if here.get(k) != ref.get(k))
            raise ConvertError(f"{files.rel((0, pp, ep))} and {files.rel((0, pp, 0))} hold different dense "
                               "(non-expert) tensors, which every expert-parallel rank repeats: "
                               f"{format_names(diff, 5)}")
        rows = [r for r in rows if _is_expert(r)]
        keys = [k for k in keys if k not in dense]  # whatever is left must be this rank's experts (strict)
    for k in keys:
        source[prefix + k] = [LazyTensor.of(m[k], f"{files.rel((tp, pp, ep))}:{name}.{k}")
                              for tp, m in enumerate(models)]
    return [Row(prefix + r.key, r.ir, r.rule) for r in rows]
