"""Loader `deepseek_hf`: Hugging Face DeepSeek-V3 directories (hub layout or transformers 5's fused experts).

The multi-token-prediction (MTP) modules are the layers after `num_hidden_layers`: their number is what the
tensors hold (config.json's `num_nextn_predict_layers` is often 1 for a model saved without them; the
difference is noted). Their copies of the embedding and head are checked against the model's own.
"""

from __future__ import annotations

import re
from pathlib import Path

from mconvert import fp8
from mconvert.errors import ConvertError
from mconvert.formats import hf_dir
from mconvert.ir import LazyTensor, ModelConfig, ModelIR, SourceInfo, dtype_name
from mconvert.loaders.hf_files import read_config
from mconvert.mapping import expand, take_copies, to_ir, verify_copies
from mconvert.options import Options
from mconvert.registry import register_loader
from mconvert.rules import Ctx
from mconvert.schemas import hf_deepseek

EMBED_KEY = "model.embed_tokens.weight"


def _is_deepseek(path: Path) -> bool:
    return hf_dir.is_hf_dir(path, tuple(hf_deepseek.ARCHITECTURES))


@register_loader("deepseek_hf", aliases=("deepseek", "deepseek_v3"), detect=_is_deepseek, options=("tokenizer",))
def load(path: Path, options: Options) -> ModelIR:
    """Hugging Face DeepSeek-V3 (with MTP layers, FP8 or not) and DeepSeek-V2 with greedy routing."""
    root = hf_dir.resolve(path)
    where = str(root / "config.json")
    hf, config = read_config(root, hf_deepseek.config_from_hf)
    source, notes = _dequantized(hf, hf_dir.open_weights(root), where)
    if EMBED_KEY in source:
        config = config.replace(dtype=dtype_name(source[EMBED_KEY].dtype_name))
    config, mtp_notes = _mtp_layers(config, source, where)
    notes += mtp_notes
    fused = any(k.endswith(hf_deepseek.FUSED_MARKER) for k in source)
    table = hf_deepseek.TABLES[(hf_deepseek.rope_interleaved(hf), fused)]
    ctx = Ctx(config, config.vocab_size)
    pieces = {k: [v] for k, v in source.items()}
    copies = {name: take_copies(pieces, rf"model\.layers\.\d+\.{re.escape(suffix)}")
              for name, suffix in (("embed.weight", "embed_tokens.weight"),
                                   ("lm_head.weight", "shared_head.head.weight"))}
    # tied: a stored lm_head.weight must be the embedding again, never a distinct matrix silently dropped
    tied = take_copies(pieces, r"lm_head\.weight") if config.tie_embeddings else []
    tensors = to_ir(pieces, expand(table, config), ctx, where=str(root), drop=hf_deepseek.DROP)
    for name, found in copies.items():
        verify_copies(tensors, name if name in tensors else "embed.weight", found, hf_deepseek.MTP_COPIES[0], ctx,
                      kept_for="the MTP layers")
    verify_copies(tensors, "embed.weight", tied, hf_deepseek.MTP_COPIES[0], ctx)
    layout = {"experts": "fused (transformers 5 in-memory names)" if fused else "one tensor per expert",
              "rotary rows": "interleaved (rope_interleave)" if hf_deepseek.rope_interleaved(hf) else "half split"}
    assets = hf_dir.tokenizer_files(options.tokenizer or root)
    return ModelIR(config, tensors, SourceInfo("deepseek_hf (Hugging Face)", root, layout, notes=notes), assets)


def _dequantized(hf: dict, source: dict[str, LazyTensor], where: str) -> tuple[dict[str, LazyTensor], list[str]]:
    """FP8 block-quantized weights (DeepSeek's release) become lazy bfloat16 tensors, dequantized when read."""
    quant = hf.get("quantization_config") or {}
    if not isinstance(quant, dict):
        raise ConvertError(f"{where}: quantization_config {quant!r}: expected a mapping such as "
                           f"{fp8.QUANTIZATION_CONFIG}")
    if not quant and not any(k.endswith(".weight" + fp8.SCALE_SUFFIX) for k in source):
        return source, []
    if quant.get("quant_method", "fp8") != "fp8" or quant.get("fmt", "e4m3") != "e4m3":
        raise ConvertError(f"{where}: quantization_config {quant} is not FP8 e4m3 with block scales, the only "
                           "quantization mconvert reads")
    block = quant.get("weight_block_size", list(fp8.BLOCK))
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ConvertError(f"{where}: quantization_config.weight_block_size {block!r}: expected two positive "
                           f"integers, the rows and columns of a scaled block (DeepSeek-V3: {list(fp8.BLOCK)})")
    block = tuple(block)
    source, count = fp8.dequantized(source, block)
    return source, [f"{count} FP8 weights ({block[0]}x{block[1]} block scales) dequantized to bfloat16 as they are "
                    "read"]


def _mtp_layers(config: ModelConfig, source: dict[str, LazyTensor], where: str) -> tuple[ModelConfig, list[str]]:
    """The number of MTP modules the tensors hold (layers numbered from num_hidden_layers on, without gaps)."""
    found = sorted({int(m.group(1)) for k in source for m in [re.match(r"model\.layers\.(\d+)\.", k)]
                    if m and int(m.group(1)) >= config.num_layers})
    count = len(found)
    if found != list(range(config.num_layers, config.num_layers + count)):
        raise ConvertError(f"{where}: the checkpoint's layers after num_hidden_layers={config.num_layers} are "
                           f"{found}; MTP layers must follow the last layer without gaps")
    notes = []
    if count != config.mtp_layers:
        notes.append(f"config.json announces {config.mtp_layers} MTP layer(s) (num_nextn_predict_layers), the "
                     f"weights hold {count}: converting {count}")
    return config.replace(mtp_layers=count), notes
