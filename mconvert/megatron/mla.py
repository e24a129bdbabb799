"""Megatron-core DeepSeek-V3 layers: multi-latent attention (MLASelfAttention), MTP modules, and the args of
MLA, DeepSeek routing and MTP, both ways (see mconvert/ir/features.py for what the IR means).

Keys local to a file (`{l}` a layer of the chunk, `{m}` an MTP module, numbered from 0 on the last stage):

    decoder.layers.{l}.input_layernorm.weight                   its own module under both specs
    decoder.layers.{l}.self_attention.linear_q_proj.weight      [nh*(dn+dr), h]  column   (no query LoRA)
    decoder.layers.{l}.self_attention.linear_q_down_proj.weight [r_q, h]         column (local) | whole (TE)
    decoder.layers.{l}.self_attention.linear_q_up_proj.weight   [nh*(dn+dr), r_q] column
    decoder.layers.{l}.self_attention.linear_kv_down_proj.weight [r_kv+dr, h]    column (local) | whole (TE)
    decoder.layers.{l}.self_attention.linear_kv_up_proj.weight  [nh*(dn+dv), r_kv] column
    decoder.layers.{l}.self_attention.{q,kv}_layernorm.weight   (local)  | linear_{q,kv}_up_proj.layer_norm_weight (TE)
    decoder.layers.{l}.self_attention.linear_proj.weight        [h, nh*dv]       row
    mtp.layers.{m}.{enorm,hnorm,final_layernorm}.weight, mtp.layers.{m}.eh_proj.weight [h, 2h] column,
    mtp.layers.{m}.transformer_layer.<the keys of a decoder layer>

The local spec builds the down projections as ColumnParallelLinear (each TP rank a slice of the rows, gathered
before use), Transformer Engine as TELinear in 'duplicated' mode (every rank the whole tensor). Rotary rows are
interleaved (mconvert/rules/mla.py): Megatron's MLA de-interleaves them at run time.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from mconvert.errors import ConvertError
from mconvert.ir.config import ModelConfig
from mconvert.ir.features import yarn_mscale, yarn_params
from mconvert.rules.mla import KV_ROPE, Q_ROPE
from mconvert.rules.table import COLUMN, REPLICATE, ROW, Rule, Shard, linear, norm

_SA = "decoder.layers.{l}.self_attention"


def _attention(down: Shard, fused_norms: bool) -> tuple[Rule, ...]:
    q_norm, kv_norm = (f"{_SA}.linear_q_up_proj", f"{_SA}.linear_kv_up_proj") if fused_norms else \
        (f"{_SA}.q_layernorm", f"{_SA}.kv_layernorm")
    return (
        *norm("decoder.layers.{l}.input_layernorm", "layers.{L}.attn_norm"),
        Rule(f"{_SA}.linear_q_proj.weight", ("layers.{L}.attn.q.weight",), Q_ROPE, COLUMN),
        Rule(f"{_SA}.linear_q_down_proj.weight", ("layers.{L}.attn.q_down.weight",), shard=down),
        *norm(q_norm, "layers.{L}.attn.q_norm", fused=fused_norms),
        Rule(f"{_SA}.linear_q_up_proj.weight", ("layers.{L}.attn.q_up.weight",), Q_ROPE, COLUMN),
        Rule(f"{_SA}.linear_kv_down_proj.weight", ("layers.{L}.attn.kv_down.weight",), KV_ROPE, down),
        *norm(kv_norm, "layers.{L}.attn.kv_norm", fused=fused_norms),
        Rule(f"{_SA}.linear_kv_up_proj.weight", ("layers.{L}.attn.kv_up.weight",), shard=COLUMN),
        *linear(f"{_SA}.linear_proj", "layers.{L}.attn.o", shard=ROW, bias_shard=REPLICATE),
    )


# Per transformer implementation: the attention rules of an MLA layer (the norm before the MLP is as in any layer)
ATTENTION = {"local": _attention(COLUMN, fused_norms=False), "te": _attention(REPLICATE, fused_norms=True)}

MTP = (
    Rule("mtp.layers.{m}.enorm.weight", ("mtp.{M}.enorm.weight",)),
    Rule("mtp.layers.{m}.hnorm.weight", ("mtp.{M}.hnorm.weight",)),
    Rule("mtp.layers.{m}.eh_proj.weight", ("mtp.{M}.eh_proj.weight",), shard=COLUMN),
    Rule("mtp.layers.{m}.final_layernorm.weight", ("mtp.{M}.final_norm.weight",)),
)
LAYER_PREFIX, MTP_LAYER_PREFIX = "decoder.layers.{l}.", "mtp.layers.{m}.transformer_layer."
# megatron-core 0.19 renamed an MTP module's layer `mtp_model_layer` in its state dict (the `torch` format stores
# that name; its torch_dist checkpoints keep `transformer_layer`, mapped back on save and load).
MTP_LAYER_NAMES = ("transformer_layer", "mtp_model_layer")
_MTP_LAYER_KEY = re.compile(r"(mtp\.layers\.\d+\.)(transformer_layer|mtp_model_layer)\.")


def mtp_layer_named(key: str, name: str) -> str:
    """`key` with an MTP module's layer under `name` (either of MTP_LAYER_NAMES); other keys unchanged."""
    return _MTP_LAYER_KEY.sub(lambda m: f"{m.group(1)}{name}.", key, count=1)


