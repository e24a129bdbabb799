"""What the Hugging Face savers share: one function writes weights, config, generation config and tokenizer."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mconvert import fp8 as mfp8
from mconvert import workers
from mconvert.blocks import Blocks
from mconvert.formats import hf_dir
from mconvert.formats.safetensors_io import Entry
from mconvert.ir import ModelConfig, ModelIR
from mconvert.mapping import check_plan, expand, from_ir
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.row_plan import RowPlanner
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
    planner = RowPlanner(ctx)
    entries, produce = _entries(plan, lambda key: plan[key].produce(ir, planner), fp8)
    jobs, index = hf_dir.weight_jobs(out, entries, produce, options.max_shard_size,
                                     parallel=workers.slots(options.workers))

    def finish(_) -> None:
        if index is not None:
            hf_dir.write_json(out / hf_dir.SAFE_INDEX, index)
        hf_dir.write_json(out / "config.json", hf_config)
        hf_dir.write_json(out / "generation_config.json", generation_config(config))
        write_tokenizer(ir, out, options, progress)

    workers.run(jobs, workers=options.workers, progress=progress, finish=finish)


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
        if e.dtype == mfp8.FP8:
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
