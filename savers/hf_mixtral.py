"""Saver `mixtral_hf`: a Hugging Face Mixtral directory in the hub layout (what `save_pretrained` writes)."""

from __future__ import annotations

from pathlib import Path

from mconvert.ir import ModelIR
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.registry import register_saver
from mconvert.savers.hf_files import save_hf
from mconvert.schemas import hf_mixtral


@register_saver("mixtral_hf", aliases=("mixtral",), options=("max_shard_size", "tokenizer"))
def save(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    """Hugging Face Mixtral: sharded safetensors + index (one tensor per expert), config, tokenizer."""
    save_hf(ir, out, options, progress, table=hf_mixtral.TABLE, config_to_hf=hf_mixtral.config_to_hf,
            where="saver mixtral_hf")
