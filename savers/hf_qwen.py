"""Saver `qwen_hf`: a Hugging Face Qwen2, Qwen3 or Qwen3-MoE directory (by the model's family), hub layout."""

from __future__ import annotations

from pathlib import Path

from mconvert.ir import ModelIR
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.registry import register_saver
from mconvert.savers.hf_files import save_hf
from mconvert.schemas import hf_qwen


@register_saver("qwen_hf", aliases=("qwen",), options=("max_shard_size", "tokenizer"))
def save(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    """Hugging Face Qwen2 / Qwen3 / Qwen3-MoE: sharded safetensors + index, config, generation config, tokenizer."""
    save_hf(ir, out, options, progress, table=hf_qwen.TABLE, config_to_hf=hf_qwen.config_to_hf,
            where="saver qwen_hf")
