"""Saver `deepseek_hf`: a Hugging Face DeepSeek-V3 directory in DeepSeek's own layout (interleaved rotary rows,
one tensor per expert, MTP layers after the last layer with their copies of the embedding and head)."""

from __future__ import annotations

from pathlib import Path

from mconvert import fp8
from mconvert.ir import ModelIR
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.registry import register_saver
from mconvert.savers.hf_files import save_hf
from mconvert.schemas import hf_deepseek


@register_saver("deepseek_hf", aliases=("deepseek", "deepseek_v3"),
                options=("max_shard_size", "tokenizer", "fp8_weights"))
def save(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    """Hugging Face DeepSeek-V3: sharded safetensors + index, config, tokenizer; FP8 weights with --fp8-weights."""
    def config_to_hf(c):
        return hf_deepseek.config_to_hf(c) | ({"quantization_config": fp8.QUANTIZATION_CONFIG}
                                              if options.fp8_weights else {})

    save_hf(ir, out, options, progress, table=hf_deepseek.SAVE_TABLE, config_to_hf=config_to_hf,
            where="saver deepseek_hf", fp8=hf_deepseek.is_fp8_weight if options.fp8_weights else None)
