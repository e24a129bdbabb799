"""What the IR means by its model features (DeepSeek-V3's among them), the checks that keep a config meaningful,
and the features formats declare they hold.

Multi-latent attention (MLA), per layer, with nh heads, dn = qk_nope_head_dim, dr = qk_rope_head_dim,
dv = v_head_dim (IR names under `layers.{L}.attn.`):

    q      = q_up(q_norm(q_down(x)))        or q(x) without a query LoRA      (T, nh, dn + dr)
    kv     = kv_down(x) = [c (kv_lora_rank) | k_rope (dr)]                    one k_rope shared by the heads
    k, v   = kv_up(kv_norm(c)) per head = [k_nope (dn) | v (dv)]
    scores = ([q_nope | rope(q_rope)] . [k_nope | rope(k_rope)]) * softmax_scale
    out    = o(softmax(scores) v)

The rotary rows (the last dr rows of each head of `q`/`q_up`, the last dr rows of `kv_down`) are kept in the
half-split ("rotate_half") order of the rest of the IR. DeepSeek's checkpoints and Megatron's MLA store them
interleaved (pairs (x0, x1), (x2, x3), ...): both de-interleave at run time, transformers with `rope_interleave`,
Megatron always (its MLA rotary code); so both formats permute those rows on the way in and out.

Routing (`moe_router_score = "sigmoid"`): s = sigmoid(router(x)); experts are chosen by s + expert_bias (the bias
only chooses, it never weighs); with groups, each token keeps the `moe_router_group_topk` groups whose two best
choice scores sum highest and picks its top-k experts among them; the weights are the chosen s, divided by their
sum (+1e-20) when `moe_norm_topk`, times `moe_router_scaling_factor`. The shared experts' MLP (SwiGLU of
`moe_shared_expert_ffn_hidden_size`) is added to the routed output of every MoE layer.

YaRN (`rope_scaling = {"rope_type": "yarn", ...}`, meant as transformers computes it): the rotary frequencies
blend interpolation and extrapolation; cos and sin are multiplied by the attention factor, `mscale(f, mscale) /
mscale(f, mscale_all_dim)` when both are non-zero, else `mscale(f, 1)`; and with MLA the softmax scale is
multiplied by `mscale(f, mscale_all_dim)**2` when mscale_all_dim is non-zero; `mscale(f, m) = 0.1 * m * ln(f) + 1`
(1 when f <= 1).

Partial rotary (`rotary_percent` < 1, GLM-4.5): rotary positions turn the first `rotary_dim = int(head_dim *
rotary_percent)` features of each query and key head (half-split within them), and the rest pass unchanged, as
transformers' `partial_rotary_factor` and Megatron's `--rotary-percent` compute it.
GPT-OSS: attention sinks (`attention_sinks`, `layers.{L}.attn.sinks` [nh]): each head's softmax over the scores
gets one more logit, the sink, whose probability is dropped: p_j = exp(s_j) / (exp(sink) + sum_k exp(s_k)) (Megatron
`softmax_type="learnable"`, its `softmax_offset`). A router bias (`moe_router_bias`) is added to the router's
logits before top-k (it chooses and weighs, unlike DeepSeek's expert bias). `activation = "quick_geglu"`: the gated
unit is g * sigmoid(1.702 g) * (u + glu_linear_offset), where with `activation_clamp` = c, g = min(gate, c) and
u = clamp(up, -c, c) (Megatron `--quick-geglu`, `glu_linear_offset`, `activation_func_clamp_value`).

Multi-token prediction (MTP) module i (0-based) predicts one token further than module i-1 (the main model for
i = 0): h = layer(eh_proj([enorm(embed(next tokens)) | hnorm(h_prev)])), logits = lm_head(final_norm(h)), where
h_prev is module i-1's h (the main model's output after its final norm for i = 0), as Megatron and transformers'
MtpModel compute it; its transformer layer is IR layer `num_layers + i` (as Hugging Face numbers it), its own
tensors are `mtp.{i}.*`.

Gemma 3 (each a declared feature below; transformers' Gemma3ForCausalLM is the meaning):

    h = embed(tokens) * embedding_multiplier       the multiplier cast to the embedding's dtype first (sqrt(h))
    norm(x) = rms_norm(x) * (1 + w)                 norm_zero_centered, in float32, for every norm of the model
    layer:  h = h + post_attn_norm(attn(attn_norm(h)))       sandwich_norms: the sublayer's output normalized
            h = h + post_mlp_norm(mlp(mlp_norm(h)))           before the residual add
    mlp(x) = down(gelu_tanh(gate(x)) * up(x))       activation geglu_tanh
    scores = q.k * query_pre_attn_scalar**-0.5      (head_dim**-0.5 when unset), then, with attn_logit_softcap,
             cap * tanh(scores / cap), then the mask
    logits = cap * tanh(logits / cap)               final_logit_softcap
    rope:   a windowed layer (sliding_window, not in full_attention_layers) rotates with local_rope_theta and no
            scaling when it is set; the other layers with rope_theta and rope_scaling

BERT (families megatron_bert and bert; megatron-core's BertModel and transformers' MegatronBert / Bert are the
meaning), with tokens t, token types y (zeros when not given), positions p and `act` the model's activation:

    h = embed(t) + pos_embed(p) + token_type_embed(y)     token_type_embed with num_tokentypes > 0
    post_norm (HF "bert"):  h = embed_norm(h); per layer h = attn_norm(h + attn(h)); h = mlp_norm(h + mlp(h));
                            no final norm
    otherwise (pre-LN):     per layer as a GPT layer, then h = final_norm(h)
    attention:  bidirectional: every query sees every key the padding mask keeps (no causal mask)
    mlm logits = lm_head(mlm_head.norm(act_m(mlm_head.dense(h)))) + lm_head.bias     lm_head tied to embed or not,
                 act_m the mlm_head_activation (exact gelu in Megatron's BertLMHead, hidden_act in transformers)
    pooled     = tanh(pooler(h[:, 0]))                     pooler
    nsp logits = nsp_head(pooled)                          binary_head (logit 0: "is the next sentence")
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mconvert.errors import ConvertError

if TYPE_CHECKING:
    from mconvert.ir.config import ModelConfig

YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def check_config(c: ModelConfig) -> None:
    """Refuse DeepSeek fields that contradict each other or the rest of the config (one error, every problem).
    Each value is in its own range already (mconvert.ir.checks runs first)."""
    problems = _mla_problems(c) + _routing_problems(c) + _rotary_problems(c) + _gpt_oss_problems(c)
    if problems:
        raise ConvertError("inconsistent config: " + "; ".join(problems))


def _mla_problems(c: ModelConfig) -> list[str]:
    fields = ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim")
    given = [n for n in fields if getattr(c, n) is not None]
    if not given:
        return ["q_lora_rank describes multi-latent attention, which needs kv_lora_rank"] \
            if c.q_lora_rank is not None else []
    problems = []
    if len(given) != len(fields):
        problems.append(f"multi-latent attention needs all of {', '.join(fields)}; given only {', '.join(given)}")
    elif c.qk_rope_head_dim % 2 or c.qk_rope_head_dim >= c.head_dim:
        problems.append(f"qk_rope_head_dim={c.qk_rope_head_dim} must be even and smaller than head_dim="
                        f"{c.head_dim} (the query/key head: its part without positions plus the rotary part)")
    if c.num_query_groups != c.num_attention_heads:
        problems.append(f"multi-latent attention has one key/value per head: num_query_groups must equal "
                        f"num_attention_heads={c.num_attention_heads}, got {c.num_query_groups}")
    if c.position_embedding != "rope" or c.qkv_bias or c.proj_bias:
        problems.append("multi-latent attention uses rotary positions and no attention biases")
    if c.qk_norm:
        problems.append("qk_norm (per-head q/k norms) with multi-latent attention, which normalizes its latents "
                        "instead (q_norm, kv_norm)")
    return problems


def _rotary_problems(c: ModelConfig) -> list[str]:
    percent = c.rotary_percent
    if isinstance(percent, bool) or not isinstance(percent, (int, float)) or not 0 < percent <= 1:
        return [f"rotary_percent={percent!r} must be a fraction in (0, 1] of each head"]
    if percent == 1:
        return []
    if c.is_mla or c.position_embedding != "rope":
        return [f"rotary_percent={percent} (partial rotary) needs rotary positions and standard attention "
                "(multi-latent attention sets its rotary part with qk_rope_head_dim)"]
    if c.rotary_dim < 2 or c.rotary_dim % 2:
        return [f"rotary_percent={percent} of head_dim={c.head_dim} turns {c.rotary_dim} features; rotary positions "
                "turn pairs: an even number, at least 2"]
    return []
def _gpt_oss_problems(c: ModelConfig) -> list[str]:
    problems = []
    if (c.activation_clamp is not None or c.glu_linear_offset != 0.0) and not c.gated:
        problems.append(f"activation_clamp and glu_linear_offset describe a gated unit; activation {c.activation} "
                        "has no gate")
    if c.moe_router_bias and not c.is_moe:
        problems.append("moe_router_bias describes mixture-of-experts models; this one has no experts")
    if c.attention_sinks and c.is_mla:
        problems.append("attention sinks with multi-latent attention")
    return problems


def _routing_problems(c: ModelConfig) -> list[str]:
    deepseek = {"moe_shared_expert_ffn_hidden_size": c.moe_shared_expert_ffn_hidden_size is not None,
                "moe_router_score": c.moe_router_score != "softmax", "moe_router_expert_bias": c.moe_router_expert_bias,
                "moe_router_groups": c.moe_router_groups is not None or c.moe_router_group_topk is not None,
                "moe_router_scaling_factor": c.moe_router_scaling_factor != 1.0}
    if not c.is_moe:
        set_ = [n for n, on in deepseek.items() if on]
        return [f"{', '.join(set_)} describe mixture-of-experts models; this one has no experts"] if set_ else []
    problems = []
    if c.moe_router_expert_bias and c.moe_router_score != "sigmoid":
        problems.append("moe_router_expert_bias is defined for sigmoid router scores only")
    groups, topk = c.moe_router_groups, c.moe_router_group_topk
    if (groups is None) != (topk is None):
        problems.append("moe_router_groups and moe_router_group_topk go together")
    elif groups is not None and not problems:
        if c.moe_router_score != "sigmoid":
            problems.append("group-limited routing (moe_router_groups) is defined for sigmoid router scores only")
        if c.num_experts % groups or c.num_experts // groups < 2:
            problems.append(f"moe_router_groups={groups} must divide num_experts={c.num_experts} into groups of at "
                            "least 2 (a group is scored by its two best experts)")
        elif not 1 <= topk <= groups or c.moe_top_k > topk * (c.num_experts // groups):
            problems.append(f"moe_router_group_topk={topk} must be in [1, {groups}] and leave at least moe_top_k="
                            f"{c.moe_top_k} experts to choose from")
    return problems


def yarn_params(scaling: dict[str, Any] | None) -> dict[str, float] | None:
    """The YaRN parameters of a rope_scaling dict with transformers' defaults filled in, or None if not YaRN."""
    if not scaling or scaling.get("rope_type") != "yarn":
        return None
    out = {k: float(scaling.get(k) if scaling.get(k) is not None else v) for k, v in YARN_DEFAULTS.items()}
    out["factor"] = float(scaling["factor"])
    out["original_max_position_embeddings"] = float(scaling["original_max_position_embeddings"])
    return out


