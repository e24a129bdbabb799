"""Hugging Face GPT-OSS: the key table (bfloat16 or MXFP4 experts) and the config.json mapping.

On disk (transformers 5's `save_pretrained`, and OpenAI's release), per layer i:

    model.layers.{i}.self_attn.{q,k,v,o}_proj.{weight,bias}        biased attention
    model.layers.{i}.self_attn.sinks                   [nh]         one sink logit per head
    model.layers.{i}.mlp.router.{weight,bias}          [E, h], [E]
    model.layers.{i}.mlp.experts.gate_up_proj          [E, h, 2f]   transposed; columns gate_0, up_0, gate_1, ...
    model.layers.{i}.mlp.experts.gate_up_proj_bias     [E, 2f]      interleaved the same way
    model.layers.{i}.mlp.experts.down_proj             [E, f, h]    transposed
    model.layers.{i}.mlp.experts.down_proj_bias        [E, h]

OpenAI's release stores gate_up_proj and down_proj as MXFP4 (`*_blocks` + `*_scales`, see mconvert.rules.mxfp4),
dequantized to bfloat16 as they are read. `layer_types` says which layers slide (`sliding_attention`, the window
`sliding_window`) and which attend to everything (`full_attention`: the IR's `full_attention_layers`). The experts'
gated unit is (clamp(up, -limit, limit) + 1) * g * sigmoid(1.702 g), g = min(gate, limit): the IR's `quick_geglu`
with `glu_linear_offset` 1 and `activation_clamp` limit.

Reading (plugin `gpt_oss_hf`): Hugging Face GPT-OSS directories, bfloat16 (or float32) or MXFP4 experts.

Writing (plugin `gpt_oss_hf`): a Hugging Face GPT-OSS directory with unquantized experts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mconvert.errors import ConvertError
from mconvert.hf.config import parse, rope_decoder_config, rope_decoder_fields
from mconvert.hf.family import HFFamily, load_hf, register_family, save_hf
from mconvert.ir.config import ModelConfig
from mconvert.ir.tensors import LazyTensor, ModelIR
from mconvert.lazy import torch
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.registry import missing_features
from mconvert.rules import mxfp4, transforms
from mconvert.rules.experts import STACK
from mconvert.rules.table import Join, Rule, Table

MODEL_TYPE = "gpt_oss"
ARCHITECTURE = "GptOssForCausalLM"
SUPPORTS = frozenset({"attention_sinks", "router_bias", "expert_bias", "clamped_glu"})
ALPHA = 1.702  # the sigmoid gain of transformers' GptOssExperts, Megatron's quick_gelu: the only one the IR has
LAYER_TYPES = ("sliding_attention", "full_attention")


def _interleave(pairs: list[Any]) -> Any:
    """[(gate_e, up_e) ...] -> [E, ..., 2f] with gate_e's rows (transposed) in the even columns."""
    return transforms.stack_experts([torch.stack([g.t(), u.t()], dim=-1).flatten(-2) if g.dim() == 2
                                     else torch.stack([g, u], dim=-1).flatten(-2) for g, u in pairs])


def _deinterleave(t: Any) -> list[Any]:
    out = []
    for e in transforms.unstack_experts(t):
        gate, up = e[..., 0::2], e[..., 1::2]
        out += [gate.t().contiguous(), up.t().contiguous()] if e.dim() == 2 else [gate.contiguous(), up.contiguous()]
    return out


# gate_up_proj [E, h, 2f] (and its bias [E, 2f]) <-> gate_0, up_0, gate_1, ... ([f, h] / [f])
INTERLEAVED_GATE_UP = Join("interleaved_gate_up", lambda ts, ctx: _interleave(list(zip(ts[0::2], ts[1::2]))),
                           lambda t, ctx: _deinterleave(t))
# down_proj [E, f, h] <-> down_0, down_1, ... ([h, f])
STACK_TRANSPOSED = Join("stack_experts_transposed",
                        lambda ts, ctx: transforms.stack_experts([t.t() for t in ts]),
                        lambda t, ctx: [e.t().contiguous() for e in transforms.unstack_experts(t)])

