"""Saver `mixtral_hf`: a Hugging Face Mixtral directory in the hub layout (what `save_pretrained` writes)."""

from __future__ import annotations

from pathlib import Path

from formats import hf_dir
from formats.safetensors_io import Entry
from mconvert.ir import ModelIR
from mconvert.mapping import check_plan, expand, from_ir
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.registry import register_saver
from mconvert.rules import Ctx
from mconvert.schemas import hf_llama, hf_mixtral
from savers.hf_llama import with_token_ids, write_tokenizer


@register_saver("mixtral_hf", aliases=("mixtral",), options=("max_shard_size", "tokenizer", "dtype"))
def save(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    """Sharded safetensors + index (one tensor per expert), config.json, generation_config.json, tokenizer."""
    config = with_token_ids(ir, options)
    hf_config = hf_mixtral.config_to_hf(config)
    ctx = Ctx(config, config.vocab_size)
    rows = expand(hf_mixtral.TABLE, config)
    check_plan(ir.tensors, [("model", rows)], where="saver mixtral_hf")
    plan = {p.key: p for p in from_ir(ir, rows, ctx)}
    entries = [Entry(p.key, p.shape, p.dtype) for p in plan.values()]
    hf_dir.write_weights(out, entries, lambda e: plan[e.name].produce(ir, ctx), options.max_shard_size, progress)
    hf_dir.write_json(out / "config.json", hf_config)
    hf_dir.write_json(out / "generation_config.json", hf_llama.generation_config(config))
    write_tokenizer(ir, out, options, progress)
