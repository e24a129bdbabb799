"""Loader `mixtral_hf`: Hugging Face Mixtral directories (or hub ids), hub layout or transformers 5's fused one."""

from __future__ import annotations

from pathlib import Path

from mconvert.formats import hf_dir
from mconvert.ir import ModelIR
from mconvert.loaders.hf_files import load_hf
from mconvert.options import Options
from mconvert.registry import register_loader
from mconvert.schemas import hf_mixtral


def _is_mixtral(path: Path) -> bool:
    return hf_dir.is_hf_dir(path, (hf_mixtral.MODEL_TYPE,))


@register_loader("mixtral_hf", aliases=("mixtral",), detect=_is_mixtral, options=("tokenizer",))
def load(path: Path, options: Options) -> ModelIR:
    """Hugging Face Mixtral (MixtralForCausalLM): safetensors or .bin, sharded or not."""
    def fused(source) -> bool:
        return hf_mixtral.FUSED_MARKER in source

    return load_hf(path, options, name="mixtral_hf", config_from_hf=hf_mixtral.config_from_hf,
                   table=lambda source: hf_mixtral.FUSED if fused(source) else hf_mixtral.TABLE,
                   embed_key="model.embed_tokens.weight", drop=hf_mixtral.DROP,
                   layout=lambda source: {"experts": "fused (transformers 5 in-memory names)" if fused(source)
                                          else "one tensor per expert"})
