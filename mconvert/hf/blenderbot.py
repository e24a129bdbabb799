"""Hugging Face Blenderbot (`BlenderbotForConditionalGeneration`): the one transformers architecture that computes
Megatron's T5 (IR family `t5`) exactly.

Megatron's T5 (megatron-core T5Model and the legacy one) is an encoder-decoder with learned absolute positions
shared by both stacks, pre-LayerNorm layers with biases on every linear, a final LayerNorm after each stack,
attention scaled by head_dim**-0.5, a GELU MLP, and logits `h @ E^T + b` (a bias on the tied LM head).
transformers' own T5 (and MT5, UMT5) does not: relative position buckets, no learned positions, RMSNorm without
biases, no LM head bias. BART, mBART, PLBart and LED add a LayerNorm on the embeddings; Pegasus, M2M100, NLLB and
Marian use sinusoidal positions; ProphetNet predicts n-grams. Blenderbot (not Blenderbot-Small) has the same
operations in the same order: learned positions from 0 (no offset), pre-LayerNorm self-attention, cross-attention
(`encoder_attn`) and MLP (`fc1`, `fc2`), a final `layer_norm` per stack, and `final_logits_bias` added to the tied
`lm_head`; with `scale_embedding: false` the embeddings are not scaled. Its LayerNorms use torch's default
epsilon, 1e-5 (Megatron's default too), and each stack has its own position table (both get the IR's one).

    model.shared.weight                                   [V, h]   embed.weight
    model.{encoder,decoder}.embed_tokens.weight           [V, h]   embed.weight again (separate when untied)
    model.{encoder,decoder}.embed_positions.weight        [S, h]   pos_embed.weight (the same table twice)
    model.{encoder,decoder}.layers.{L}.self_attn.{q,k,v,out}_proj.{weight,bias}
    model.{encoder,decoder}.layers.{L}.self_attn_layer_norm.{weight,bias}
    model.decoder.layers.{L}.encoder_attn.{q,k,v,out}_proj.{weight,bias}, encoder_attn_layer_norm.{weight,bias}
    model.{encoder,decoder}.layers.{L}.{fc1,fc2,final_layer_norm}.{weight,bias}
    model.{encoder,decoder}.layer_norm.{weight,bias}
    final_logits_bias                                     [1, V]   lm_head.bias
    lm_head.weight                                        [V, h]   untied only

Reading (`blenderbot_hf`): Blenderbot directories computing this model; `scale_embedding: true` (the hub's
Blenderbot checkpoints), different encoder and decoder widths or head counts, and transformers' T5 are refused by
name. Writing: `BlenderbotForConditionalGeneration` that `from_pretrained` loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mconvert.errors import ConvertError
from mconvert.hf.config import config_dtype
from mconvert.hf.family import HFFamily, load_hf, register_family, save_hf
from mconvert.io import hf_dir
from mconvert.ir.config import ModelConfig
from mconvert.ir.tensors import LazyTensor, ModelIR
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.registry import missing_features
from mconvert.rules import transforms
from mconvert.rules.table import Join, Rule, Table, linear, norm

MODEL_TYPE = "blenderbot"
ARCHITECTURE = "BlenderbotForConditionalGeneration"
SUPPORTS: frozenset[str] = frozenset({"encoder_decoder"})
ENCODER_POSITIONS, DECODER_POSITIONS = "model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight"
# final_logits_bias is a [1, V] buffer
ROW_VECTOR = Join("row_vector", lambda ts, ctx: ts[0].reshape(1, -1), lambda t, ctx: [t.reshape(-1)])


def _layer(block: str, *, cross: bool) -> tuple[Rule, ...]:
    k, n = f"model.{block}.layers.{{L}}", f"{block}.layers.{{L}}"
    rules = [*linear(f"{k}.self_attn.q_proj", f"{n}.attn.q"), *linear(f"{k}.self_attn.k_proj", f"{n}.attn.k"),
             *linear(f"{k}.self_attn.v_proj", f"{n}.attn.v"), *linear(f"{k}.self_attn.out_proj", f"{n}.attn.o"),
             *norm(f"{k}.self_attn_layer_norm", f"{n}.attn_norm")]
    if cross:
        rules += [*linear(f"{k}.encoder_attn.q_proj", f"{n}.xattn.q"),
                  *linear(f"{k}.encoder_attn.k_proj", f"{n}.xattn.k"),
                  *linear(f"{k}.encoder_attn.v_proj", f"{n}.xattn.v"),
                  *linear(f"{k}.encoder_attn.out_proj", f"{n}.xattn.o"),
                  *norm(f"{k}.encoder_attn_layer_norm", f"{n}.xattn_norm")]
    return (*rules, *linear(f"{k}.fc1", f"{n}.mlp.up"), *linear(f"{k}.fc2", f"{n}.mlp.down"),
            *norm(f"{k}.final_layer_norm", f"{n}.mlp_norm"))


# Copies of one IR tensor under a second (and third) name: written, and checked equal to the first when read.
# Each stack has its own position table; its token embeddings are tied to model.shared when the LM head is, and
# are separate parameters otherwise (transformers 5 unties them with tie_word_embeddings false).
COPIES = {DECODER_POSITIONS: ENCODER_POSITIONS, "model.encoder.embed_tokens.weight": "model.shared.weight",
          "model.decoder.embed_tokens.weight": "model.shared.weight"}


def _table(*, copies: bool) -> Table:
    return Table(
        embedding=(Rule("model.shared.weight", ("embed.weight",)), Rule(ENCODER_POSITIONS, ("pos_embed.weight",)),
                   *((Rule("model.encoder.embed_tokens.weight", ("embed.weight",)),
                      Rule("model.decoder.embed_tokens.weight", ("embed.weight",)),
                      Rule(DECODER_POSITIONS, ("pos_embed.weight",))) if copies else ())),
        encoder_layer=_layer("encoder", cross=False),
        encoder_head=norm("model.encoder.layer_norm", "encoder.final_norm"),
        layer=_layer("decoder", cross=True),
        head=(*norm("model.decoder.layer_norm", "decoder.final_norm"), Rule("lm_head.weight", ("lm_head.weight",)),
              Rule("final_logits_bias", ("lm_head.bias",), ROW_VECTOR)))


TABLE, READ_TABLE = _table(copies=True), _table(copies=False)
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
HF_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_new"}
NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which Blenderbot's norms use


def config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    """The IR config (family t5) of a Blenderbot config.json that computes Megatron's T5."""
    if hf.get("model_type") == "t5":
        raise ConvertError(f"{where}: transformers' T5 (relative position buckets, RMSNorm without biases, no "
                           "learned positions) is not Megatron's T5 and no IR family computes it")
    if hf.get("model_type") != MODEL_TYPE:
        raise ConvertError(f"{where}: model_type {hf.get('model_type')!r} is not 'blenderbot'")
    hf = {"d_model": 2560, "encoder_layers": 2, "decoder_layers": 24, "encoder_attention_heads": 32,
          "decoder_attention_heads": 32, "encoder_ffn_dim": 10240, "decoder_ffn_dim": 10240,
          "max_position_embeddings": 128, "vocab_size": 8008, "activation_function": "gelu",
          "scale_embedding": False, "tie_word_embeddings": True} | hf
    bad = [f"{k}={hf[k]!r}" for k, ok in (
        ("scale_embedding", not hf["scale_embedding"]),
        ("activation_function", hf["activation_function"] in ACTIVATIONS),
        ("decoder_attention_heads", hf["decoder_attention_heads"] == hf["encoder_attention_heads"]),
        ("decoder_ffn_dim", hf["decoder_ffn_dim"] == hf["encoder_ffn_dim"]),
    ) if not ok]
    if bad:
        raise ConvertError(f"{where}: Blenderbot settings Megatron's T5 (the IR's t5) cannot compute: {', '.join(bad)} "
                           "(it needs unscaled embeddings, a GELU MLP and the same heads and FFN width in both "
                           "stacks)")
    hidden, heads = int(hf["d_model"]), int(hf["encoder_attention_heads"])
    if hidden % heads:
        raise ConvertError(f"{where}: d_model={hidden} is not a multiple of encoder_attention_heads={heads}")
    return ModelConfig(
        family="t5", num_layers=int(hf["decoder_layers"]), encoder_num_layers=int(hf["encoder_layers"]),
        hidden_size=hidden, ffn_hidden_size=int(hf["encoder_ffn_dim"]), num_attention_heads=heads,
        num_query_groups=heads, head_dim=hidden // heads, vocab_size=int(hf["vocab_size"]),
        max_position_embeddings=int(hf["max_position_embeddings"]), norm="layernorm", norm_eps=NORM_EPS,
        activation=ACTIVATIONS[hf["activation_function"]], position_embedding="learned", qkv_bias=True,
        proj_bias=True, mlp_bias=True, tie_embeddings=bool(hf["tie_word_embeddings"]), lm_head_bias=True,
        dtype=config_dtype(hf), bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"),
        pad_token_id=hf.get("pad_token_id"))


