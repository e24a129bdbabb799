"""Hugging Face Qwen2 / Qwen2.5, Qwen3 and Qwen3-MoE: the key tables and the config.json mapping (both ways).

One table serves the three model types (a rule applies when the model has its IR tensors), per layer i, expert e:

    model.layers.{i}.self_attn.{q,k,v}_proj.{weight,bias}   bias: Qwen2 always (q/k/v only), Qwen3 attention_bias
    model.layers.{i}.self_attn.o_proj.{weight,bias}
    model.layers.{i}.self_attn.{q,k}_norm.weight [hd]       Qwen3, Qwen3-MoE: RMSNorm of each head
    model.layers.{i}.mlp.{gate,up,down}_proj.weight         dense layers (Qwen3-MoE: mlp_only_layers and the layers
                                                            decoder_sparse_step skips)
    model.layers.{i}.mlp.gate.weight [E, h]                 Qwen3-MoE router (no bias)
    model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight    hub layout (what save_pretrained writes)

transformers 5 fuses the experts in memory (`mlp.experts.gate_up_proj` [E, 2f, h], per expert [gate; up], and
`mlp.experts.down_proj` [E, h, f]); a raw `state_dict()` saved with those names is read too (`FUSED`).

Reading (plugin `qwen_hf`): Hugging Face Qwen2 / Qwen2.5, Qwen3 and Qwen3-MoE directories (or hub ids); experts in
the hub layout or transformers 5's fused one.

Writing (plugin `qwen_hf`): a Hugging Face Qwen2, Qwen3 or Qwen3-MoE directory (by the model's family), hub layout.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from mconvert.errors import ConvertError
from mconvert.hf.config import parse, rope_decoder_config, rope_decoder_fields
from mconvert.hf.family import HFFamily, load_hf, not_my_family, register_family, save_hf
from mconvert.ir.config import ModelConfig
from mconvert.ir.tensors import ModelIR
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.registry import missing_features
from mconvert.rules.experts import STACK, STACK_GATE_UP
from mconvert.rules.table import Rule, Table, linear

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# The IR features (mconvert.ir.features.FEATURES) this family holds: Qwen3's per-head q/k norms (which model type
# holds what is config_to_hf's to say)
SUPPORTS = frozenset({"qk_norm"})

TABLE = Table(
    embedding=(Rule("model.embed_tokens.weight", ("embed.weight",)),),
    layer=(
        Rule("model.layers.{L}.input_layernorm.weight", ("layers.{L}.attn_norm.weight",)),
        *linear("model.layers.{L}.self_attn.q_proj", "layers.{L}.attn.q"),
        *linear("model.layers.{L}.self_attn.k_proj", "layers.{L}.attn.k"),
        *linear("model.layers.{L}.self_attn.v_proj", "layers.{L}.attn.v"),
        *linear("model.layers.{L}.self_attn.o_proj", "layers.{L}.attn.o"),
        Rule("model.layers.{L}.self_attn.q_norm.weight", ("layers.{L}.attn.q_norm.weight",)),
        Rule("model.layers.{L}.self_attn.k_norm.weight", ("layers.{L}.attn.k_norm.weight",)),
        Rule("model.layers.{L}.post_attention_layernorm.weight", ("layers.{L}.mlp_norm.weight",)),
        Rule("model.layers.{L}.mlp.gate_proj.weight", ("layers.{L}.mlp.gate.weight",)),
        Rule("model.layers.{L}.mlp.up_proj.weight", ("layers.{L}.mlp.up.weight",)),
        Rule("model.layers.{L}.mlp.down_proj.weight", ("layers.{L}.mlp.down.weight",)),
        Rule("model.layers.{L}.mlp.gate.weight", ("layers.{L}.moe.router.weight",)),
    ),
    expert=(
        Rule("model.layers.{L}.mlp.experts.{E}.gate_proj.weight", ("layers.{L}.moe.experts.{E}.gate.weight",)),
        Rule("model.layers.{L}.mlp.experts.{E}.up_proj.weight", ("layers.{L}.moe.experts.{E}.up.weight",)),
        Rule("model.layers.{L}.mlp.experts.{E}.down_proj.weight", ("layers.{L}.moe.experts.{E}.down.weight",)),
    ),
    head=(
        Rule("model.norm.weight", ("final_norm.weight",)),
        Rule("lm_head.weight", ("lm_head.weight",)),
    ),
)
FUSED = dataclasses.replace(TABLE, expert=(), expert_stack=(
    Rule("model.layers.{L}.mlp.experts.gate_up_proj",
         ("layers.{L}.moe.experts.{E}.gate.weight", "layers.{L}.moe.experts.{E}.up.weight"), STACK_GATE_UP),
    Rule("model.layers.{L}.mlp.experts.down_proj", ("layers.{L}.moe.experts.{E}.down.weight",), STACK),
))
FUSED_SUFFIX = ".mlp.experts.gate_up_proj"  # any layer's: the first layers may be dense

# Present in some checkpoints, never model weights: rotary frequencies (recomputed from rope_theta).
DROP = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)

# transformers' config class defaults, for fields config.json leaves out
_COMMON = {"vocab_size": 151936, "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
           "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 4096}
DEFAULTS = {
    "qwen2": _COMMON | {"hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
                        "num_attention_heads": 32, "max_window_layers": 28},
    "qwen3": _COMMON | {"hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
                        "num_attention_heads": 32, "head_dim": 128, "max_window_layers": 28, "attention_bias": False},
    "qwen3_moe": _COMMON | {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
                            "num_attention_heads": 32, "num_key_value_heads": 4, "attention_bias": False,
                            "decoder_sparse_step": 1, "moe_intermediate_size": 768, "num_experts_per_tok": 8,
                            "num_experts": 128, "norm_topk_prob": False, "router_aux_loss_coef": 0.001,
                            "mlp_only_layers": []},
}


def config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    """The IR config of a Qwen2, Qwen3 or Qwen3-MoE config.json."""
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ConvertError(f"{where}: model_type {model_type!r} is not a Qwen model (expected one of "
                           f"{', '.join(ARCHITECTURES)})")
    counts = {k: hf[k] for k in ("num_experts", "num_local_experts") if hf.get(k) is not None}
    if len(set(map(repr, counts.values()))) > 1:  # which one transformers takes depends on its version
        raise ConvertError(f"{where}: {' and '.join(f'{k}={v!r}' for k, v in counts.items())} disagree: the two "
                           "spellings of the expert count must give one number")
    hf = DEFAULTS[model_type] | {k: v for k, v in hf.items() if v is not None or k == "sliding_window"}
    if hf["hidden_act"] != "silu":
        raise ConvertError(f"{where}: hidden_act {hf['hidden_act']!r} is not supported for {model_type} "
                           "(expected 'silu')")

    def build() -> ModelConfig:
        fields = rope_decoder_fields(hf)
        window, full = _window_from_hf(hf, model_type, fields["num_layers"], where)
        bias = model_type == "qwen2" or bool(hf["attention_bias"])  # Qwen2: q/k/v biases, always
        return ModelConfig(family=model_type, **fields, qkv_bias=bias, proj_bias=bias and model_type != "qwen2",
                           qk_norm=model_type != "qwen2", sliding_window=window, full_attention_layers=full,
                           **(_moe_from_hf(hf, fields["num_layers"], where) if model_type == "qwen3_moe" else {}))

    return parse(where, build)


def _window_from_hf(hf: dict[str, Any], model_type: str, num_layers: int, where: str
                    ) -> tuple[int | None, tuple[int, ...]]:
    """(sliding_window, full_attention_layers). transformers applies the window only with use_sliding_window,
    in Qwen2/Qwen3 to the layers `layer_types` calls sliding (by default those from max_window_layers on), in
    Qwen3-MoE to every layer. Without a window, layer_types says "full_attention" everywhere and the exempt layers
    are max_window_layers' (kept, though they change nothing; Qwen3-MoE hub configs have it too)."""
    window = int(hf["sliding_window"]) if hf["use_sliding_window"] and hf["sliding_window"] is not None else None
    prefix = tuple(range(min(int(hf.get("max_window_layers") or 0), num_layers)))
    if model_type == "qwen3_moe":
        return window, prefix if window is None else ()
    types = hf.get("layer_types")
    if types is None or window is None:
        return window, prefix
    if not isinstance(types, list) or len(types) != num_layers or \
            not set(types) <= {"full_attention", "sliding_attention"}:
        raise ConvertError(f"{where}: layer_types must list 'full_attention' or 'sliding_attention' for each of the "
                           f"{num_layers} layers, got {types!r}")
    return window, tuple(i for i, kind in enumerate(types) if kind == "full_attention")


