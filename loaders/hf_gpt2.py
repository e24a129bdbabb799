"""Loader `gpt2_hf`: Hugging Face GPT-2 directories (or hub ids), safetensors or pytorch_model*.bin."""

from __future__ import annotations

from pathlib import Path

from mconvert.formats import hf_dir
from mconvert.ir import LazyTensor, ModelIR
from mconvert.loaders.hf_files import load_hf
from mconvert.options import Options
from mconvert.registry import register_loader
from mconvert.schemas import hf_gpt2

PREFIX = "transformer."


def is_gpt2_dir(path: Path) -> bool:
    return hf_dir.is_hf_dir(Path(path), (hf_gpt2.MODEL_TYPE,))


def with_prefix(source: dict[str, LazyTensor]) -> dict[str, LazyTensor]:
    """A bare `GPT2Model` (e.g. the original `gpt2` upload) saves `wte.weight`, `h.0...`: add `transformer.`."""
    if any(k.startswith(PREFIX) for k in source):
        return source
    return {k if k.startswith("lm_head.") else PREFIX + k: v for k, v in source.items()}


@register_loader("gpt2_hf", aliases=("gpt2",), detect=is_gpt2_dir, options=("tokenizer",))
def load(path: Path, options: Options) -> ModelIR:
    """Hugging Face GPT-2 (GPT2LMHeadModel or GPT2Model weights; safetensors or .bin, sharded or not)."""
    return load_hf(path, options, name="gpt2_hf", config_from_hf=hf_gpt2.config_from_hf, table=hf_gpt2.TABLE,
                   embed_key="transformer.wte.weight", drop=hf_gpt2.DROP, fix_source=with_prefix)
