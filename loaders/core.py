"""Loader `core`: Megatron-core GPT checkpoints in the `torch` format, any TP / PP / VPP / EP layout.

Every rank file is opened memory-mapped through the safe unpickler (no Megatron needed, no code executed);
the pieces of each tensor across TP ranks are combined only when the tensor is asked for.
"""

from __future__ import annotations

import re
from pathlib import Path

from mconvert.blocks import Blocks
from mconvert.errors import ConvertError
from mconvert.ir import LazyTensor, LoadCache, ModelIR, SourceInfo, dtype_name
from mconvert.lazy import torch
from mconvert.loaders.core_dcp import is_dcp_checkpoint, load_dcp
from mconvert.loaders.core_dist import load_dist
from mconvert.loaders.megatron_files import (
    RankFiles,
    chunks_in_files,
    find_iteration,
    first_model,
    has_markers,
    is_dist_checkpoint,
    read_parts,
    tokenizer,
)
from mconvert.loaders.megatron_files import config as megatron_config
from mconvert.mapping import to_ir, verify_copies
from mconvert.options import Options
from mconvert.registry import register_loader
from mconvert.rules import Ctx
from mconvert.schemas import core, core_deepseek, core_moe, rank_plan

LAYER_KEY = re.compile(r"decoder\.layers\.(\d+)\.")
# Not weights: module extra state (FP8 metadata or None) and rotary frequencies Megatron recomputes.
DROP = (r".*\._extra_state", r".*rotary_pos_emb\.inv_freq")


def is_core_checkpoint(path: Path) -> bool:
    if not has_markers(path):
        return False
    it_dir, _ = find_iteration(path)  # a broken tracker file is reported (see registry.detect_loader)
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

    def tensors_of(tp: int, pp: int, ep: int, entry: str) -> dict[str, LazyTensor]:
        idx = (tp, pp, ep)
        out: dict[str, LazyTensor] = {}
        for k, v in files.model(tp, pp, ep, entry).items():
            if not isinstance(v, torch.Tensor):
                continue
            # megatron-core 0.19 stores an MTP module's layer as mtp_model_layer: read under the table's one name
            key = core_deepseek.mtp_layer_named(k, "transformer_layer")
            if key in out:
                names = sorted({key, core_deepseek.mtp_layer_named(key, "mtp_model_layer")})
                raise ConvertError(f"{files.rel(idx)}: {entry} holds both {names[1]} and {names[0]} (one MTP layer "
                                   f"under both of megatron-core's names)")
            out[key] = LazyTensor(tuple(v.shape), v.dtype, lambda v=v: v, f"{files.rel(idx)}:{entry}.{k}",
                                  lambda v=v: Blocks.of(v, files.source(idx, v)))
        return out

    chunks = chunks_in_files(files, LAYER_KEY, tensors_of)
    names = files.chunk_names()
    first_model = files.model(0, 0, 0, names[0])
    impl = "te" if any(k.endswith(("linear_qkv.layer_norm_weight", "linear_kv_up_proj.layer_norm_weight"))
                       for k in first_model) else "local"
    embed_key = "embedding.word_embeddings.weight"
    if embed_key not in first_model:
        raise ConvertError(f"{files.rel((0, 0, 0))}: no {embed_key} in the first pipeline stage")
    embed = first_model[embed_key]
    padded = embed.shape[0] * files.tp
    notes: list[str] = []
    assets = tokenizer(options, it_dir, files.args, notes)
    config, config_notes = megatron_config(files.args, options, padded, dtype_name(embed.dtype), it_dir, assets)
    notes += config_notes
    expert_layout, etp = _experts(files, names, config, notes) if config.is_moe else (None, files.tp)
    ctx = Ctx(config, padded, tp=files.tp, etp=etp, local_experts=(config.num_experts or 0) // files.ep)
    parts = rank_plan.plan(core.table(impl, expert_layout or "sequential", config.is_mla), config, chunks,
                           ep=files.ep, entry_names=names, tied_copy=core.TIED_OUTPUT, embed_copy=core.MTP_EMBEDDING)
    source, rows, copies = read_parts(files, parts, tensors_of)
    tensors = to_ir(source, rows, ctx, where=str(it_dir), drop=DROP, cache=LoadCache(4))
    verify_copies(tensors, "embed.weight", copies, core.TIED_OUTPUT, ctx,
                  kept_for="the MTP modules" if config.mtp_layers else "the tied output layer")
    layout = {"tp": files.tp, "pp": files.pp, "vpp": len(names) if names != ["model"] else 1, "ep": files.ep,
              "stage_layers": [sum(len(c.layers) for c in chunks if c.pp == p) for p in range(files.pp)],
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
    etp = core_moe.detect_expert_tp(shapes, layout, ffn=config.expert_ffn_hidden_size, local_experts=local,
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