_EXPERTS = "model.layers.{L}.mlp.experts"
_E = "layers.{L}.moe.experts.{E}"
TABLE = Table(
    embedding=(Rule("model.embed_tokens.weight", ("embed.weight",)),),
    layer=(
        Rule("model.layers.{L}.input_layernorm.weight", ("layers.{L}.attn_norm.weight",)),
        *(Rule(f"model.layers.{{L}}.self_attn.{hf}_proj.{kind}", (f"layers.{{L}}.attn.{ir}.{kind}",))
          for hf, ir in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "o")) for kind in ("weight", "bias")),
        Rule("model.layers.{L}.self_attn.sinks", ("layers.{L}.attn.sinks",)),
        Rule("model.layers.{L}.post_attention_layernorm.weight", ("layers.{L}.mlp_norm.weight",)),
        Rule("model.layers.{L}.mlp.router.weight", ("layers.{L}.moe.router.weight",)),
        Rule("model.layers.{L}.mlp.router.bias", ("layers.{L}.moe.router.bias",)),
    ),
    expert_stack=(
        Rule(f"{_EXPERTS}.gate_up_proj", (f"{_E}.gate.weight", f"{_E}.up.weight"), INTERLEAVED_GATE_UP),
        Rule(f"{_EXPERTS}.gate_up_proj_bias", (f"{_E}.gate.bias", f"{_E}.up.bias"), INTERLEAVED_GATE_UP),
        Rule(f"{_EXPERTS}.down_proj", (f"{_E}.down.weight",), STACK_TRANSPOSED),
        Rule(f"{_EXPERTS}.down_proj_bias", (f"{_E}.down.bias",), STACK),
    ),
    head=(Rule("model.norm.weight", ("final_norm.weight",)), Rule("lm_head.weight", ("lm_head.weight",))),
)

EMBED_KEY = "model.embed_tokens.weight"
# Present in some checkpoints, never model weights: rotary frequencies (recomputed from the rope parameters).
DROP = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)

# transformers' GptOssConfig defaults, for fields config.json leaves out
DEFAULTS = {"num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128, "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5, "num_local_experts": 128, "num_experts_per_tok": 4, "swiglu_alpha": ALPHA,
            "swiglu_limit": 7.0, "router_aux_loss_coef": 0.001, "attention_bias": True, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}}


def _full_attention_layers(hf: dict[str, Any], layers: int, where: str) -> tuple[int, ...]:
    """The layers `layer_types` marks `full_attention` (default: every second, from layer 1, as transformers)."""
    types = hf.get("layer_types")
    if types is None:
        return tuple(i for i in range(layers) if i % 2)
    if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise ConvertError(f"{where}: layer_types {types!r}: expected one of {' or '.join(LAYER_TYPES)} per layer "
                           f"(num_hidden_layers={layers})")
    return tuple(i for i, t in enumerate(types) if t == "full_attention")


def config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    """The IR config of a GPT-OSS config.json."""
    if hf.get("model_type") != MODEL_TYPE:
        raise ConvertError(f"{where}: model_type {hf.get('model_type')!r} is not a GPT-OSS model (expected "
                           f"{MODEL_TYPE!r})")
    hf = DEFAULTS | {k: v for k, v in hf.items() if v is not None or k in ("bos_token_id", "eos_token_id")}
    if float(hf["swiglu_alpha"]) != ALPHA:
        raise ConvertError(f"{where}: swiglu_alpha {hf['swiglu_alpha']!r} is not supported (expected {ALPHA}, the "
                           "gain of Megatron's quick_gelu)")
    layers = int(hf.get("num_hidden_layers", 0))
    full = _full_attention_layers(hf, layers, where)
    window = hf["sliding_window"]
    if window is not None and len(full) < layers and int(window) > int(hf["max_position_embeddings"]):
        raise ConvertError(f"{where}: sliding_window {window} is larger than max_position_embeddings "
                           f"{hf['max_position_embeddings']}: no sequence can reach it")
    bias = bool(hf["attention_bias"])
    return parse(where, lambda: ModelConfig(
        family="gpt_oss", **(rope_decoder_fields(hf) | dict(
            activation="quick_geglu", glu_linear_offset=1.0, activation_clamp=float(hf["swiglu_limit"]))),
        qkv_bias=bias, proj_bias=bias, mlp_bias=True, attention_sinks=True, moe_router_bias=True,
        sliding_window=None if window is None else int(window), full_attention_layers=full,
        num_experts=int(hf["num_local_experts"]), moe_top_k=int(hf["num_experts_per_tok"]),
        moe_aux_loss_coeff=float(hf["router_aux_loss_coef"])))