def _moe_from_hf(hf: dict[str, Any], num_layers: int, where: str) -> dict[str, Any]:
    """A layer has experts unless mlp_only_layers names it or (i + 1) is not a multiple of decoder_sparse_step."""
    # the hub's configs say num_experts; transformers 5 saves it under its attribute map's num_local_experts
    experts, step = int(hf.get("num_local_experts", hf["num_experts"])), int(hf["decoder_sparse_step"])
    if experts <= 0 or step <= 0:
        raise ConvertError(f"{where}: num_experts={experts} and decoder_sparse_step={step} must be positive for a "
                           "Qwen3-MoE model")
    only = hf["mlp_only_layers"]
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ConvertError(f"{where}: mlp_only_layers must be a list of layer numbers, got {only!r}")
    only = set(only)
    dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
    return dict(num_experts=experts, moe_top_k=int(hf["num_experts_per_tok"]),
                moe_ffn_hidden_size=int(hf["moe_intermediate_size"]), dense_layers=dense,
                moe_norm_topk=bool(hf["norm_topk_prob"]), moe_aux_loss_coeff=float(hf["router_aux_loss_coef"]))


def config_to_hf(c: ModelConfig) -> dict[str, Any]:
    """A Qwen config.json for the IR config (its family picks Qwen2, Qwen3 or Qwen3-MoE); refuses what that
    model class cannot compute."""
    if c.family not in ARCHITECTURES:
        raise not_my_family("qwen_hf", c.family)
    name = ARCHITECTURES[c.family].removesuffix("ForCausalLM")
    qwen2, moe = c.family == "qwen2", c.family == "qwen3_moe"
    unsupported = [what for what, bad in (
        (f"activation {c.activation} ({name} uses SwiGLU)", c.activation != "swiglu"),
        (f"{c.norm} ({name} uses RMSNorm)", c.norm != "rmsnorm"),
        ("learned position embeddings (it uses rotary)", c.position_embedding != "rope"),
        ("MLP biases", c.mlp_bias),
        ("biases other than on q/k/v (Qwen2 has them on q, k and v only)", qwen2 and not (c.qkv_bias and
                                                                                         not c.proj_bias)),
        ("biases on q/k/v without o (Qwen3's attention_bias covers all four)", not qwen2 and c.qkv_bias != c.proj_bias),
        ("per-head q/k norms (save it as qwen3)" if qwen2 else "no per-head q/k norms (save it as qwen2 or llama)",
         c.qk_norm == qwen2),
        ("experts (save it as qwen3_moe or mixtral)" if not moe else "no experts (save it as qwen3)", c.is_moe != moe),
    ) if bad] + missing_features(c, SUPPORTS)
    if unsupported:
        raise ConvertError(f"HF {name} cannot hold this model: {', '.join(unsupported)}")
    hf = rope_decoder_config(c, ARCHITECTURES[c.family], c.family) | _window_to_hf(c, name)
    if not qwen2:
        hf["attention_bias"] = c.qkv_bias
    elif c.head_dim == c.hidden_size // c.num_attention_heads:
        del hf["head_dim"]  # not a Qwen2Config field; transformers reads it when present
    if moe:
        hf |= _moe_to_hf(c)
    return hf


