"""Saver `gpt2_hf`: a Hugging Face GPT-2 directory that `from_pretrained` loads and `generate()` runs."""

from __future__ import annotations

from pathlib import Path

from formats import hf_dir
from formats.safetensors_io import Entry
from mconvert.ir import ModelIR
from mconvert.mapping import expand, from_ir
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.registry import register_saver
from mconvert.rules import Ctx
from mconvert.schemas import hf_gpt2, hf_llama
from savers.hf_llama import with_token_ids, write_tokenizer


@register_saver("gpt2_hf", aliases=("gpt2",), options=("max_shard_size", "tokenizer", "dtype"))
def save(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    """Safetensors (Conv1D [in, out] weights), config.json, generation_config.json and the tokenizer files."""
    config = with_token_ids(ir, options)
    hf_config = hf_gpt2.config_to_hf(config)  # refuses models GPT-2 cannot express before writing anything
    ctx = Ctx(config, config.vocab_size)
    plan = {p.key: p for p in from_ir(ir, expand(hf_gpt2.TABLE, config), ctx)}
    entries = [Entry(p.key, p.shape, p.dtype) for p in plan.values()]
    hf_dir.write_weights(out, entries, lambda e: plan[e.name].produce(ir, ctx), options.max_shard_size, progress)
    hf_dir.write_json(out / "config.json", hf_config)
    hf_dir.write_json(out / "generation_config.json", hf_llama.generation_config(config))
    write_tokenizer(ir, out, options, progress)
