"""What a Megatron model dict holds, T5, BERT or GPT, so that each loader reads its own and refuses the others by
name rather than converting them as the wrong architecture.

    T5    core: decoder layers with `cross_attention`; legacy: `language_model.decoder`
    BERT  `lm_head.dense`, `lm_head.layernorm`, `binary_head`, `pooler`, token-type embeddings, or an encoder
          without a decoder
    GPT   anything else (decoder layers, no encoder)
"""

from __future__ import annotations

from mconvert.errors import ConvertError

_BERT_MARKS = ("lm_head.dense", "binary_head", "pooler", "tokentype_embeddings", "lm_head.layernorm")


def kind(model: dict) -> str:
    """'t5', 'bert' or 'gpt': what a chunk's model dict (core: flat keys, legacy: nested dicts) holds."""
    keys = list(_paths(model))
    if any(k.startswith("language_model.decoder.") or (k.startswith("decoder.layers.") and ".cross_attention." in k)
           for k in keys):
        return "t5"
    if any(mark in k for k in keys for mark in _BERT_MARKS) or any(k.startswith("encoder.") for k in keys):
        return "bert"
    return "gpt"


def _paths(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _paths(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


WHAT = {
    "t5": "a Megatron T5 (encoder-decoder: encoder layers, decoder cross-attention, an LM head bias)",
    "bert": "a Megatron BERT (encoder-only: lm_head.dense, binary_head, pooler or token-type embeddings)",
    "gpt": "a Megatron GPT (decoder-only: no encoder, no cross-attention)",
}
LOADERS = {"t5": "--loader t5", "gpt": "--loader core or --loader legacy", "bert": "--loader core or --loader legacy"}


def refuse_other(model: dict, where: str, loader: str, expected: str | tuple[str, ...]) -> None:
    """The `loader` reading `expected` models (one or several of 'gpt', 't5', 'bert') refuses a model dict holding
    another kind, naming what it holds and which loader reads that."""
    expected = (expected,) if isinstance(expected, str) else tuple(expected)
    found = kind(model)
    if found not in expected:
        how = f"use {LOADERS[found]} (or leave --loader out)" if found in LOADERS else \
            "read it with its own loader (leave --loader out to detect it)"
        raise ConvertError(f"{where}: holds {WHAT[found]} model, not {' or '.join(e.upper() for e in expected)}, "
                           f"which the {loader} loader reads; {how}")
