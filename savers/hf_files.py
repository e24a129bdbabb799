"""What the Hugging Face savers share: one function writes weights, config, generation config and tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from mconvert.formats import hf_dir
from mconvert.formats.safetensors_io import Entry

from mconvert import workers
from mconvert.ir import ModelConfig, ModelIR
from mconvert.mapping import check_plan, expand, from_ir
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.row_plan import RowPlanner
from mconvert.rules import Ctx, Table
from mconvert.schemas.hf_common import generation_config


def save_hf(ir: ModelIR, out: Path, options: Options, progress: Progress, *, table: Table,
            config_to_hf: Callable[[ModelConfig], dict[str, Any]], where: str) -> None:
    """Sharded safetensors (+ index), config.json, generation_config.json and the tokenizer files.

    `config_to_hf` runs first, so a model the family cannot express is refused before anything is written.
    """
    config = with_token_ids(ir, options)
    hf_config = config_to_hf(config)
    ctx = Ctx(config, config.vocab_size)
    rows = expand(table, config)
    check_plan(ir.tensors, [("model", rows)], where=where)
    plan = {p.key: p for p in from_ir(ir, rows, ctx)}
    entries = [Entry(p.key, p.shape, p.dtype) for p in plan.values()]
    planner = RowPlanner(ctx)
    jobs, index = hf_dir.weight_jobs(out, entries, lambda e: plan[e.name].produce(ir, planner),
                                     options.max_shard_size, parallel=workers.slots(options.workers))

    def finish(_) -> None:
        if index is not None:
            hf_dir.write_json(out / hf_dir.SAFE_INDEX, index)
        hf_dir.write_json(out / "config.json", hf_config)
        hf_dir.write_json(out / "generation_config.json", generation_config(config))
        write_tokenizer(ir, out, options, progress)

    workers.run(jobs, workers=options.workers, progress=progress, finish=finish)


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
