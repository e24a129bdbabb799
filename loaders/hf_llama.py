"""Loader `llama_mistral`: Hugging Face Llama/Mistral directories (or hub ids), and Meta's native layout."""

from __future__ import annotations

import re
from pathlib import Path

from mconvert.config_checks import META_INTEGERS, check_integers, with_where
from mconvert.errors import ConvertError
from mconvert.formats import hf_dir
from mconvert.formats.torch_pickle import safe_load
from mconvert.ir import LazyTensor, LoadCache, ModelIR, SourceInfo, dtype_name
from mconvert.loaders.hf_files import load_hf
from mconvert.mapping import expand, to_ir
from mconvert.options import Options
from mconvert.registry import register_loader
from mconvert.rules import COLUMN, ROW, Ctx
from mconvert.schemas import hf_llama, meta_llama


def _is_hf(path: Path) -> bool:
    return hf_dir.is_hf_dir(path, tuple(hf_llama.MODEL_TYPES))


def _is_meta(path: Path) -> bool:
    return (path / "params.json").is_file() and any(path.glob("consolidated.*.pth"))


@register_loader("llama_mistral", aliases=("llama", "mistral"), detect=lambda p: _is_hf(p) or _is_meta(p),
                 options=("tokenizer",))
def load(path: Path, options: Options) -> ModelIR:
    """Hugging Face Llama / Mistral (safetensors or .bin, sharded or not), or Meta's consolidated.NN.pth."""
    root = Path(path) if _is_meta(Path(path)) else hf_dir.resolve(path)
    if _is_meta(root):
        return load_meta(root, options)
    return load_hf(root, options, name="llama_mistral", config_from_hf=hf_llama.config_from_hf, table=hf_llama.TABLE,
                   embed_key="model.embed_tokens.weight", drop=hf_llama.DROP)


def load_meta(root: Path, options: Options) -> ModelIR:
    files = sorted(root.glob("consolidated.*.pth"), key=lambda p: int(re.sub(r"\D", "", p.name) or 0))
    shards = [safe_load(f) for f in files]
    params = hf_dir.read_json(root / "params.json")
    check_integers(params.get("model", params), META_INTEGERS, str(root / "params.json"))
    dim = int(params.get("model", params).get("dim", 0))
    pieces: dict[str, list[LazyTensor]] = {}
    for f, shard in zip(files, shards):
        for key, t in shard.items():
            pieces.setdefault(key, []).append(LazyTensor.of(t, f"{f.name}:{key}"))
    missing = [k for k, v in pieces.items() if len(v) != len(files)]
    if missing:
        raise ConvertError(f"{root}: tensors not present in every consolidated.*.pth shard: {', '.join(missing[:5])}")
    embed = pieces.get("tok_embeddings.weight")
    if embed is None:
        raise ConvertError(f"{root}: no tok_embeddings.weight in {files[0].name}")
    by_hidden = len(files) > 1 and embed[0].shape[1] * len(files) == dim
    vocab = embed[0].shape[0] * (1 if by_hidden else len(files))
    ffn = sum(p.shape[0] for p in pieces.get("layers.0.feed_forward.w1.weight", []))
    p = params.get("model", params)
    if "multiple_of" in p and ffn != meta_llama.expected_ffn(dim, int(p["multiple_of"]), p.get("ffn_dim_multiplier")):
        raise ConvertError(f"{root}: params.json (dim {dim}, multiple_of {p['multiple_of']}, ffn_dim_multiplier "
                           f"{p.get('ffn_dim_multiplier')}) implies an FFN size other than the tensors' {ffn}: "
                           "the config contradicts the tensors")
    config, notes = with_where(str(root / "params.json"), lambda: meta_llama.config_from_params(
        params, vocab_size=vocab, ffn_hidden_size=ffn, tied="output.weight" not in pieces,
        dtype=dtype_name(embed[0].dtype_name), where=str(root / "params.json")))
    table = meta_llama.table(ROW if by_hidden else COLUMN)
    ctx = Ctx(config, config.vocab_size)
    tensors = to_ir(pieces, expand(table, config), ctx, where=str(root), drop=meta_llama.DROP, cache=LoadCache(4))
    assets = hf_dir.tokenizer_files(options.tokenizer or root)
    layout = {"model_parallel": len(files), "embedding_split": "hidden" if by_hidden else "vocab"}
    return ModelIR(config, tensors, SourceInfo("llama_mistral (Meta native)", root, layout, notes=notes), assets)
