"""Loader `qwen_hf`: Hugging Face Qwen2 / Qwen2.5, Qwen3 and Qwen3-MoE directories (or hub ids); experts in the hub
layout or transformers 5's fused one."""

from __future__ import annotations

from pathlib import Path

from mconvert.formats import hf_dir
from mconvert.ir import ModelIR
from mconvert.loaders.hf_files import load_hf
from mconvert.options import Options
from mconvert.registry import register_loader
from mconvert.schemas import hf_qwen


def _is_qwen(path: Path) -> bool:
    return hf_dir.is_hf_dir(path, tuple(hf_qwen.ARCHITECTURES))


@register_loader("qwen_hf", aliases=("qwen",), detect=_is_qwen, options=("tokenizer",))
def load(path: Path, options: Options) -> ModelIR:
    """Hugging Face Qwen2/2.5, Qwen3, Qwen3-MoE: safetensors or .bin, sharded or not."""
    def fused(source) -> bool:
        return any(k.endswith(hf_qwen.FUSED_SUFFIX) for k in source)

    return load_hf(path, options, name="qwen_hf", config_from_hf=hf_qwen.config_from_hf,
                   table=lambda source: hf_qwen.FUSED if fused(source) else hf_qwen.TABLE,
                   embed_key="model.embed_tokens.weight", drop=hf_qwen.DROP,
                   layout=lambda source: {"experts": "fused (transformers 5 in-memory names)"} if fused(source) else {})
