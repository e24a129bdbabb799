"""Meta's native Llama layout: `consolidated.NN.pth` model-parallel shards and `params.json`.

Keys carry no `model.` prefix. Each shard holds whole heads: wq/wk/wv/w1/w3/output are split along dim 0,
wo/w2 along dim 1, norms are replicated. The embedding is split along dim 1 (hidden) in Llama 1/2 and along
dim 0 (vocabulary) in Llama 3. Meta's rotary layout interleaves the two halves of each head's q/k rows, so q
and k are permuted into the half-split order of the IR (k with the key/value head count).
"""

from __future__ import annotations

from typing import Any

from mconvert.errors import ConvertError
from mconvert.ir.config import ModelConfig
from mconvert.rules import transforms
from mconvert.rules.table import COLUMN, REPLICATE, ROW, Join, Rule, Shard, Table

ROPE_Q = Join(
    "rope_interleaved_q",
    lambda ts, ctx: transforms.half_to_interleaved_rope(ts[0], ctx.config.num_attention_heads),
    lambda t, ctx: [transforms.interleaved_to_half_rope(t, ctx.config.num_attention_heads)],
)
ROPE_K = Join(
    "rope_interleaved_k",
    lambda ts, ctx: transforms.half_to_interleaved_rope(ts[0], ctx.config.num_query_groups),
    lambda t, ctx: [transforms.interleaved_to_half_rope(t, ctx.config.num_query_groups)],
)

# Present in Llama 1/2 files, not a weight: the rotary frequencies (recomputed from rope_theta).
DROP = (r"rope\.freqs",)


def table(embedding_shard: Shard) -> Table:
    """The rule table; `embedding_shard` is ROW (dim 1) for Llama 1/2 files, COLUMN (dim 0) for Llama 3."""
    return Table(
        embedding=(Rule("tok_embeddings.weight", ("embed.weight",), shard=embedding_shard),),
        layer=(
            Rule("layers.{L}.attention_norm.weight", ("layers.{L}.attn_norm.weight",), shard=REPLICATE),
            Rule("layers.{L}.attention.wq.weight", ("layers.{L}.attn.q.weight",), ROPE_Q, COLUMN),
            Rule("layers.{L}.attention.wk.weight", ("layers.{L}.attn.k.weight",), ROPE_K, COLUMN),
            Rule("layers.{L}.attention.wv.weight", ("layers.{L}.attn.v.weight",), shard=COLUMN),
            Rule("layers.{L}.attention.wo.weight", ("layers.{L}.attn.o.weight",), shard=ROW),
            Rule("layers.{L}.ffn_norm.weight", ("layers.{L}.mlp_norm.weight",), shard=REPLICATE),
            Rule("layers.{L}.feed_forward.w1.weight", ("layers.{L}.mlp.gate.weight",), shard=COLUMN),
            Rule("layers.{L}.feed_forward.w3.weight", ("layers.{L}.mlp.up.weight",), shard=COLUMN),
            Rule("layers.{L}.feed_forward.w2.weight", ("layers.{L}.mlp.down.weight",), shard=ROW),
        ),
        head=(
            Rule("norm.weight", ("final_norm.weight",), shard=REPLICATE),
            Rule("output.weight", ("lm_head.weight",), shard=COLUMN),
        ),
    )


def config_from_params(params: dict[str, Any], *, vocab_size: int, ffn_hidden_size: int, tied: bool,
                       dtype: str, where: str) -> tuple[ModelConfig, list[str]]:
    """The IR config from params.json plus what only the tensors tell; returns notes on assumed defaults."""
    params = params.get("model", params)
    notes: list[str] = []
    try:
        dim, heads, layers = int(params["dim"]), int(params["n_heads"]), int(params["n_layers"])
    except KeyError as e:
        raise ConvertError(f"{where}: params.json has no {e.args[0]!r}") from None
    theta = float(params.get("rope_theta", 10000.0))
    if "rope_theta" not in params:
        notes.append("rope_theta not in params.json: using Meta's default 10000")
    scaling = None
    if params.get("use_scaled_rope"):
        factor = float(params.get("rope_scaling_factor", 8.0))
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}
        notes.append(f"use_scaled_rope: Llama 3.1 scaling, factor {factor:g}")
    if "max_seq_len" in params:
        max_pos = int(params["max_seq_len"])
    else:
        max_pos = 131072 if scaling else 8192 if theta >= 500000 else 4096
        notes.append(f"max_position_embeddings not in params.json: assuming {max_pos} (pass a HF config to change)")
    llama3 = vocab_size >= 128000
    eps = float(params.get("norm_eps", 1e-5))
    config = ModelConfig(
        family="llama", num_layers=layers, hidden_size=dim, ffn_hidden_size=ffn_hidden_size,
        num_attention_heads=heads, num_query_groups=int(params.get("n_kv_heads") or heads),
        head_dim=dim // heads, vocab_size=vocab_size, max_position_embeddings=max_pos,
        norm="rmsnorm", norm_eps=eps, activation="swiglu", position_embedding="rope",
        rope_theta=theta, rope_scaling=scaling, tie_embeddings=tied, dtype=dtype,
        bos_token_id=128000 if llama3 else 1, eos_token_id=128001 if llama3 else 2,
    )
    notes.append(f"bos/eos token ids {config.bos_token_id}/{config.eos_token_id} assumed from the vocabulary size")
    return config, notes


def expected_ffn(dim: int, multiple_of: int, multiplier: float | None) -> int:
    """Meta's FFN size rule: 2/3 of 4*dim, times the multiplier, rounded up to `multiple_of`."""
    hidden = int(2 * 4 * dim / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)
