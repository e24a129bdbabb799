"""Saver `gpt2_hf`: a Hugging Face GPT-2 directory that `from_pretrained` loads and `generate()` runs."""

from __future__ import annotations

from pathlib import Path

from mconvert.ir import ModelIR
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.registry import register_saver
from mconvert.savers.hf_files import save_hf
from mconvert.schemas import hf_gpt2


@register_saver("gpt2_hf", aliases=("gpt2",), options=("max_shard_size", "tokenizer"))
def save(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    """Hugging Face GPT-2 (GPT2LMHeadModel): safetensors with Conv1D [in, out] weights, config, tokenizer."""
    save_hf(ir, out, options, progress, table=hf_gpt2.TABLE, config_to_hf=hf_gpt2.config_to_hf,
            where="saver gpt2_hf")
