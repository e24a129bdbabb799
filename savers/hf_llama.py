"""Saver `llama_mistral`: a Hugging Face Llama/Mistral directory that `from_pretrained` loads as is."""

from __future__ import annotations

from pathlib import Path

from mconvert.ir import ModelIR
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.registry import register_saver
from mconvert.savers.hf_files import save_hf
from mconvert.schemas import hf_llama


@register_saver("llama_mistral", aliases=("llama", "mistral"), options=("max_shard_size", "tokenizer"))
def save(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    """Hugging Face Llama / Mistral: sharded safetensors + index, config, generation config, tokenizer."""
    save_hf(ir, out, options, progress, table=hf_llama.TABLE, config_to_hf=hf_llama.config_to_hf,
            where="saver llama_mistral")