def config_to_hf(c: ModelConfig) -> dict[str, Any]:
    problems = [what for what, bad in (
        (f"family {c.family} (Blenderbot holds Megatron's T5, an encoder-decoder)", c.family != "t5"),
        (f"norm epsilon {c.norm_eps} (Blenderbot's LayerNorms use {NORM_EPS})", c.norm_eps != NORM_EPS),
        (f"{c.norm} (Blenderbot uses LayerNorm)", c.norm != "layernorm"),
        (f"activation {c.activation} (Blenderbot takes gelu or gelu_tanh)", c.activation not in HF_ACTIVATION),
        ("linears without bias", not (c.qkv_bias and c.proj_bias and c.mlp_bias)),
        (f"head_dim {c.head_dim} × {c.num_attention_heads} heads != hidden {c.hidden_size}",
         c.head_dim * c.num_attention_heads != c.hidden_size),
    ) if bad] + missing_features(c, SUPPORTS)
    if problems:
        raise ConvertError("the model cannot be written as Hugging Face Blenderbot: " + "; ".join(problems))
    pad = 0 if c.pad_token_id is None else c.pad_token_id
    bos = 1 if c.bos_token_id is None else c.bos_token_id
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "activation_function": HF_ACTIVATION[c.activation],
        "d_model": c.hidden_size, "encoder_layers": c.encoder_num_layers, "decoder_layers": c.num_layers,
        "encoder_attention_heads": c.num_attention_heads, "decoder_attention_heads": c.num_attention_heads,
        "encoder_ffn_dim": c.ffn_hidden_size, "decoder_ffn_dim": c.ffn_hidden_size,
        "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size, "scale_embedding": False,
        "tie_word_embeddings": c.tie_embeddings, "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0,
        "encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0, "pad_token_id": pad, "bos_token_id": bos,
        "eos_token_id": 2 if c.eos_token_id is None else c.eos_token_id, "decoder_start_token_id": bos,
        "is_encoder_decoder": True, "use_cache": True, "dtype": c.dtype, "torch_dtype": c.dtype,
    }


