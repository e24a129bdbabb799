"""Hugging Face GPT-2 (`GPT2LMHeadModel`): the key table and the config.json mapping (both directions).

GPT-2 uses `Conv1D` modules, whose weights are stored `[in, out]` (the transpose of a Linear), so every weight
is transposed on the way to the IR. The attention input projection fuses q, k and v along its *output* columns:

    transformer.h.{L}.attn.c_attn.weight   [h, 3h] = [ q | k | v ]   (columns; each block [h, h])
    transformer.h.{L}.attn.c_attn.bias     [3h]    = [ q ; k ; v ]

Positions are learned (`wpe`), norms are LayerNorm with bias, every linear has a bias, and `lm_head` is tied
to `wte` by default. Checkpoints written by transformers < 4.3x also hold each layer's causal-mask buffers
`attn.bias` / `attn.masked_bias` (not weights: dropped), and a bare `GPT2Model` saves keys without the
`transformer.` prefix (the loader adds it).

Reading (plugin `gpt2_hf`): Hugging Face GPT-2 directories (or hub ids), safetensors or pytorch_model*.bin.

Writing (plugin `gpt2_hf`): a Hugging Face GPT-2 directory that `from_pretrained` loads and `generate()` runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mconvert.errors import ConvertError
from mconvert.hf.config import config_dtype
from mconvert.hf.family import HFFamily, load_hf, register_family, save_hf
from mconvert.ir.config import ModelConfig
from mconvert.ir.tensors import LazyTensor, ModelIR
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.registry import missing_features
from mconvert.rules import transforms
from mconvert.rules.table import TRANSPOSE, Join, Rule, Table, norm

MODEL_TYPE = "gpt2"
ARCHITECTURE = "GPT2LMHeadModel"
# The IR features (mconvert.ir.features.FEATURES) this family holds: none
SUPPORTS: frozenset[str] = frozenset()


def _qkv_rows(ctx) -> tuple[int, int]:
    c = ctx.config
    return c.num_attention_heads * c.head_dim, c.num_query_groups * c.head_dim


def _conv1d_shape(shapes, ctx) -> tuple[int, int] | None:
    """[rows_i, h] matrices stacked, then transposed: [h, sum of rows] (shape arithmetic, see `Join.shape`)."""
    if any(len(s) != 2 or s[1] != shapes[0][1] for s in shapes):
        return None
    return shapes[0][1], sum(s[0] for s in shapes)


# c_attn.weight [h, q|k|v] <-> IR q, k, v [rows, h]: stack the rows whole, then the Conv1D transpose.
CONV1D_QKV = Join(
    "conv1d_qkv",
    lambda ts, ctx: transforms.transpose(transforms.concat_qkv(*ts)),
    lambda t, ctx: list(transforms.split_concat_qkv(transforms.transpose(t), *_qkv_rows(ctx))),
    shape=_conv1d_shape,
)
# c_attn.bias [q;k;v] <-> IR q, k, v biases.
CONCAT_QKV = Join(
    "concat_qkv",
    lambda ts, ctx: transforms.concat_qkv(*ts),
    lambda t, ctx: list(transforms.split_concat_qkv(t, *_qkv_rows(ctx))),
    shape=lambda shapes, ctx: (sum(s[0] for s in shapes),) if all(len(s) == 1 for s in shapes) else None,
)


# Conv1D weights are [in, out]: transposed to the IR's [out, in]; their biases are stored as they are.
TABLE = Table(
    embedding=(
        Rule("transformer.wte.weight", ("embed.weight",)),
        Rule("transformer.wpe.weight", ("pos_embed.weight",)),
    ),
    layer=(
        *norm("transformer.h.{L}.ln_1", "layers.{L}.attn_norm"),
        Rule("transformer.h.{L}.attn.c_attn.weight",
             ("layers.{L}.attn.q.weight", "layers.{L}.attn.k.weight", "layers.{L}.attn.v.weight"), CONV1D_QKV),
        Rule("transformer.h.{L}.attn.c_attn.bias",
             ("layers.{L}.attn.q.bias", "layers.{L}.attn.k.bias", "layers.{L}.attn.v.bias"), CONCAT_QKV),
        Rule("transformer.h.{L}.attn.c_proj.weight", ("layers.{L}.attn.o.weight",), TRANSPOSE),
        Rule("transformer.h.{L}.attn.c_proj.bias", ("layers.{L}.attn.o.bias",)),
        *norm("transformer.h.{L}.ln_2", "layers.{L}.mlp_norm"),
        Rule("transformer.h.{L}.mlp.c_fc.weight", ("layers.{L}.mlp.up.weight",), TRANSPOSE),
        Rule("transformer.h.{L}.mlp.c_fc.bias", ("layers.{L}.mlp.up.bias",)),
        Rule("transformer.h.{L}.mlp.c_proj.weight", ("layers.{L}.mlp.down.weight",), TRANSPOSE),
        Rule("transformer.h.{L}.mlp.c_proj.bias", ("layers.{L}.mlp.down.bias",)),
    ),
    head=(
        *norm("transformer.ln_f", "final_norm"),
        Rule("lm_head.weight", ("lm_head.weight",)),
    ),
)

# Causal-mask buffers that old transformers versions saved with the weights; rebuilt at load time.
DROP = (r"transformer\.h\.\d+\.attn\.(bias|masked_bias)",)

# HF activation names -> the IR's. gelu_new, gelu_fast and gelu_pytorch_tanh all compute the tanh approximation.
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu"}
# The IR's -> the name written (gelu_new is what GPT-2 and Megatron's openai_gelu compute).
HF_ACTIVATION = {"gelu_tanh": "gelu_new", "gelu": "gelu"}


def config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    """The IR config from a GPT-2 config.json (transformers' defaults where a field is left out)."""
    if hf.get("model_type") != MODEL_TYPE:
        raise ConvertError(f"{where}: model_type {hf.get('model_type')!r} is not a GPT-2 model (expected 'gpt2')")
    act = hf.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise ConvertError(f"{where}: activation_function {act!r} is not supported (expected one of "
                           f"{', '.join(ACTIVATIONS)})")
    unsupported = [f"{k}={hf.get(k)!r}" for k, ok in (
        ("scale_attn_weights", hf.get("scale_attn_weights", True)),
        ("scale_attn_by_inverse_layer_idx", not hf.get("scale_attn_by_inverse_layer_idx", False)),
        ("add_cross_attention", not hf.get("add_cross_attention", False)),
    ) if not ok]
    if unsupported:
        raise ConvertError(f"{where}: GPT-2 settings that Megatron and the IR cannot express: "
                           f"{', '.join(unsupported)}")
    hf = {"n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024, "vocab_size": 50257} | hf
    try:
        return _config(hf, act, where)
    except (TypeError, ValueError) as e:
        raise ConvertError(f"{where}: a field has a value of the wrong kind: {e}") from None


def _config(hf: dict[str, Any], act: str, where: str) -> ModelConfig:
    hidden, heads = int(hf["n_embd"]), int(hf["n_head"])
    if hidden % heads:
        raise ConvertError(f"{where}: n_embd={hidden} is not a multiple of n_head={heads}")
    return ModelConfig(
        family="gpt2",
        num_layers=int(hf["n_layer"]),
        hidden_size=hidden,
        ffn_hidden_size=int(hf.get("n_inner") or 4 * hidden),  # n_inner null means 4 * n_embd
        num_attention_heads=heads,
        num_query_groups=heads,
        head_dim=hidden // heads,
        vocab_size=int(hf["vocab_size"]),
        max_position_embeddings=int(hf["n_positions"]),
        norm="layernorm",
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        activation=ACTIVATIONS[act],
        position_embedding="learned",
        qkv_bias=True,
        proj_bias=True,
        mlp_bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        dtype=config_dtype(hf),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
        pad_token_id=hf.get("pad_token_id"),
    )


def check_expressible(c: ModelConfig) -> None:
    """Refuse, in one error, every property of `c` that a GPT2LMHeadModel cannot have."""
    problems = [what for what, bad in (
        (f"family {c.family} (the GPT-2 saver takes GPT-2-style models)", c.family != "gpt2"),
        (f"{c.norm} (GPT-2 uses LayerNorm)", c.norm != "layernorm"),
        (f"activation {c.activation} (GPT-2 takes gelu or gelu_tanh)", c.activation not in HF_ACTIVATION),
        (f"{c.position_embedding} positions (GPT-2 learns absolute positions)", c.position_embedding != "learned"),
        ("linears without bias (GPT-2 has a bias on every Conv1D)",
         not (c.qkv_bias and c.proj_bias and c.mlp_bias)),
        (f"{c.num_query_groups} key/value heads for {c.num_attention_heads} query heads (GPT-2 has no GQA)",
         c.num_query_groups != c.num_attention_heads),
        (f"head_dim {c.head_dim} × {c.num_attention_heads} heads != hidden {c.hidden_size}",
         c.head_dim * c.num_attention_heads != c.hidden_size),
        ("mixture of experts", c.is_moe),
        (f"sliding window {c.sliding_window}", c.sliding_window is not None),
    ) if bad] + missing_features(c, SUPPORTS)
    if problems:
        raise ConvertError("the model cannot be written as Hugging Face GPT-2: " + "; ".join(problems)
                           + " (choose the saver for its family, e.g. --saver hf)")


def config_to_hf(c: ModelConfig) -> dict[str, Any]:
    check_expressible(c)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "activation_function": HF_ACTIVATION[c.activation],
        "attn_pdrop": 0.1,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "pad_token_id": c.pad_token_id,
        "dtype": c.dtype,
        "torch_dtype": c.dtype,
        "embd_pdrop": 0.1,
        "initializer_range": 0.02,
        "layer_norm_epsilon": c.norm_eps,
        "n_embd": c.hidden_size,
        "n_head": c.num_attention_heads,
        "n_inner": c.ffn_hidden_size,
        "n_layer": c.num_layers,
        "n_positions": c.max_position_embeddings,
        "reorder_and_upcast_attn": False,
        "resid_pdrop": 0.1,
        "scale_attn_by_inverse_layer_idx": False,
        "scale_attn_weights": True,
        "tie_word_embeddings": c.tie_embeddings,
        "use_cache": True,
        "vocab_size": c.vocab_size,
    }


PREFIX = "transformer."


def with_prefix(source: dict[str, LazyTensor]) -> dict[str, LazyTensor]:
    """A bare `GPT2Model` (e.g. the original `gpt2` upload) saves `wte.weight`, `h.0...`: add `transformer.`."""
    if any(k.startswith(PREFIX) for k in source):
        return source
    return {k if k.startswith("lm_head.") else PREFIX + k: v for k, v in source.items()}


def load(path: Path, options: Options) -> ModelIR:
    """Hugging Face GPT-2 (GPT2LMHeadModel or GPT2Model weights; safetensors or .bin, sharded or not)."""
    return load_hf(path, options, name="gpt2_hf", config_from_hf=config_from_hf, table=TABLE,
                   embed_key="transformer.wte.weight", drop=DROP, fix_source=with_prefix)


def save(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    """Hugging Face GPT-2 (GPT2LMHeadModel): safetensors with Conv1D [in, out] weights, config, tokenizer."""
    save_hf(ir, out, options, progress, table=TABLE, config_to_hf=config_to_hf,
            where="saver gpt2_hf")


FAMILY = register_family(HFFamily("gpt2_hf", {MODEL_TYPE: ARCHITECTURE}, load, save, SUPPORTS, aliases=("gpt2",)))