# The features a format may or may not hold, by the name a family or format declares in its SUPPORTS:
# name -> (how an error says it, does the model have it). A model has the features whose test is true; a format
# that does not declare one refuses the model, naming it (see mconvert.registry.missing_features).
FEATURES: dict[str, tuple[Callable[[ModelConfig], str], Callable[[ModelConfig], bool]]] = {
    "qk_norm": (lambda c: "per-head q/k norms", lambda c: c.qk_norm),
    "mla": (lambda c: "multi-latent attention", lambda c: c.is_mla),
    "shared_experts": (lambda c: "shared experts", lambda c: bool(c.moe_shared_expert_ffn_hidden_size)),
    "router_score": (lambda c: f"{c.moe_router_score} router scores", lambda c: c.moe_router_score != "softmax"),
    "router_expert_bias": (lambda c: "a router expert bias", lambda c: c.moe_router_expert_bias),
    "group_routing": (lambda c: "group-limited routing", lambda c: c.moe_router_groups is not None),
    "router_scaling": (lambda c: f"routed weights scaled by {c.moe_router_scaling_factor}",
                       lambda c: c.moe_router_scaling_factor != 1.0),
    "partial_rotary": (lambda c: f"rotary positions on {c.rotary_percent:g} of each head (partial rotary)",
                       lambda c: c.rotary_percent != 1.0),
    "mtp": (lambda c: f"{c.mtp_layers} multi-token-prediction module(s) (--skip-mtp leaves them out)",
            lambda c: bool(c.mtp_layers)),
    "sandwich_norms": (lambda c: "norms of the attention and MLP outputs (sandwich norms)",
                       lambda c: c.sandwich_norms),
    "norm_zero_centered": (lambda c: "norms scaling by (1 + weight)", lambda c: c.norm_zero_centered),
    "embedding_multiplier": (lambda c: f"embeddings multiplied by {c.embedding_multiplier}",
                             lambda c: c.embedding_multiplier != 1.0),
    "geglu": (lambda c: "a gated GELU (tanh) MLP", lambda c: c.activation == "geglu_tanh"),
    "local_rope": (lambda c: f"a rope theta of {c.local_rope_theta} in the windowed layers",
                   lambda c: c.local_rope_theta is not None),
    "query_pre_attn_scalar": (lambda c: f"attention scores scaled by {c.query_pre_attn_scalar}**-0.5",
                              lambda c: c.query_pre_attn_scalar is not None),
    "attn_softcap": (lambda c: f"attention scores soft-capped at {c.attn_logit_softcap}",
                     lambda c: c.attn_logit_softcap is not None),
    "final_softcap": (lambda c: f"logits soft-capped at {c.final_logit_softcap}",
                      lambda c: c.final_logit_softcap is not None),
    "attention_sinks": (lambda c: "attention sinks (a learned logit per head)", lambda c: c.attention_sinks),
    "router_bias": (lambda c: "a router bias", lambda c: c.moe_router_bias),
    "expert_bias": (lambda c: "expert biases", lambda c: c.is_moe and c.mlp_bias),
    "clamped_glu": (lambda c: f"a gated unit clamped at {c.activation_clamp} with up offset by {c.glu_linear_offset}",
                    lambda c: c.activation_clamp is not None or c.glu_linear_offset != 0.0),
    "bert": (lambda c: f"a BERT encoder ({c.family}: bidirectional attention, an MLM head)", lambda c: c.is_bert),
    "post_norm": (lambda c: "post-LN layers (a norm after each residual add)", lambda c: c.post_norm),
}


def features(c: ModelConfig) -> dict[str, str]:
    """The declarable features the model has: name -> how an error says it."""
    return {name: describe(c) for name, (describe, present) in FEATURES.items() if present(c)}
