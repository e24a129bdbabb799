"""Saver `llama_mistral`: a Hugging Face Llama/Mistral directory that `from_pretrained` loads as is."""

from __future__ import annotations

from pathlib import Path

from formats import hf_dir
from formats.safetensors_io import Entry
from mconvert.ir import ModelConfig, ModelIR
from mconvert.mapping import expand, from_ir
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.registry import register_saver
from mconvert.rules import Ctx
from mconvert.schemas import hf_llama


@register_saver("llama_mistral", aliases=("llama", "mistral"), options=("max_shard_size", "tokenizer", "dtype"))
def save(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    """Sharded safetensors + index, config.json, generation_config.json and the tokenizer files."""
    config = with_token_ids(ir, options)
    hf_config = hf_llama.config_to_hf(config)
    ctx = Ctx(config, config.vocab_size)
    plan = {p.key: p for p in from_ir(ir, expand(hf_llama.TABLE, config), ctx)}
    entries = [Entry(p.key, p.shape, p.dtype) for p in plan.values()]
    hf_dir.write_weights(out, entries, lambda e: plan[e.name].produce(ir, ctx), options.max_shard_size, progress)
    hf_dir.write_json(out / "config.json", hf_config)
    hf_dir.write_json(out / "generation_config.json", hf_llama.generation_config(config))
    write_tokenizer(ir, out, options, progress)


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