def _copies_checked(source: dict[str, LazyTensor]) -> dict[str, LazyTensor]:
    """Each first tensor of `COPIES`, checked (when read) to equal its stored copies, which the IR does not keep."""
    source = dict(source)
    for first in set(COPIES.values()):
        copies = [source.pop(k) for k, v in COPIES.items() if v == first and k in source]
        if first in source and copies:
            source[first] = _checked(source[first], copies)
    return source


def _checked(first: LazyTensor, copies: list[LazyTensor]) -> LazyTensor:
    def thunk():
        value = first.load()
        for copy in copies:
            if copy.shape != first.shape or not transforms.same_bits(copy.load(), value):
                raise ConvertError(f"{copy.origin} differs from {first.origin}: Megatron's T5 has one such table for "
                                   "encoder and decoder")
        return value

    return LazyTensor(first.shape, first.dtype_name, thunk, first.origin)


def load(path: Path, options: Options) -> ModelIR:
    """Hugging Face Blenderbot (BlenderbotForConditionalGeneration) computing Megatron's T5: unscaled embeddings,
    one position table."""
    # an untied model saved without its bias (transformers then starts it at zeros, as the IR's "no bias" means)
    biased = "final_logits_bias" in hf_dir.open_weights(hf_dir.resolve(path))

    def config(hf: dict[str, Any], where: str) -> ModelConfig:
        return config_from_hf(hf, where).replace(lm_head_bias=biased)

    return load_hf(path, options, name="blenderbot_hf", config_from_hf=config, table=READ_TABLE,
                   embed_key="model.shared.weight", drop=(), fix_source=_copies_checked)


def save(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    """Hugging Face Blenderbot (BlenderbotForConditionalGeneration): Megatron's T5, computed exactly."""
    save_hf(ir, out, options, progress, table=TABLE, config_to_hf=config_to_hf, where="saver blenderbot_hf")


FAMILY = register_family(HFFamily("blenderbot_hf", {MODEL_TYPE: ARCHITECTURE}, load, save, SUPPORTS,
                                  aliases=("blenderbot",), ir_families=("t5",)))
