"""What the Hugging Face savers share: one function writes weights, config, generation config and tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from mconvert.formats import hf_dir
from mconvert.formats.safetensors_io import Entry

from mconvert import fp8 as mfp8
from mconvert.ir import ModelConfig, ModelIR
from mconvert.mapping import check_plan, expand, from_ir
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.rules import Ctx, Table
from mconvert.schemas.hf_common import generation_config


def save_hf(ir: ModelIR, out: Path, options: Options, progress: Progress, *, table: Table,
            config_to_hf: Callable[[ModelConfig], dict[str, Any]], where: str,
            fp8: Callable[[str], bool] | None = None) -> None:
    """Sharded safetensors (+ index), config.json, generation_config.json and the tokenizer files.

    `config_to_hf` runs first, so a model the family cannot express is refused before anything is written. The
    weights `fp8` picks are written FP8 block-quantized (see mconvert.fp8), each with its `weight_scale_inv`.
    """
    config = with_token_ids(ir, options)
    hf_config = config_to_hf(config)
    ctx = Ctx(config, config.vocab_size)
    rows = expand(table, config)
    check_plan(ir.tensors, [("model", rows)], where=where)
    plan = {p.key: p for p in from_ir(ir, rows, ctx)}
    entries, produce = _entries(plan, lambda key: plan[key].produce(ir, ctx), fp8)
    hf_dir.write_weights(out, entries, produce, options.max_shard_size, progress)
    hf_dir.write_json(out / "config.json", hf_config)
    hf_dir.write_json(out / "generation_config.json", generation_config(config))
    write_tokenizer(ir, out, options, progress)


def _entries(plan: dict, tensor: Callable[[str], Any], fp8: Callable[[str], bool] | None):
    """The safetensors entries and the function producing each: a quantized weight is quantized once, its
    `weight_scale_inv` (the next entry) taken from that."""
    entries, pending = [], {}
    for key, p in plan.items():
        if fp8 is not None and fp8(key):
            entries += [Entry(key, p.shape, mfp8.FP8), Entry(key + mfp8.SCALE_SUFFIX, mfp8.scale_shape(p.shape),
                                                             torch.float32)]
        else:
            entries.append(Entry(key, p.shape, p.dtype))

    def produce(e: Entry):
        if e.name.endswith(mfp8.SCALE_SUFFIX) and e.name[:-len(mfp8.SCALE_SUFFIX)] in pending:
            return pending.pop(e.name[:-len(mfp8.SCALE_SUFFIX)])[1]
        if e.dtype == mfp8.FP8:
            pending[e.name] = mfp8.quantize(tensor(e.name))
            return pending[e.name][0]
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