def _window_to_hf(c: ModelConfig, name: str) -> dict[str, Any]:
    """use_sliding_window, sliding_window, max_window_layers and (Qwen2, Qwen3) layer_types, as transformers
    writes them (sliding_window null when unused)."""
    out: dict[str, Any] = {"use_sliding_window": c.sliding_window is not None, "sliding_window": c.sliding_window}
    full = c.full_attention_layers
    prefix = full == tuple(range(len(full)))
    if c.sliding_window is not None and full and c.family == "qwen3_moe":
        raise ConvertError(f"HF {name} applies sliding_window to every layer; this model attends fully in layers "
                           f"{list(full)} (Megatron window_attn_skip_freq)")
    if c.sliding_window is not None and not prefix:
        raise ConvertError(f"HF {name} exempts the first max_window_layers layers from the sliding window; this "
                           f"model's full-attention layers {list(full)} are not the first ones")
    if c.family == "qwen3_moe":  # not a Qwen3MoeConfig field in transformers 5, but the hub's configs have it
        return out | ({"max_window_layers": len(full)} if full and prefix else {})
    windowless = len(full) if full and prefix else c.num_layers  # changes nothing without a window
    kinds = ["full_attention" if c.layer_window(i) is None else "sliding_attention" for i in range(c.num_layers)]
    return out | {"max_window_layers": len(full) if c.sliding_window is not None else windowless,
                  "layer_types": kinds}


