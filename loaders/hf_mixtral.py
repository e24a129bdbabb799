"""Loader `mixtral_hf`: Hugging Face Mixtral directories (or hub ids), hub layout or transformers 5's fused one."""

from __future__ import annotations

from pathlib import Path

from formats import hf_dir
from mconvert.ir import ModelIR, SourceInfo, dtype_name
from mconvert.mapping import expand, to_ir
from mconvert.options import Options
from mconvert.registry import register_loader
from mconvert.rules import Ctx
from mconvert.schemas import hf_mixtral


def _is_mixtral(path: Path) -> bool:
    return hf_dir.is_hf_dir(path, (hf_mixtral.MODEL_TYPE,))


@register_loader("mixtral_hf", aliases=("mixtral",), detect=_is_mixtral, options=("tokenizer",))
def load(path: Path, options: Options) -> ModelIR:
    """Hugging Face Mixtral (MixtralForCausalLM): safetensors or .bin, sharded or not."""
    root = hf_dir.resolve(path)
    config = hf_mixtral.config_from_hf(hf_dir.read_json(root / "config.json"), str(root / "config.json"))
    source = hf_dir.open_weights(root)
    if "model.embed_tokens.weight" in source:
        config = config.replace(dtype=dtype_name(source["model.embed_tokens.weight"].dtype))
    fused = hf_mixtral.FUSED_MARKER in source
    drop = hf_mixtral.DROP + (("lm_head\\.weight",) if config.tie_embeddings else ())
    rows = expand(hf_mixtral.FUSED if fused else hf_mixtral.TABLE, config)
    tensors = to_ir({k: [v] for k, v in source.items()}, rows, Ctx(config, config.vocab_size), where=str(root),
                    drop=drop)
    assets = hf_dir.tokenizer_files(options.tokenizer or root)
    layout = {"experts": "fused (transformers 5 in-memory names)" if fused else "one tensor per expert"}
    return ModelIR(config, tensors, SourceInfo("mixtral_hf (Hugging Face)", root, layout), assets)
