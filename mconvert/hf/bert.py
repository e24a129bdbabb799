"""Hugging Face BERT (`BertForMaskedLM` / `BertForPreTraining`, model_type `bert`): the original, post-LN BERT.

Its layers normalize after each residual add (`attention.output.LayerNorm`, `output.LayerNorm`), the summed
embeddings are normalized (`embeddings.LayerNorm`) and there is no final norm: the IR family `bert` with
`post_norm` (see mconvert/ir/features.py). Megatron's BERT (megatron-core's BertModel, the legacy one and
transformers' MegatronBert) normalizes before each sublayer and after the last: no rearrangement of the weights
turns the one into the other, so the IR holds this model as it is, `bert_hf` writes it back, and every Megatron
format and `megatron_bert_hf` refuse it by name (the `post_norm` feature). Everything else is MegatronBert's:
the MLM head's transform and bias, the pooler and binary head of BertForPreTraining, the tied decoder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mconvert.errors import ConvertError
from mconvert.hf.config import config_dtype
from mconvert.hf.family import HFFamily, load_hf, register_family, save_hf
from mconvert.hf.megatron_bert import ACTIVATIONS, HF_ACTIVATION, stored_copies
from mconvert.ir.config import ModelConfig
from mconvert.ir.tensors import ModelIR
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.registry import missing_features
from mconvert.rules.table import Rule, Table, linear, norm

MODEL_TYPE = "bert"
MASKED_LM = "BertForMaskedLM"
PRE_TRAINING = "BertForPreTraining"
HEADS = {MASKED_LM: False, PRE_TRAINING: True}  # architecture -> pooler and binary head
SUPPORTS = frozenset({"bert", "post_norm"})

_LAYER = "bert.encoder.layer.{L}"
TABLE = Table(
    embedding=(
        Rule("bert.embeddings.word_embeddings.weight", ("embed.weight",)),
        Rule("bert.embeddings.position_embeddings.weight", ("pos_embed.weight",)),
        Rule("bert.embeddings.token_type_embeddings.weight", ("token_type_embed.weight",)),
        *norm("bert.embeddings.LayerNorm", "embed_norm"),
    ),
    layer=(
        *linear(f"{_LAYER}.attention.self.query", "layers.{L}.attn.q"),
        *linear(f"{_LAYER}.attention.self.key", "layers.{L}.attn.k"),
        *linear(f"{_LAYER}.attention.self.value", "layers.{L}.attn.v"),
        *linear(f"{_LAYER}.attention.output.dense", "layers.{L}.attn.o"),
        *norm(f"{_LAYER}.attention.output.LayerNorm", "layers.{L}.attn_norm"),  # after the residual add
        *linear(f"{_LAYER}.intermediate.dense", "layers.{L}.mlp.up"),
        *linear(f"{_LAYER}.output.dense", "layers.{L}.mlp.down"),
        *norm(f"{_LAYER}.output.LayerNorm", "layers.{L}.mlp_norm"),
    ),
    head=(
        *linear("bert.pooler.dense", "pooler"),
        *linear("cls.seq_relationship", "nsp_head"),
        *linear("cls.predictions.transform.dense", "mlm_head.dense"),
        *norm("cls.predictions.transform.LayerNorm", "mlm_head.norm"),
        Rule("cls.predictions.decoder.weight", ("lm_head.weight",)),  # untied only
        Rule("cls.predictions.bias", ("lm_head.bias",)),
    ),
)
DROP = (r"bert\.embeddings\.position_ids",)  # a buffer of 0..S-1 some versions saved


def config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    """The IR config from a BERT config.json (transformers' defaults where a field is left out)."""
    if hf.get("model_type") != MODEL_TYPE:
        raise ConvertError(f"{where}: model_type {hf.get('model_type')!r} is not a BERT model (expected 'bert')")
    arch = (hf.get("architectures") or [MASKED_LM])[0]
    if arch not in HEADS:
        raise ConvertError(f"{where}: architecture {arch!r} has no MLM head to convert; the bert_hf loader reads "
                           f"{' and '.join(HEADS)}")
    act = hf.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise ConvertError(f"{where}: hidden_act {act!r} is not supported (expected one of {', '.join(ACTIVATIONS)})")
    bad = [f"{k}={hf[k]!r}" for k in ("is_decoder", "add_cross_attention") if hf.get(k)]
    if hf.get("position_embedding_type", "absolute") != "absolute":
        bad.append(f"position_embedding_type={hf['position_embedding_type']!r} (relative position scores)")
    if bad:
        raise ConvertError(f"{where}: BERT settings the IR cannot express: {', '.join(bad)}")
    hf = {"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
          "intermediate_size": 3072, "max_position_embeddings": 512, "type_vocab_size": 2} | hf
    try:
        hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        if hidden % heads:
            raise ConvertError(f"{where}: hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
        return ModelConfig(
            family="bert", num_layers=int(hf["num_hidden_layers"]), hidden_size=hidden,
            ffn_hidden_size=int(hf["intermediate_size"]), num_attention_heads=heads, num_query_groups=heads,
            head_dim=hidden // heads, vocab_size=int(hf["vocab_size"]),
            max_position_embeddings=int(hf["max_position_embeddings"]), norm="layernorm",
            norm_eps=float(hf.get("layer_norm_eps", 1e-12)), activation=ACTIVATIONS[act],
            mlm_head_activation=ACTIVATIONS[act], position_embedding="learned", qkv_bias=True, proj_bias=True,
            mlp_bias=True, tie_embeddings=bool(hf.get("tie_word_embeddings", True)), lm_head_bias=True,
            post_norm=True, num_tokentypes=int(hf["type_vocab_size"]), pooler=HEADS[arch], binary_head=HEADS[arch],
            dtype=config_dtype(hf), bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id", 0))
    except (TypeError, ValueError) as e:
        raise ConvertError(f"{where}: a field has a value of the wrong kind: {e}") from None


def config_to_hf(c: ModelConfig) -> dict[str, Any]:
    problems = [what for what, bad in (
        (f"family {c.family} (the bert_hf saver takes HF's post-LN BERT; Megatron's pre-LN BERT is "
         "megatron_bert_hf's)", c.family != "bert"),
        (f"an MLP activation ({c.activation}) other than the MLM head's ({c.mlm_head_activation})",
         c.activation != c.mlm_head_activation),
        ("no token types (BERT always adds a token-type embedding)", not c.num_tokentypes),
        ("a pooler without the binary head", c.pooler != c.binary_head),
    ) if bad] + missing_features(c, SUPPORTS)
    if problems:
        raise ConvertError("the model cannot be written as Hugging Face BERT: " + "; ".join(problems))
    return {
        "architectures": [PRE_TRAINING if c.binary_head else MASKED_LM], "model_type": MODEL_TYPE,
        "attention_probs_dropout_prob": 0.1, "bos_token_id": c.bos_token_id, "dtype": c.dtype,
        "eos_token_id": c.eos_token_id, "hidden_act": HF_ACTIVATION[c.activation], "hidden_dropout_prob": 0.1,
        "hidden_size": c.hidden_size, "initializer_range": 0.02, "intermediate_size": c.ffn_hidden_size,
        "layer_norm_eps": c.norm_eps, "max_position_embeddings": c.max_position_embeddings,
        "num_attention_heads": c.num_attention_heads, "num_hidden_layers": c.num_layers,
        "pad_token_id": c.pad_token_id, "position_embedding_type": "absolute",
        "tie_word_embeddings": c.tie_embeddings, "torch_dtype": c.dtype, "type_vocab_size": c.num_tokentypes,
        "use_cache": True, "vocab_size": c.vocab_size,
    }


def load(path: Path, options: Options) -> ModelIR:
    """Hugging Face BERT, post-LN (BertForMaskedLM / BertForPreTraining; safetensors or .bin)."""
    return load_hf(path, options, name="bert_hf", config_from_hf=config_from_hf, table=TABLE,
                   embed_key="bert.embeddings.word_embeddings.weight", drop=DROP, stored_copies=stored_copies)


def save(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    """Hugging Face BERT, post-LN (BertForPreTraining with a binary head, else BertForMaskedLM): safetensors, config,
    tokenizer."""
    save_hf(ir, out, options, progress, table=TABLE, config_to_hf=config_to_hf, where="saver bert_hf")


FAMILY = register_family(HFFamily("bert_hf", {MODEL_TYPE: PRE_TRAINING}, load, save, SUPPORTS, aliases=("bert",)))
