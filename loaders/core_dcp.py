"""Megatron-LM `torch_dcp` and `fsdp_dtensor` checkpoints (see mconvert.schemas.core_dcp), read by `core`."""

from __future__ import annotations

import re
from pathlib import Path

from mconvert.errors import ConvertError
from mconvert.ir import LazyTensor, LoadCache, ModelIR, SourceInfo, dtype_name
from mconvert.mapping import to_ir
from mconvert.options import Options
from mconvert.rules import Ctx
from mconvert.schemas import core_dcp, core_moe

# Not weights: module extra state (FP8 metadata or None) and rotary frequencies Megatron recomputes.
DROP = (r"model\..*\._extra_state", r"model\..*rotary_pos_emb\.inv_freq")


def is_dcp_checkpoint(it_dir: Path) -> bool:
    """A torch.distributed.checkpoint directory that is neither torch_dist (metadata.json) nor mtrain's."""
    return (it_dir / ".metadata").is_file() and not (it_dir / "metadata.json").is_file() \
        and not (it_dir / "mtrain.json").is_file()


def load_dcp(it_dir: Path, iteration: int | None, options: Options) -> ModelIR:
    from mconvert.formats.dcp import DcpReader
    from mconvert.loaders.megatron_files import config as megatron_config
    from mconvert.loaders.megatron_files import tokenizer

    store = DcpReader(it_dir)
    if core_dcp.ARGS not in store.bytes_items:
        raise ConvertError(f"{it_dir}: a torch.distributed.checkpoint directory without Megatron's `args` entry and "
                           "without metadata.json: neither a Megatron torch_dcp/fsdp_dtensor checkpoint nor a "
                           "complete torch_dist one (whose metadata.json would be missing)")
    args = store.read_object(core_dcp.ARGS)
    chunks = sorted({m.group(0) for k in store.tensors if (m := re.match(r"model\d+\.", k))})
    if chunks:
        raise ConvertError(f"{it_dir}: virtual pipeline chunks ({', '.join(chunks)}) in a {args.ckpt_format} "
                           "checkpoint: their layer numbers are local to each chunk; not supported")
    prefixes = {core_dcp.model_prefix(k) for k in store.tensors} - {None}
    if len(prefixes) != 1:
        raise ConvertError(f"{it_dir}: expected the model's tensors under one prefix ({core_dcp.PREFIX}, with any "
                           f"number of `{core_dcp.WRAPPER}` wrappers); found {sorted(prefixes) or 'none'}")
    [prefix] = prefixes
    model = {k: entry for k, entry in store.tensors.items() if k.startswith(core_dcp.PREFIX)}
    embed = model.get(prefix + "embedding.word_embeddings.weight")
    if embed is None:
        raise ConvertError(f"{it_dir}: no {prefix}embedding.word_embeddings.weight in the checkpoint")
    padded = embed.shape[0]
    notes: list[str] = []
    assets = tokenizer(options, it_dir, args, notes)
    config, config_notes = megatron_config(args, options, padded, dtype_name(embed.dtype), it_dir, assets)
    if config.mtp_layers:
        raise ConvertError(f"{it_dir}: a {args.ckpt_format} checkpoint with multi-token-prediction modules "
                           f"(args.mtp_num_layers {config.mtp_layers}) is not read: their keys in this format are "
                           "unchecked")
    notes += config_notes
    impl = core_dcp.detect_impl(model)
    unprefixed = [k.removeprefix(prefix) for k in model]
    expert_layout = core_moe.detect_layout(unprefixed, str(it_dir)) if config.is_moe else None
    if expert_layout not in (None, *core_dcp.EXPERT_LAYOUTS):
        raise ConvertError(f"{it_dir}: {expert_layout} experts in a DCP checkpoint; expected "
                           f"{' or '.join(core_dcp.EXPERT_LAYOUTS)}")
    split = core_dcp.has_halves(model)
    rows = core_dcp.rows(config, impl, expert_layout or "sequential", split_swiglu=split, prefix=prefix)
    source = {k: [LazyTensor(tuple(e.shape), e.dtype, lambda k=k: store.read(k), f"{it_dir.name}:{k}")]
              for k, e in model.items()}
    tensors = to_ir(source, rows, Ctx(config, padded), where=str(it_dir), drop=DROP, cache=LoadCache(4))
    fmt = args.ckpt_format if getattr(args, "ckpt_format", None) in core_dcp.FORMATS else \
        "fsdp_dtensor" if split else "torch_dcp"
    layout = {"format": fmt, "padded_vocab": padded, "transformer_impl": impl, "swiglu_halves": split,
              "prefix": prefix}
    if expert_layout:
        layout["expert_layout"] = expert_layout
    others = sorted({k.split(".", 1)[0] for k in [*store.tensors, *store.bytes_items]} -
                    {"model", core_dcp.ARGS, core_dcp.CHECKPOINT_VERSION_KEY, core_dcp.ITERATION_KEY,
                     core_dcp.FLOPS_KEY})
    if others:
        notes.append(f"training state not converted: {', '.join(others)}")
    return ModelIR(config, tensors, SourceInfo(f"core (Megatron {fmt})", it_dir, layout, iteration, notes), assets)
