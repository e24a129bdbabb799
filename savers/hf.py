"""Saver `hf`: a Hugging Face directory for any supported model, written by its family's saver.

To support another family, register its saver and add the IR family to `SAVERS`.
"""

from __future__ import annotations

from pathlib import Path

from mconvert.errors import ConvertError
from mconvert.ir import ModelIR
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.registry import get_saver, register_saver

# IR family (ModelConfig.family) -> the saver that writes it
SAVERS = {
    "llama": "llama_mistral",
    "mistral": "llama_mistral",
    "gpt2": "gpt2_hf",
    "mixtral": "mixtral_hf",
    "qwen2": "qwen_hf", "qwen3": "qwen_hf", "qwen3_moe": "qwen_hf",
    "deepseek_v3": "deepseek_hf",
    "deepseek_v2": "deepseek_hf",
}


@register_saver("hf", aliases=("huggingface",), options=("max_shard_size", "tokenizer", "fp8_weights"))
def save(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    """Hugging Face directory in the model family's own format (llama_mistral, gpt2_hf, ...)."""
    family = ir.config.family
    if family not in SAVERS:
        raise ConvertError(f"the hf saver cannot write a {family} model yet; it writes {', '.join(sorted(SAVERS))}")
    if options.fp8_weights and "fp8_weights" not in get_saver(SAVERS[family]).options:
        raise ConvertError(f"--fp8-weights: the {SAVERS[family]} saver writes no FP8 weights (deepseek_hf does)")
    get_saver(SAVERS[family]).func(ir, out, options, progress)