def attention_extra_states(impl: str, c: ModelConfig) -> tuple[str, ...]:
    """The MLA modules (relative to the layer) that store an `_extra_state` entry: Megatron's linears under the
    local spec; under Transformer Engine also the core attention and the TENorm of the input."""
    q = ("linear_q_proj",) if c.q_lora_rank is None else ("linear_q_down_proj", "linear_q_up_proj")
    modules = tuple(f"self_attention.{m}" for m in ("linear_proj", *q, "linear_kv_down_proj", "linear_kv_up_proj"))
    return modules + (("self_attention.core_attention", "input_layernorm") if impl == "te" else ())


def mtp_extra_states(impl: str) -> tuple[str, ...]:
    """An MTP module's own modules with an `_extra_state` (under `mtp.layers.{m}.`)."""
    return ("eh_proj",) + (("enorm", "hnorm", "final_layernorm") if impl == "te" else ())


# ---- args <-> config ------------------------------------------------------------------------------------------

Get = Callable[..., Any]


def config_fields(get: Get, *, heads: int, top_k: int | None, where: str) -> dict[str, Any]:
    """The IR fields of MLA, DeepSeek routing and MTP from Megatron args (`get(name, default)`)."""
    out: dict[str, Any] = {"mtp_layers": int(get("mtp_num_layers", 0))}
    if get("multi_latent_attention"):
        if not get("qk_layernorm"):
            raise ConvertError(f"{where}: multi-latent attention without qk_layernorm (the norms of the query and "
                               "key/value latents) cannot be carried: the IR's MLA has them, as DeepSeek does")
        nope, rope = int(get("qk_head_dim", 128)), int(get("qk_pos_emb_head_dim", 64))
        out |= dict(head_dim=nope + rope, num_query_groups=heads,
                    q_lora_rank=int(get("q_lora_rank")) if get("q_lora_rank") else None,
                    kv_lora_rank=int(get("kv_lora_rank", 32)), qk_rope_head_dim=rope,
                    v_head_dim=int(get("v_head_dim", 128)), rope_scaling=_yarn_from_args(get, where))
    if get("num_experts"):
        out |= _routing_from_args(get, top_k, where)
    return out


def _routing_from_args(get: Get, top_k: int | None, where: str) -> dict[str, Any]:
    score = get("moe_router_score_function", "softmax")
    if score not in ("softmax", "sigmoid"):
        raise ConvertError(f"{where}: moe_router_score_function={score!r} is not softmax or sigmoid")
    groups, group_topk = get("moe_router_num_groups"), get("moe_router_group_topk")
    if group_topk and top_k // int(group_topk) != 2:
        raise ConvertError(f"{where}: Megatron scores a group of experts by its best moe_router_topk // "
                           f"moe_router_group_topk = {top_k // int(group_topk)} experts, DeepSeek (and the IR) by its "
                           "best 2; only that case can be carried")
    out = dict(moe_router_score=score, moe_router_expert_bias=bool(get("moe_router_enable_expert_bias")),
               moe_shared_expert_ffn_hidden_size=int(shared) if (shared := get("moe_shared_expert_intermediate_size"))
               else None,
               moe_router_groups=int(groups) if group_topk else None,
               moe_router_group_topk=int(group_topk) if group_topk else None,
               moe_router_scaling_factor=float(get("moe_router_topk_scaling_factor", 1.0)))
    if score == "sigmoid":  # Megatron renormalizes sigmoid weights whenever it picks more than one expert
        out["moe_norm_topk"] = top_k > 1
    return out


def _yarn_from_args(get: Get, where: str) -> dict[str, Any] | None:
    """MLA's rotary scaling from args: Megatron-LM's MLA defaults to YaRN, which is plain rope at factor 1."""

    def number(name: str, default: Any) -> float:
        value = get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConvertError(f"{where}: args.{name}={value!r}: expected a number")
        return float(value)

    rope_type = get("rope_type", "yarn")
    if rope_type not in ("rope", "yarn"):  # Megatron's MLA knows these two
        raise ConvertError(f"{where}: args.rope_type={rope_type!r}: expected 'rope' or 'yarn'")
    factor = number("rotary_scaling_factor", 1.0)
    if rope_type != "yarn" or factor <= 1:
        return None
    mscale, all_dim = number("mscale", 1.0), number("mscale_all_dim", 0.0)
    if not (mscale and all_dim) and (mscale, all_dim) != (1.0, 0.0):
        raise ConvertError(f"{where}: YaRN with mscale={mscale}, mscale_all_dim={all_dim}: Megatron's attention "
                           "factor then differs from transformers'; only both non-zero, or 1 and 0, can be carried")
    original = number("original_max_position_embeddings", get("yarn_original_max_position_embeddings", 4096))
    return {"rope_type": "yarn", "factor": factor, "mscale": mscale, "mscale_all_dim": all_dim,
            # a fraction is kept, for ModelConfig to refuse by name
            "original_max_position_embeddings": int(original) if original.is_integer() else original,
            "beta_fast": number("beta_fast", get("yarn_beta_fast", 32.0)),
            "beta_slow": number("beta_slow", get("yarn_beta_slow", 1.0))}


