"""Hugging Face Mixtral: the key tables (hub layout and transformers 5's fused layout) and the config.json mapping.

On disk (what `save_pretrained` writes in transformers 5, the module names of transformers 4), per layer i and expert e:

    model.layers.{i}.block_sparse_moe.gate.weight          [E, h]   the router
    model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight [f, h]   gate
    model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight [f, h]   up
    model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight [h, f]   down

In memory transformers 5 renames `block_sparse_moe` to `mlp` and fuses the experts into
`mlp.experts.gate_up_proj` [E, 2f, h] (per expert [w1; w3]) and `mlp.experts.down_proj` [E, h, f]; a file
saved from a raw `state_dict()` has those names, which the loader reads too (`FUSED`).

Reading (plugin `mixtral_hf`): Hugging Face Mixtral directories (or hub ids), hub layout or transformers 5's fused one.

Writing (plugin `mixtral_hf`): a Hugging Face Mixtral directory in the hub layout (what `save_pretrained` writes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mconvert.errors import ConvertError
from mconvert.hf.config import parse, rope_decoder_config, rope_decoder_fields
from mconvert.hf.family import HFFamily, load_hf, register_family, save_hf
from mconvert.ir.config import ModelConfig
from mconvert.ir.tensors import ModelIR
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.registry import missing_features
from mconvert.rules.experts import STACK, STACK_GATE_UP
from mconvert.rules.table import Rule, Table

MODEL_TYPE = "mixtral"
ARCHITECTURE = "MixtralForCausalLM"
# The IR features (mconvert.ir.features.FEATURES) this family holds: none
SUPPORTS: frozenset[str] = frozenset()


_DENSE = (
    Rule("model.layers.{L}.input_layernorm.weight", ("layers.{L}.attn_norm.weight",)),
    Rule("model.layers.{L}.self_attn.q_proj.weight", ("layers.{L}.attn.q.weight",)),
    Rule("model.layers.{L}.self_attn.k_proj.weight", ("layers.{L}.attn.k.weight",)),
    Rule("model.layers.{L}.self_attn.v_proj.weight", ("layers.{L}.attn.v.weight",)),
    Rule("model.layers.{L}.self_attn.o_proj.weight", ("layers.{L}.attn.o.weight",)),
    Rule("model.layers.{L}.post_attention_layernorm.weight", ("layers.{L}.mlp_norm.weight",)),
)
_EMBEDDING = (Rule("model.embed_tokens.weight", ("embed.weight",)),)
_HEAD = (
    Rule("model.norm.weight", ("final_norm.weight",)),
    Rule("lm_head.weight", ("lm_head.weight",)),
)
TABLE = Table(
    embedding=_EMBEDDING,
    layer=(*_DENSE, Rule("model.layers.{L}.block_sparse_moe.gate.weight", ("layers.{L}.moe.router.weight",))),
    expert=(
        Rule("model.layers.{L}.block_sparse_moe.experts.{E}.w1.weight", ("layers.{L}.moe.experts.{E}.gate.weight",)),
        Rule("model.layers.{L}.block_sparse_moe.experts.{E}.w3.weight", ("layers.{L}.moe.experts.{E}.up.weight",)),
        Rule("model.layers.{L}.block_sparse_moe.experts.{E}.w2.weight", ("layers.{L}.moe.experts.{E}.down.weight",)),
    ),
    head=_HEAD,
)
FUSED = Table(
    embedding=_EMBEDDING,
    layer=(*_DENSE, Rule("model.layers.{L}.mlp.gate.weight", ("layers.{L}.moe.router.weight",))),
    expert_stack=(
        Rule("model.layers.{L}.mlp.experts.gate_up_proj",
             ("layers.{L}.moe.experts.{E}.gate.weight", "layers.{L}.moe.experts.{E}.up.weight"), STACK_GATE_UP),
        Rule("model.layers.{L}.mlp.experts.down_proj", ("layers.{L}.moe.experts.{E}.down.weight",), STACK),
    ),
    head=_HEAD,
)
FUSED_MARKER = "model.layers.0.mlp.experts.gate_up_proj"

# Present in some checkpoints, never model weights: rotary frequencies (recomputed from rope_theta).
DROP = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)

# transformers' MixtralConfig defaults, for fields config.json leaves out
DEFAULTS = {"rope_theta": 1e6, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5,
            "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001,
            "router_jitter_noise": 0.0, "sliding_window": None, "tie_word_embeddings": False}


def config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    """The IR config of a Mixtral config.json."""
    if hf.get("model_type") != MODEL_TYPE:
        raise ConvertError(f"{where}: model_type {hf.get('model_type')!r} is not a Mixtral model (expected "
                           f"{MODEL_TYPE!r})")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConvertError(f"{where}: hidden_act {hf['hidden_act']!r} is not supported for mixtral (expected 'silu')")
    hf = DEFAULTS | hf
    return parse(where, lambda: ModelConfig(
        family="mixtral", **rope_decoder_fields(hf), sliding_window=hf["sliding_window"],
        num_experts=int(hf["num_local_experts"]), moe_top_k=int(hf["num_experts_per_tok"]),
        moe_aux_loss_coeff=float(hf["router_aux_loss_coef"]),
        moe_jitter_eps=float(hf["router_jitter_noise"]) or None))  # None is "no jitter" (Megatron's); HF says 0.0


def config_to_hf(c: ModelConfig) -> dict[str, Any]:
    """A Mixtral config.json for the IR config; refuses what MixtralForCausalLM cannot express."""
    if not c.is_moe:
        raise ConvertError(f"the Mixtral saver needs a mixture-of-experts model; this {c.family} model is dense "
                           "(use the llama_mistral saver)")
    unsupported = [what for what, bad in (
        ("attention or MLP biases", c.qkv_bias or c.proj_bias or c.mlp_bias),
        (f"dense MLP layers {list(c.dense_layers)} (Mixtral has experts in every layer)", bool(c.dense_layers)),
        ("top-k routing weights left unnormalized (Mixtral renormalizes them)", not c.moe_norm_topk),
        (f"{c.norm} (Mixtral uses RMSNorm)", c.norm != "rmsnorm"),
        (f"activation {c.activation} (Mixtral uses SwiGLU)", c.activation != "swiglu"),
        ("learned position embeddings (Mixtral uses rotary)", c.position_embedding != "rope"),
        (f"no sliding window in layers {list(c.full_attention_layers)} (Mixtral's applies to every layer)",
         c.sliding_window is not None and bool(c.full_attention_layers)),
    ) if bad] + missing_features(c, SUPPORTS)
    if unsupported:
        raise ConvertError(f"HF Mixtral cannot hold this model: {', '.join(unsupported)}")
    return rope_decoder_config(c, ARCHITECTURE, MODEL_TYPE) | {
        "intermediate_size": c.expert_ffn_hidden_size,  # Mixtral's only FFN is the experts
        "num_local_experts": c.num_experts,
        "num_experts_per_tok": c.moe_top_k,
        "output_router_logits": False,
        "router_aux_loss_coef": DEFAULTS["router_aux_loss_coef"] if c.moe_aux_loss_coeff is None
        else c.moe_aux_loss_coeff,
        "router_jitter_noise": c.moe_jitter_eps or 0.0,
        "sliding_window": c.sliding_window,
    }


def load(path: Path, options: Options) -> ModelIR:
    """Hugging Face Mixtral (MixtralForCausalLM): safetensors or .bin, sharded or not."""
    def fused(source) -> bool:
        return FUSED_MARKER in source

    return load_hf(path, options, name="mixtral_hf", config_from_hf=config_from_hf,
                   table=lambda source: FUSED if fused(source) else TABLE,
                   embed_key="model.embed_tokens.weight", drop=DROP,
                   layout=lambda source: {"experts": "fused (transformers 5 in-memory names)" if fused(source)
                                          else "one tensor per expert"})


def save(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    """Hugging Face Mixtral: sharded safetensors + index (one tensor per expert), config, tokenizer."""
    save_hf(ir, out, options, progress, table=TABLE, config_to_hf=config_to_hf,
            where="saver mixtral_hf")


FAMILY = register_family(HFFamily("mixtral_hf", {MODEL_TYPE: ARCHITECTURE}, load, save, SUPPORTS, aliases=("mixtral",)))
