"""Loader `hf`: any supported Hugging Face causal LM, handed to its family's loader by config.json's model_type.

To support another family, register its loader and add its model_type to `LOADERS`.
"""

from __future__ import annotations

from pathlib import Path

from mconvert.errors import ConvertError
from mconvert.formats import hf_dir
from mconvert.ir import ModelIR
from mconvert.options import Options
from mconvert.registry import get_loader, register_loader

# config.json model_type -> the loader that reads it
LOADERS = {
    "llama": "llama_mistral",
    "mistral": "llama_mistral",
    "gpt2": "gpt2_hf",
    "mixtral": "mixtral_hf",
    "qwen2": "qwen_hf", "qwen3": "qwen_hf", "qwen3_moe": "qwen_hf",
    "deepseek_v3": "deepseek_hf",
    "deepseek_v2": "deepseek_hf",
}


@register_loader("hf", aliases=("huggingface",), options=("tokenizer",))
def load(path: Path, options: Options) -> ModelIR:
    """Any Hugging Face model directory we support, by its config.json model_type."""
    root = hf_dir.resolve(path)
    model_type = hf_dir.read_json(root / "config.json").get("model_type")
    if model_type not in LOADERS:
        raise ConvertError(f"{root / 'config.json'}: model_type {model_type!r} is not supported; the hf loader "
                           f"reads {', '.join(sorted(LOADERS))}")
    return get_loader(LOADERS[model_type]).func(root, options)
