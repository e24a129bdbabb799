"""The IR's model config: one frozen dataclass that says everything about a model but its weights.

Every loader fills a `ModelConfig` from its format's config (config.json, Megatron args, params.json);
every saver and mtrain read it. Values are checked when it is built (`mconvert.ir.checks`, `mconvert.ir.features`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

from mconvert.errors import ConvertError
from mconvert.ir import dtypes
from mconvert.ir.checks import check_model_config
from mconvert.ir.features import check_config

if TYPE_CHECKING:
    import torch


from mconvert.ir.dtypes import DType

Family = Literal["llama", "mistral", "mixtral", "gpt2", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "deepseek_v2",
                 "glm4_moe", "gemma3_text", "gpt_oss", "megatron_bert", "bert"]
# BERT encoders: bidirectional attention, an MLM head (see mconvert/ir/features.py); "bert" is HF's post-LN BERT
BERT_FAMILIES = ("megatron_bert", "bert")
Norm = Literal["rmsnorm", "layernorm"]
# geglu_tanh: gelu_tanh(gate(x)) * up(x); quick_geglu: GPT-OSS's clamped x * sigmoid(1.702 x) gate
Activation = Literal["swiglu", "gelu_tanh", "gelu", "geglu_tanh", "quick_geglu"]
PositionEmbedding = Literal["rope", "learned"]
RouterScore = Literal["softmax", "sigmoid"]


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Everything about a decoder-only transformer that the weights alone do not say.

    Mixture of experts: every layer holds `num_experts` experts except `dense_layers`, which hold a dense MLP of
    `ffn_hidden_size`; each expert's FFN is `moe_ffn_hidden_size`, None when it equals `ffn_hidden_size` (one
    spelling per model). A dense size no layer uses is kept as the source states it (Qwen3-MoE's
    `intermediate_size`, Megatron's `ffn_hidden_size`), so configs round-trip. `moe_norm_topk`: the top-k
    routing weights are renormalized to sum to 1 (HF `norm_topk_prob`; Megatron's default softmax-after-top-k),
    or used as the softmax over all experts gave them (Megatron `moe_router_pre_softmax`).

    `padded_vocab_size` is informational: the padded size found in the source (Megatron), which savers recompute
    for their own layout.

    `qk_norm`: queries and keys are normalized per head (over head_dim, the model's norm and epsilon) after their
    projections and before rotary positions (Qwen3, Megatron `qk_layernorm`). `full_attention_layers`: the layers
    exempt from `sliding_window`, which attend to every earlier key (Qwen2's first `max_window_layers`, the zeros
    of Megatron's `window_attn_skip_freq`); kept without a window too, where it changes nothing, so that a Qwen
    config.json's `max_window_layers` survives a round trip.

    DeepSeek-V3 (the fields after `full_attention_layers`; their defaults describe every other family, see
    mconvert/ir/features.py for what each means and how it is checked): multi-latent attention when `kv_lora_rank` is
    set (then `head_dim` is a query/key head, its no-position part plus `qk_rope_head_dim`), shared experts beside
    the routed ones, sigmoid router scores with a per-expert choice bias, group-limited top-k and a scaling of the
    routed output, and `mtp_layers` multi-token-prediction modules after the last layer (GLM-4.5 has the same
    routing, shared experts and MTP modules with standard attention).

    `rotary_percent`: the fraction of each query/key head that rotary positions turn (GLM-4.5's
    `partial_rotary_factor`, Megatron's `rotary_percent`): its first `rotary_dim` features, in the half-split order;
    the rest pass unchanged.
    """

    family: Family
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    padded_vocab_size: int | None = None
    norm: Norm = "rmsnorm"
    norm_eps: float = 1e-5
    activation: Activation = "swiglu"
    position_embedding: PositionEmbedding = "rope"
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF's dict, e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    qkv_bias: bool = False
    proj_bias: bool = False
    mlp_bias: bool = False
    tie_embeddings: bool = False
    sliding_window: int | None = None  # keys a query sees, itself included (HF's meaning)
    num_experts: int | None = None
    moe_top_k: int | None = None
    moe_aux_loss_coeff: float | None = None
    moe_jitter_eps: float | None = None
    moe_ffn_hidden_size: int | None = None
    dense_layers: tuple[int, ...] = ()
    moe_norm_topk: bool = True
    dtype: DType = "float32"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    qk_norm: bool = False
    full_attention_layers: tuple[int, ...] = ()
    q_lora_rank: int | None = None  # MLA: rank of the query's low-rank projection; None: one q projection
    kv_lora_rank: int | None = None  # MLA: size of the key/value latent; None: standard attention
    qk_rope_head_dim: int | None = None  # MLA: the rotary part of each query/key head
    v_head_dim: int | None = None  # MLA: size of a value head
    moe_shared_expert_ffn_hidden_size: int | None = None  # FFN of the shared expert(s) every token goes through
    moe_router_score: RouterScore = "softmax"
    moe_router_expert_bias: bool = False  # a per-expert bias added to the scores to choose experts, not to weigh
    moe_router_groups: int | None = None  # experts split in groups; each token chooses among ...
    moe_router_group_topk: int | None = None  # ... this many groups (best top-2 sums)
    moe_router_scaling_factor: float = 1.0  # the routed experts' weights are scaled by it
    mtp_layers: int = 0  # multi-token-prediction modules after the last layer
    rotary_percent: float = 1.0  # the fraction of a query/key head rotary positions turn (its first rotary_dim)
    # Gemma 3 (see mconvert/ir/features.py for what each means; the defaults describe every other family)
    sandwich_norms: bool = False  # norms of the attention and MLP outputs, before each residual add
    norm_zero_centered: bool = False  # every norm scales by (1 + weight): Megatron's apply_layernorm_1p
    embedding_multiplier: float = 1.0  # token embeddings times this, in the embedding's dtype
    local_rope_theta: float | None = None  # rope theta of the windowed layers (no scaling); None: rope_theta
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2 power; None: head_dim's
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap), before the mask
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    # GPT-OSS (see mconvert/ir/features.py): per-head attention sinks, a router bias, a clamped, offset GLU
    attention_sinks: bool = False  # one learned logit per head joins each softmax (layers.{L}.attn.sinks)
    moe_router_bias: bool = False  # the router's linear has a bias (added to the logits: chooses and weighs)
    glu_linear_offset: float = 0.0  # the gated unit is act(gate) * (up + offset)
    activation_clamp: float | None = None  # gate clamped above at it, up to [-it, it], before the gated unit
    # BERT (families in BERT_FAMILIES; see mconvert/ir/features.py for the model they describe and names.py for the
    # tensors; the defaults describe every other family)
    num_tokentypes: int = 0  # token-type (segment) embeddings added to the input; 0: none
    pooler: bool = False  # tanh(pooler(h[:, 0])): the pooled output of the first token
    binary_head: bool = False  # next-sentence (binary) logits from the pooled output; needs the pooler
    post_norm: bool = False  # post-LN layers and a norm of the embeddings, no final norm (HF "bert" only)
    lm_head_bias: bool = False  # a bias on the LM head's logits (every BERT has one)
    # the activation of the MLM head's transform: Megatron's BertLMHead always computes exact gelu, whatever the
    # MLP's (its fused bias-GELU computes the tanh approximation); transformers' uses hidden_act for both
    mlm_head_activation: Activation = "gelu"

    def __post_init__(self) -> None:
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ConvertError(f"config field {name}={getattr(self, name)!r} is not one of {', '.join(choices)}")
        positive = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                    "head_dim", "vocab_size", "max_position_embeddings")
        bad = [f"{n}={getattr(self, n)}" for n in positive if not isinstance(getattr(self, n), int)
               or getattr(self, n) <= 0]
        if bad:
            raise ConvertError(f"config fields must be positive integers: {', '.join(bad)}")
        if self.num_attention_heads % self.num_query_groups:
            raise ConvertError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_query_groups={self.num_query_groups} (key/value heads)"
            )
        if self.is_moe and not (self.moe_top_k and 0 < self.moe_top_k <= self.num_experts):
            raise ConvertError(f"MoE config needs 0 < moe_top_k <= num_experts, got {self.moe_top_k}, "
                               f"{self.num_experts}")
        self._check_moe_layers()
        self._check_window_layers()
        self._check_bert()
        check_model_config(self)  # non-finite or out-of-range numbers (NaN epsilon, negative rope theta, ...)
        check_config(self)  # DeepSeek's fields that contradict each other or the rest

    def _check_window_layers(self) -> None:
        full = tuple(self.full_attention_layers)
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_layers for i in full) \
                or full != tuple(sorted(set(full))):
            raise ConvertError(f"full_attention_layers must be distinct layer numbers in [0, {self.num_layers}) in "
                               f"increasing order, got {list(full)}")
        object.__setattr__(self, "full_attention_layers", full)  # a JSON list reads back as the same tuple

    def _check_bert(self) -> None:
        """BERT as Megatron and transformers build it: learned absolute positions, LayerNorm, a dense ungated MLP,
        multi-head attention, a biased LM head; BERT's own fields on BERT families only."""
        n = self.num_tokentypes
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConvertError(f"num_tokentypes must be a non-negative integer, got {n!r}")
        bert = {"num_tokentypes": n > 0, "pooler": self.pooler, "binary_head": self.binary_head,
                "post_norm": self.post_norm, "mlm_head_activation": self.mlm_head_activation != "gelu"}
        if not self.is_bert:
            if set_ := [name for name, on in bert.items() if on]:
                raise ConvertError(f"{', '.join(set_)} describe BERT encoders (families {', '.join(BERT_FAMILIES)}), "
                                   f"not family {self.family!r}")
            return
        bad = [f"{name}={value!r}" for name, value, ok in (
            ("position_embedding", self.position_embedding, self.position_embedding == "learned"),
            ("norm", self.norm, self.norm == "layernorm"),
            ("activation", self.activation, not self.gated),
            ("mlm_head_activation", self.mlm_head_activation, self.mlm_head_activation in ("gelu", "gelu_tanh")),
            ("num_experts", self.num_experts, not self.is_moe),
            ("kv_lora_rank", self.kv_lora_rank, not self.is_mla),
            ("sliding_window", self.sliding_window, self.sliding_window is None),
            ("mtp_layers", self.mtp_layers, not self.mtp_layers),
            ("qk_norm", self.qk_norm, not self.qk_norm),
            ("lm_head_bias", self.lm_head_bias, self.lm_head_bias),
            ("post_norm", self.post_norm, self.post_norm == (self.family == "bert")),
            ("binary_head", self.binary_head, self.pooler or not self.binary_head),
        ) if not ok]
        if bad:
            raise ConvertError(f"a BERT encoder (family {self.family!r}) has learned absolute positions, LayerNorm, "
                               "an ungated dense MLP, multi-head attention, a biased LM head, post-LN layers exactly "
                               "in family 'bert', and a binary head only with the pooler; this config has "
                               + ", ".join(bad))

    @property
    def is_bert(self) -> bool:
        """A BERT encoder: bidirectional attention over the unpadded tokens, an MLM head (mconvert.ir.features)."""
        return self.family in BERT_FAMILIES

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (keys a query sees, itself included), or None for full attention."""
        return None if layer in self.full_attention_layers else self.sliding_window

    def layer_rope_theta(self, layer: int) -> float:
        """The rope theta of layer `layer`: `local_rope_theta` in windowed layers when set (Gemma 3), else
        `rope_theta`."""
        if self.local_rope_theta is not None and self.layer_window(layer) is not None:
            return self.local_rope_theta
        return self.rope_theta

    @property
    def attention_scale(self) -> float | None:
        """The factor the q.k scores are multiplied by, None for the usual 1/sqrt(head_dim)."""
        return None if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar ** -0.5

    def _check_moe_layers(self) -> None:
        dense = tuple(self.dense_layers)
        if not self.is_moe and (dense or self.moe_ffn_hidden_size is not None):
            raise ConvertError("dense_layers and moe_ffn_hidden_size describe mixture-of-experts models; this one "
                               "has no experts")
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_layers for i in dense) \
                or dense != tuple(sorted(set(dense))):
            raise ConvertError(f"dense_layers must be distinct layer numbers in [0, {self.num_layers}) in "
                               f"increasing order, got {list(dense)}")
        if self.is_moe and len(dense) == self.num_layers:
            raise ConvertError("dense_layers names every layer: a mixture-of-experts model needs a layer with experts")
        if self.moe_ffn_hidden_size is not None and (not isinstance(self.moe_ffn_hidden_size, int)
                                                     or self.moe_ffn_hidden_size <= 0):
            raise ConvertError(f"moe_ffn_hidden_size must be a positive integer, got {self.moe_ffn_hidden_size}")
        object.__setattr__(self, "dense_layers", dense)  # a JSON list reads back as the same tuple
        if self.moe_ffn_hidden_size == self.ffn_hidden_size:  # one spelling per model
            object.__setattr__(self, "moe_ffn_hidden_size", None)

    @property
    def gated(self) -> bool:
        return self.activation in ("swiglu", "geglu_tanh", "quick_geglu")

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    def is_moe_layer(self, layer: int) -> bool:
        """Does layer `layer` hold experts (rather than a dense MLP)?"""
        return self.is_moe and layer not in self.dense_layers

    @property
    def expert_ffn_hidden_size(self) -> int:
        """Each expert's FFN size (MoE models)."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - len(self.dense_layers) if self.is_moe else 0

    @property
    def is_mla(self) -> bool:
        """Multi-latent attention (DeepSeek) rather than multi-head attention with grouped key/value heads."""
        return self.kv_lora_rank is not None

    @property
    def qk_nope_head_dim(self) -> int:
        """MLA: the part of a query/key head without rotary positions."""
        return self.head_dim - (self.qk_rope_head_dim or 0)

    @property
    def rotary_dim(self) -> int:
        """The query/key features rotary positions turn: MLA's rotary part, else the first `rotary_percent` of a head
        (as transformers and Megatron round it)."""
        return self.qk_rope_head_dim if self.is_mla else int(self.head_dim * self.rotary_percent)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtypes.to_torch(self.dtype)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConvertError(f"unknown ModelConfig field(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [name for name in required if name not in data]
        if missing:
            raise ConvertError(f"ModelConfig needs field(s) {', '.join(missing)}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        return cls.from_dict(json.loads(text))


_CHOICES: dict[str, tuple[str, ...]] = {
    "family": get_args(Family),
    "norm": get_args(Norm),
    "activation": get_args(Activation),
    "mlm_head_activation": get_args(Activation),
    "position_embedding": get_args(PositionEmbedding),
    "dtype": get_args(DType),
    "moe_router_score": get_args(RouterScore),
}