def config_to_hf(c: ModelConfig) -> dict[str, Any]:
    """A GPT-OSS config.json for the IR config; refuses what GptOssForCausalLM cannot express."""
    unsupported = [what for what, bad in (
        ("no experts (GPT-OSS has experts in every layer)", not c.is_moe),
        (f"dense MLP layers {list(c.dense_layers)}", bool(c.dense_layers)),
        ("no attention sinks", not c.attention_sinks),
        ("no router bias", c.is_moe and not c.moe_router_bias),
        ("experts without biases", not c.mlp_bias),
        ("different biases on q/k/v and on the output projection", c.qkv_bias != c.proj_bias),
        (f"activation {c.activation} (GPT-OSS uses quick_geglu)", c.activation != "quick_geglu"),
        (f"glu_linear_offset {c.glu_linear_offset} (GPT-OSS adds 1)", c.glu_linear_offset != 1.0),
        ("an unclamped gated unit", c.activation_clamp is None),
        ("top-k routing weights left unnormalized (GPT-OSS takes the softmax of the top-k logits)",
         not c.moe_norm_topk),
        (f"{c.norm} (GPT-OSS uses RMSNorm)", c.norm != "rmsnorm"),
        ("learned position embeddings (GPT-OSS uses rotary)", c.position_embedding != "rope"),
        (f"full_attention_layers {list(c.full_attention_layers)} without a sliding window",
         c.sliding_window is None and len(c.full_attention_layers) < c.num_layers),
        (f"expert FFN {c.expert_ffn_hidden_size} different from the dense one {c.ffn_hidden_size}",
         c.moe_ffn_hidden_size is not None),
    ) if bad] + missing_features(c, SUPPORTS)
    if unsupported:
        raise ConvertError(f"HF GPT-OSS cannot hold this model: {', '.join(unsupported)}")
    return rope_decoder_config(c, ARCHITECTURE, MODEL_TYPE) | {
        "attention_bias": c.qkv_bias,
        "layer_types": ["full_attention" if c.layer_window(i) is None else "sliding_attention"
                        for i in range(c.num_layers)],
        "sliding_window": c.sliding_window,
        "num_local_experts": c.num_experts,
        "num_experts_per_tok": c.moe_top_k,
        "output_router_logits": False,
        "router_aux_loss_coef": DEFAULTS["router_aux_loss_coef"] if c.moe_aux_loss_coeff is None
        else c.moe_aux_loss_coeff,
        "swiglu_alpha": ALPHA,
        "swiglu_limit": c.activation_clamp,
    }


def _dequantized(source: dict[str, LazyTensor], notes: list[str]) -> dict[str, LazyTensor]:
    """MXFP4 experts (OpenAI's release) become lazy tensors of the embedding's dtype (bfloat16 there), dequantized
    when read (exactly: every MXFP4 value is a small integer times a power of two)."""
    if not any(k.endswith((mxfp4.BLOCKS_SUFFIX, mxfp4.SCALES_SUFFIX)) for k in source):
        return source
    embed = source.get(EMBED_KEY)
    dtype = embed.dtype_name if embed is not None else "bfloat16"
    source, count = mxfp4.dequantized(source, dtype)
    notes.append(f"{count} MXFP4 expert weights dequantized to {dtype} as they are read")
    return source


def load(path: Path, options: Options) -> ModelIR:
    """Hugging Face GPT-OSS (GptOssForCausalLM): safetensors, bfloat16 or MXFP4 experts, sharded or not."""
    notes: list[str] = []
    ir = load_hf(path, options, name="gpt_oss_hf", config_from_hf=config_from_hf, table=TABLE,
                 embed_key=EMBED_KEY, drop=DROP, fix_source=lambda s: _dequantized(s, notes),
                 layout=lambda s: {"experts": "MXFP4 (dequantized)" if notes else "unquantized"})
    ir.source.notes.extend(notes)
    return ir


def save(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    """Hugging Face GPT-OSS: sharded safetensors + index (unquantized experts), config, tokenizer."""
    save_hf(ir, out, options, progress, table=TABLE, config_to_hf=config_to_hf, where="saver gpt_oss_hf")


FAMILY = register_family(HFFamily("gpt_oss_hf", {MODEL_TYPE: ARCHITECTURE}, load, save, SUPPORTS, aliases=("gpt_oss",)))
