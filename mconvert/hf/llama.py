"""Hugging Face Llama and Mistral: the key table and the config.json mapping (both directions).

Reading (plugin `llama_mistral`): Hugging Face Llama/Mistral directories (or hub ids), and Meta's native layout.

Writing (plugin `llama_mistral`): a Hugging Face Llama/Mistral directory that `from_pretrained` loads as is.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mconvert.errors import ConvertError
from mconvert.hf import meta_llama
from mconvert.hf.config import parse, rope_decoder_config, rope_decoder_fields
from mconvert.hf.family import HFFamily, load_hf, not_my_family, register_family, save_hf
from mconvert.io import hf_dir
from mconvert.io.torch_pickle import safe_load
from mconvert.ir import sizes
from mconvert.ir.checks import META_INTEGERS, check_integers, with_where
from mconvert.ir.config import ModelConfig
from mconvert.ir.dtypes import dtype_name
from mconvert.ir.tensors import LazyTensor, LoadCache, ModelIR, SourceInfo
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.registry import missing_features
from mconvert.rules.mapping import expand, to_ir
from mconvert.rules.table import COLUMN, ROW, Ctx, Rule, Table, linear

MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
# The IR features (mconvert.ir.features.FEATURES) this family holds: none
SUPPORTS: frozenset[str] = frozenset()

TABLE = Table(
    embedding=(Rule("model.embed_tokens.weight", ("embed.weight",)),),
    layer=(
        Rule("model.layers.{L}.input_layernorm.weight", ("layers.{L}.attn_norm.weight",)),
        *linear("model.layers.{L}.self_attn.q_proj", "layers.{L}.attn.q"),
        *linear("model.layers.{L}.self_attn.k_proj", "layers.{L}.attn.k"),
        *linear("model.layers.{L}.self_attn.v_proj", "layers.{L}.attn.v"),
        *linear("model.layers.{L}.self_attn.o_proj", "layers.{L}.attn.o"),
        Rule("model.layers.{L}.post_attention_layernorm.weight", ("layers.{L}.mlp_norm.weight",)),
        *linear("model.layers.{L}.mlp.gate_proj", "layers.{L}.mlp.gate"),
        *linear("model.layers.{L}.mlp.up_proj", "layers.{L}.mlp.up"),
        *linear("model.layers.{L}.mlp.down_proj", "layers.{L}.mlp.down"),
    ),
    head=(
        Rule("model.norm.weight", ("final_norm.weight",)),
        Rule("lm_head.weight", ("lm_head.weight",)),
    ),
)

# Present in some checkpoints, never model weights: rotary frequencies (recomputed from rope_theta).
DROP = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)


def config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConvertError(f"{where}: model_type {model_type!r} is not a Llama or Mistral model "
                           f"(expected one of {', '.join(MODEL_TYPES)})")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConvertError(f"{where}: hidden_act {act!r} is not supported for {model_type} (expected 'silu')")
    # transformers' defaults where config.json leaves a field out; Mistral's differ from Llama's.
    mistral = model_type == "mistral"
    defaults = {"num_key_value_heads": 8 if mistral else None, "sliding_window": 4096 if mistral else None,
                "max_position_embeddings": 131072 if mistral else 2048}
    hf = defaults | hf
    bias = bool(hf.get("attention_bias", False))
    return parse(where, lambda: ModelConfig(
        family=model_type, **rope_decoder_fields(hf), qkv_bias=bias, proj_bias=bias,
        mlp_bias=bool(hf.get("mlp_bias", False)), sliding_window=hf["sliding_window"] if mistral else None))


def config_to_hf(c: ModelConfig) -> dict[str, Any]:
    if c.family not in MODEL_TYPES:
        raise not_my_family("llama_mistral", c.family)
    unsupported = [what for what, bad in (
        (f"activation {c.activation} (Llama and Mistral use SwiGLU)", c.activation != "swiglu"),
        (f"{c.norm} (they use RMSNorm)", c.norm != "rmsnorm"),
        ("learned position embeddings (they use rotary)", c.position_embedding != "rope"),
        ("experts (save it as mixtral)", c.is_moe),
        (f"no sliding window in layers {list(c.full_attention_layers)} (Mistral's applies to every layer)",
         c.sliding_window is not None and bool(c.full_attention_layers)),
    ) if bad] + missing_features(c, SUPPORTS)
    if unsupported:
        raise ConvertError(f"HF {MODEL_TYPES[c.family].removesuffix('ForCausalLM')} cannot hold this model: "
                           f"{', '.join(unsupported)}")
    if c.qkv_bias != c.proj_bias:
        raise ConvertError("HF Llama has one attention_bias flag for q/k/v and o; this model has bias on "
                           f"{'q/k/v only' if c.qkv_bias else 'o only'}")
    hf = rope_decoder_config(c, MODEL_TYPES[c.family], c.family) | {"attention_bias": c.qkv_bias}
    if c.family == "llama":
        hf["mlp_bias"] = c.mlp_bias
        hf["pretraining_tp"] = 1
    else:
        if c.mlp_bias:
            raise ConvertError("HF Mistral has no MLP bias; this model has one (save it as family llama)")
        hf["sliding_window"] = c.sliding_window
    return hf


def _is_hf(path: Path) -> bool:
    return hf_dir.is_hf_dir(path, tuple(MODEL_TYPES))


def _is_meta(path: Path) -> bool:
    return (path / "params.json").is_file() and any(path.glob("consolidated.*.pth"))


def load(path: Path, options: Options) -> ModelIR:
    """Hugging Face Llama / Mistral (safetensors or .bin, sharded or not), or Meta's consolidated.NN.pth."""
    root = Path(path) if _is_meta(Path(path)) else hf_dir.resolve(path)
    if _is_meta(root):
        return load_meta(root, options)
    return load_hf(root, options, name="llama_mistral", config_from_hf=config_from_hf, table=TABLE,
                   embed_key="model.embed_tokens.weight", drop=DROP)


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
    values = sizes.stored_elements(t.shape for found in pieces.values() for t in found)
    sizes.check_counts(p, ("n_layers",), values, str(root / "params.json"))
    config, notes = with_where(str(root / "params.json"), lambda: meta_llama.config_from_params(
        params, vocab_size=vocab, ffn_hidden_size=ffn, tied="output.weight" not in pieces,
        dtype=dtype_name(embed[0].dtype_name), where=str(root / "params.json")))
    sizes.check_fits(config, values, str(root / "params.json"))
    table = meta_llama.table(ROW if by_hidden else COLUMN)
    ctx = Ctx(config, config.vocab_size)
    tensors = to_ir(pieces, expand(table, config), ctx, where=str(root), drop=meta_llama.DROP, cache=LoadCache(4))
    assets = hf_dir.tokenizer_files(options.tokenizer or root)
    layout = {"model_parallel": len(files), "embedding_split": "hidden" if by_hidden else "vocab"}
    return ModelIR(config, tensors, SourceInfo("llama_mistral (Meta native)", root, layout, notes=notes), assets)


def save(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    """Hugging Face Llama / Mistral: sharded safetensors + index, config, generation config, tokenizer."""
    save_hf(ir, out, options, progress, table=TABLE, config_to_hf=config_to_hf,
            where="saver llama_mistral")


FAMILY = register_family(HFFamily("llama_mistral", MODEL_TYPES, load, save, SUPPORTS, aliases=("llama", "mistral"),
                                  detect=lambda p: _is_hf(p) or _is_meta(p)))