def _moe_to_hf(c: ModelConfig) -> dict[str, Any]:
    """decoder_sparse_step: the largest step whose skipped layers are all dense; mlp_only_layers: the rest."""
    dense = set(c.dense_layers)
    layers = range(c.num_layers)
    step = max(s for s in range(1, c.num_layers + 1) if all((i + 1) % s == 0 or i in dense for i in layers))
    return {
        "num_experts": c.num_experts,  # the hub's spelling, which transformers 4 and 5 both read
        "num_experts_per_tok": c.moe_top_k,
        "moe_intermediate_size": c.expert_ffn_hidden_size,
        "decoder_sparse_step": step,
        "mlp_only_layers": sorted(i for i in dense if (i + 1) % step == 0),
        "norm_topk_prob": c.moe_norm_topk,
        "output_router_logits": False,
        "router_aux_loss_coef": DEFAULTS["qwen3_moe"]["router_aux_loss_coef"] if c.moe_aux_loss_coeff is None
        else c.moe_aux_loss_coeff,
    }


def load(path: Path, options: Options) -> ModelIR:
    """Hugging Face Qwen2/2.5, Qwen3, Qwen3-MoE: safetensors or .bin, sharded or not."""
    def fused(source) -> bool:
        return any(k.endswith(FUSED_SUFFIX) for k in source)

    return load_hf(path, options, name="qwen_hf", config_from_hf=config_from_hf,
                   table=lambda source: FUSED if fused(source) else TABLE,
                   embed_key="model.embed_tokens.weight", drop=DROP,
                   layout=lambda source: {"experts": "fused (transformers 5 in-memory names)"} if fused(source) else {})


def save(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    """Hugging Face Qwen2 / Qwen3 / Qwen3-MoE: sharded safetensors + index, config, generation config, tokenizer."""
    save_hf(ir, out, options, progress, table=TABLE, config_to_hf=config_to_hf,
            where="saver qwen_hf")


FAMILY = register_family(HFFamily("qwen_hf", ARCHITECTURES, load, save, SUPPORTS, aliases=("qwen",)))