def args_fields(c: ModelConfig) -> dict[str, Any]:
    """The Megatron args of MLA, DeepSeek routing and MTP (Megatron-LM's names; merged into the checkpoint args)."""
    out: dict[str, Any] = {"mtp_num_layers": c.mtp_layers or None, "multi_latent_attention": c.is_mla}
    if c.is_mla:
        yarn = yarn_args(c)
        out |= dict(q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank, qk_head_dim=c.qk_nope_head_dim,
                    qk_pos_emb_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, qk_layernorm=True,
                    rope_type="yarn" if yarn else "rope", use_rope_scaling=False, **(yarn or {}))
    if c.is_moe:
        out |= routing_args(c)
    return out


def routing_args(c: ModelConfig) -> dict[str, Any]:
    sigmoid = c.moe_router_score == "sigmoid"
    if sigmoid and c.moe_norm_topk != (c.moe_top_k > 1):
        raise ConvertError("Megatron renormalizes sigmoid routing weights exactly when it picks more than one "
                           f"expert; this model has moe_top_k={c.moe_top_k} and moe_norm_topk={c.moe_norm_topk}")
    if c.moe_router_group_topk and c.moe_top_k // c.moe_router_group_topk != 2:
        raise ConvertError(f"Megatron scores a group of experts by its best moe_router_topk // moe_router_group_topk "
                           f"= {c.moe_top_k // c.moe_router_group_topk} experts, this model (as DeepSeek) by its best "
                           "2: choose moe_router_group_topk = moe_top_k / 2")
    return dict(moe_router_score_function=c.moe_router_score, moe_router_enable_expert_bias=c.moe_router_expert_bias,
                moe_router_topk_scaling_factor=c.moe_router_scaling_factor if c.moe_router_scaling_factor != 1
                else None, moe_router_num_groups=c.moe_router_groups, moe_router_group_topk=c.moe_router_group_topk,
                moe_shared_expert_intermediate_size=c.moe_shared_expert_ffn_hidden_size,
                moe_router_dtype="fp32" if sigmoid else None)  # DeepSeek routes in float32


def yarn_args(c: ModelConfig) -> dict[str, Any] | None:
    """Megatron's YaRN args with the attention factor and softmax scale transformers computes, or None."""
    yarn = yarn_params(c.rope_scaling)
    if c.rope_scaling and yarn is None:
        raise ConvertError(f"Megatron's multi-latent attention supports YaRN rope scaling only; this model has "
                           f"{c.rope_scaling}")
    if yarn is None:
        return None
    extra = sorted(set(c.rope_scaling) - {"rope_type", "factor", "original_max_position_embeddings", "beta_fast",
                                          "beta_slow", "mscale", "mscale_all_dim", "truncate"})
    if extra or c.rope_scaling.get("truncate", True) is not True:
        raise ConvertError(f"Megatron's YaRN cannot express {', '.join(extra) or 'truncate=False'} in {c.rope_scaling}")
    mscale, all_dim = yarn["mscale"], yarn["mscale_all_dim"]
    if not all_dim:  # transformers then ignores mscale: the attention factor is mscale(f, 1), as Megatron's (1, 0)
        mscale = 1.0
    elif not mscale:
        raise ConvertError(f"YaRN with mscale=0 and mscale_all_dim={all_dim}: transformers' attention factor "
                           f"({yarn_mscale(yarn['factor'])}) has no Megatron spelling")
    orig, fast, slow = int(yarn["original_max_position_embeddings"]), yarn["beta_fast"], yarn["beta_slow"]
    return dict(rotary_scaling_factor=yarn["factor"], mscale=mscale, mscale_all_dim=all_dim,
                original_max_position_embeddings=orig, beta_fast=fast, beta_slow=slow,
                yarn_original_max_position_embeddings=orig, yarn_beta_fast=fast, yarn_beta_slow=slow)


def saver_problems(c: ModelConfig, tp: int, impl: str) -> list[str]:
    """Sizes the local spec's column-parallel down projections (and the shared experts) cannot split over TP."""
    sizes = [("moe_shared_expert_ffn_hidden_size", c.moe_shared_expert_ffn_hidden_size)]
    if c.is_mla and impl == "local":
        sizes += [("q_lora_rank", c.q_lora_rank), ("kv_lora_rank + qk_rope_head_dim",
                                                   c.kv_lora_rank + c.qk_rope_head_dim)]
    return [f"--tp {tp} does not divide {what}={size}" + (" (the local spec splits MLA's down projections over "
                                                          "TP; Transformer Engine's --transformer-impl te does not)"
                                                          if "rank" in what else "")
            for what, size in sizes if size and size % tp]
