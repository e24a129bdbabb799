"""Loader `gpt2_hf`: Hugging Face GPT-2 directories (or hub ids), safetensors or pytorch_model*.bin."""

from __future__ import annotations

from pathlib import Path

from formats import hf_dir
from mconvert.ir import LazyTensor, ModelIR, SourceInfo, dtype_name
from mconvert.mapping import expand, to_ir
from mconvert.options import Options
from mconvert.registry import register_loader
from mconvert.rules import Ctx
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
    root = hf_dir.resolve(path)
    config = hf_gpt2.config_from_hf(hf_dir.read_json(root / "config.json"), str(root / "config.json"))
    source = with_prefix(hf_dir.open_weights(root))
    if "transformer.wte.weight" in source:
        config = config.replace(dtype=dtype_name(source["transformer.wte.weight"].dtype))
    drop = hf_gpt2.DROP + ((r"lm_head\.weight",) if config.tie_embeddings else ())
    ctx = Ctx(config, config.vocab_size)
    tensors = to_ir({k: [v] for k, v in source.items()}, expand(hf_gpt2.TABLE, config), ctx, where=str(root),
                    drop=drop)
    assets = hf_dir.tokenizer_files(options.tokenizer or root)
    return ModelIR(config, tensors, SourceInfo("gpt2_hf (Hugging Face)", root), assets)
