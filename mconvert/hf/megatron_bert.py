"""Hugging Face Megatron BERT (`MegatronBertForMaskedLM` / `MegatronBertForPreTraining`): the key table and the
config.json mapping (both directions).

transformers' MegatronBert is Megatron's pre-LN BERT (the IR family `megatron_bert`, see mconvert/ir/features.py):
no norm of the embeddings, a LayerNorm before attention (`attention.ln`) and before the MLP (`ln`), a final one
(`encoder.ln`), q, k and v as three biased Linears, token-type embeddings always (`type_vocab_size` rows), the MLM
head's transform (`cls.predictions.transform`) and its bias (`cls.predictions.bias`), the decoder tied to the word
embeddings. `MegatronBertForPreTraining` adds the pooler (`bert.pooler.dense`) and the binary (next-sentence) head
(`cls.seq_relationship`). Older transformers also stored `cls.predictions.decoder.{weight,bias}`, copies of the
tied embedding and of `cls.predictions.bias`: each is checked to equal its original when read.

A model without token types (Megatron's `num_tokentypes` 0, an MLM-only BERT) is written with `type_vocab_size`
1 and a zero token-type row: transformers adds that row to every position, which adds nothing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from mconvert.errors import ConvertError
from mconvert.hf.config import config_dtype
from mconvert.hf.family import HFFamily, load_hf, register_family, save_hf
from mconvert.ir import dtypes
from mconvert.ir.config import ModelConfig
from mconvert.ir.tensors import LazyTensor, ModelIR
from mconvert.lazy import torch
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.registry import missing_features
from mconvert.rules.table import Rule, Table, linear, norm

MODEL_TYPE = "megatron-bert"
MASKED_LM = "MegatronBertForMaskedLM"
PRE_TRAINING = "MegatronBertForPreTraining"
# The IR features (mconvert.ir.features.FEATURES) this family holds
SUPPORTS = frozenset({"bert"})

_LAYER = "bert.encoder.layer.{L}"
TABLE = Table(
    embedding=(
        Rule("bert.embeddings.word_embeddings.weight", ("embed.weight",)),
        Rule("bert.embeddings.position_embeddings.weight", ("pos_embed.weight",)),
        Rule("bert.embeddings.token_type_embeddings.weight", ("token_type_embed.weight",)),
    ),
    layer=(
        *norm(f"{_LAYER}.attention.ln", "layers.{L}.attn_norm"),
        *linear(f"{_LAYER}.attention.self.query", "layers.{L}.attn.q"),
        *linear(f"{_LAYER}.attention.self.key", "layers.{L}.attn.k"),
        *linear(f"{_LAYER}.attention.self.value", "layers.{L}.attn.v"),
        *linear(f"{_LAYER}.attention.output.dense", "layers.{L}.attn.o"),
        *norm(f"{_LAYER}.ln", "layers.{L}.mlp_norm"),
        *linear(f"{_LAYER}.intermediate.dense", "layers.{L}.mlp.up"),
        *linear(f"{_LAYER}.output.dense", "layers.{L}.mlp.down"),
    ),
    head=(
        *norm("bert.encoder.ln", "final_norm"),
        *linear("bert.pooler.dense", "pooler"),
        *linear("cls.seq_relationship", "nsp_head"),
        *linear("cls.predictions.transform.dense", "mlm_head.dense"),
        *norm("cls.predictions.transform.LayerNorm", "mlm_head.norm"),
        Rule("cls.predictions.decoder.weight", ("lm_head.weight",)),  # untied only
        Rule("cls.predictions.bias", ("lm_head.bias",)),
    ),
)
DROP = (r"bert\.embeddings\.position_ids",)  # a buffer of 0..S-1 some versions saved

# HF activation names -> the IR's (gelu_new, gelu_pytorch_tanh and gelu_fast compute the tanh approximation)
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh"}
HF_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}
HEADS = {MASKED_LM: False, PRE_TRAINING: True}  # architecture -> pooler and binary head


def config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    """The IR config from a MegatronBert config.json (transformers' defaults where a field is left out)."""
    if hf.get("model_type") != MODEL_TYPE:
        raise ConvertError(f"{where}: model_type {hf.get('model_type')!r} is not a Megatron BERT model "
                           f"(expected {MODEL_TYPE!r})")
    arch = (hf.get("architectures") or [MASKED_LM])[0]
    if arch not in HEADS:
        raise ConvertError(f"{where}: architecture {arch!r} has no MLM head to convert; the megatron_bert_hf loader "
                           f"reads {' and '.join(HEADS)}")
    act = hf.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise ConvertError(f"{where}: hidden_act {act!r} is not supported (expected one of {', '.join(ACTIVATIONS)})")
    bad = [f"{k}={hf[k]!r}" for k in ("is_decoder", "add_cross_attention") if hf.get(k)]
    if bad:
        raise ConvertError(f"{where}: {', '.join(bad)}: a BERT decoder, which Megatron's BERT is not")
    hf = {"vocab_size": 29056, "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
          "intermediate_size": 4096, "max_position_embeddings": 512, "type_vocab_size": 2} | hf
    try:
        hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        if hidden % heads:
            raise ConvertError(f"{where}: hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
        return ModelConfig(
            family="megatron_bert", num_layers=int(hf["num_hidden_layers"]), hidden_size=hidden,
            ffn_hidden_size=int(hf["intermediate_size"]), num_attention_heads=heads, num_query_groups=heads,
            head_dim=hidden // heads, vocab_size=int(hf["vocab_size"]),
            max_position_embeddings=int(hf["max_position_embeddings"]), norm="layernorm",
            norm_eps=float(hf.get("layer_norm_eps", 1e-12)), activation=ACTIVATIONS[act],
            position_embedding="learned", mlm_head_activation=ACTIVATIONS[act], qkv_bias=True, proj_bias=True,
            mlp_bias=True,
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)), lm_head_bias=True,
            num_tokentypes=int(hf["type_vocab_size"]), pooler=HEADS[arch], binary_head=HEADS[arch],
            dtype=config_dtype(hf), bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id", 0))
    except (TypeError, ValueError) as e:
        raise ConvertError(f"{where}: a field has a value of the wrong kind: {e}") from None


def check_expressible(c: ModelConfig) -> None:
    """Refuse, in one error, every property of `c` that transformers' MegatronBert cannot have."""
    problems = [what for what, bad in (
        (f"family {c.family} (the megatron_bert_hf saver takes Megatron's pre-LN BERT)", c.family != "megatron_bert"),
        (f"activation {c.activation} (MegatronBert takes gelu or gelu_tanh)", c.activation not in HF_ACTIVATION),
        (f"an MLP activation ({c.activation}) other than the MLM head's ({c.mlm_head_activation}): MegatronBert "
         "computes its hidden_act in both (Megatron's fused bias-GELU, bias_gelu_fusion, computes gelu's tanh "
         "approximation in the MLP while its LM head computes exact gelu)", c.activation != c.mlm_head_activation),
        ("linears without bias (MegatronBert has a bias on every Linear)",
         not (c.qkv_bias and c.proj_bias and c.mlp_bias)),
        (f"head_dim {c.head_dim} x {c.num_attention_heads} heads != hidden {c.hidden_size}",
         c.head_dim * c.num_attention_heads != c.hidden_size),
        ("a pooler without the binary head (MegatronBertForPreTraining has both, MegatronBertForMaskedLM neither)",
         c.pooler != c.binary_head),
    ) if bad] + missing_features(c, SUPPORTS)
    if problems:
        raise ConvertError("the model cannot be written as Hugging Face Megatron BERT: " + "; ".join(problems))


def config_to_hf(c: ModelConfig) -> dict[str, Any]:
    check_expressible(c)
    return {
        "architectures": [PRE_TRAINING if c.binary_head else MASKED_LM],
        "model_type": MODEL_TYPE,
        "add_cross_attention": False,
        "attention_probs_dropout_prob": 0.1,
        "bos_token_id": c.bos_token_id,
        "dtype": c.dtype,
        "eos_token_id": c.eos_token_id,
        "hidden_act": HF_ACTIVATION[c.activation],
        "hidden_dropout_prob": 0.1,
        "hidden_size": c.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": c.ffn_hidden_size,
        "is_decoder": False,
        "layer_norm_eps": c.norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "num_attention_heads": c.num_attention_heads,
        "num_hidden_layers": c.num_layers,
        "pad_token_id": c.pad_token_id,
        "tie_word_embeddings": c.tie_embeddings,
        "torch_dtype": c.dtype,
        "type_vocab_size": c.num_tokentypes,
        "use_cache": True,
        "vocab_size": c.vocab_size,
    }


def stored_copies(c: ModelConfig) -> dict[str, str]:
    """Keys older transformers stored beside their originals: key -> the IR tensor it must equal."""
    tied = {"cls.predictions.decoder.weight": "embed.weight"} if c.tie_embeddings else {}
    return tied | {"cls.predictions.decoder.bias": "lm_head.bias"}


def with_token_types(ir: ModelIR) -> ModelIR:
    """A model without token types gets one zero token-type row (MegatronBert always adds a token-type embedding;
    adding zeros changes nothing)."""
    c = ir.config
    if c.num_tokentypes:
        return ir
    dtype = ir.tensors["embed.weight"].dtype_name
    zeros = LazyTensor((1, c.hidden_size), dtype, lambda: torch.zeros(1, c.hidden_size, dtype=dtypes.to_torch(dtype)),
                       "a zero token-type row")
    return dataclasses.replace(ir, config=c.replace(num_tokentypes=1),
                               tensors=ir.tensors | {"token_type_embed.weight": zeros})


def load(path: Path, options: Options) -> ModelIR:
    """Hugging Face Megatron BERT (MegatronBertForMaskedLM / MegatronBertForPreTraining; safetensors or .bin)."""
    return load_hf(path, options, name="megatron_bert_hf", config_from_hf=config_from_hf, table=TABLE,
                   embed_key="bert.embeddings.word_embeddings.weight", drop=DROP, stored_copies=stored_copies)


def save(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    """Hugging Face Megatron BERT (MegatronBertForPreTraining with a binary head, else MegatronBertForMaskedLM):
    safetensors, config, tokenizer."""
    check_expressible(ir.config)  # before the zero token-type row is added
    save_hf(with_token_types(ir), out, options, progress, table=TABLE, config_to_hf=config_to_hf,
            where="saver megatron_bert_hf")


FAMILY = register_family(HFFamily("megatron_bert_hf", {MODEL_TYPE: PRE_TRAINING}, load, save, SUPPORTS,
                                  aliases=("megatron_bert",)))
