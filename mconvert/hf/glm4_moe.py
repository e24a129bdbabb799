"""Hugging Face GLM-4.5 / GLM-4.6 (`glm4_moe`): the key table and the config.json mapping.

On disk, what `save_pretrained` writes and Z.ai ships (layer i, routed expert e, MTP module m at layer N + m,
N = num_hidden_layers):

    model.layers.{i}.self_attn.{q,k,v}_proj.{weight,bias}    biases with attention_bias; o_proj.weight (no bias)
    model.layers.{i}.self_attn.{q,k}_norm.weight [hd]        with use_qk_norm: RMSNorm of each head
    model.layers.{i}.mlp.{gate,up,down}_proj                 the first `first_k_dense_replace` layers
    model.layers.{i}.mlp.gate.weight, mlp.gate.e_score_correction_bias    the sigmoid router and its choice bias
    model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj, mlp.shared_experts.{gate,up,down}_proj
    model.layers.{N+m}.{enorm,hnorm,eh_proj,shared_head.norm}    MTP module m (+ its decoder layer), and copies of
    model.layers.{N+m}.embed_tokens, shared_head.head            the embedding and head (GLM-4.5 has them, 4.6 not)

Rotary positions turn the first `partial_rotary_factor` of each query/key head (half-split; the IR's
`rotary_percent`). Routing is DeepSeek-V3's (mconvert/ir/features.py), with one group meaning no groups. The MTP
modules are as DeepSeek's (mconvert/hf/deepseek.py): their number is what the tensors hold.

Reading (plugin `glm4_moe_hf`): Hugging Face GLM-4.5 / 4.6 directories (hub layout or transformers 5's fused
experts, with or without MTP layers and their copies of the embedding and head).

Writing (plugin `glm4_moe_hf`): a Hugging Face GLM-4.5 directory, one tensor per expert, MTP layers after the last
layer with their copies of the embedding and head.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from mconvert.errors import ConvertError
from mconvert.hf.config import parse, rope_decoder_config, rope_decoder_fields
from mconvert.hf.deepseek import MTP, MTP_COPIES, mtp_layers, with_mtp_copies
from mconvert.hf.family import HFFamily, read_config, register_family, save_hf
from mconvert.io import hf_dir
from mconvert.ir.config import ModelConfig
from mconvert.ir.dtypes import dtype_name
from mconvert.ir.tensors import ModelIR, SourceInfo
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.registry import missing_features
from mconvert.rules.experts import STACK, STACK_GATE_UP
from mconvert.rules.table import Rule, Table, linear

MODEL_TYPE = "glm4_moe"
ARCHITECTURE = "Glm4MoeForCausalLM"
# The IR features (mconvert.ir.features.FEATURES) this family holds
SUPPORTS = frozenset({"qk_norm", "shared_experts", "router_score", "router_expert_bias", "group_routing",
                      "router_scaling", "mtp", "partial_rotary"})

TABLE = Table(
    embedding=(Rule("model.embed_tokens.weight", ("embed.weight",)),),
    layer=(
        Rule("model.layers.{L}.input_layernorm.weight", ("layers.{L}.attn_norm.weight",)),
        *linear("model.layers.{L}.self_attn.q_proj", "layers.{L}.attn.q"),
        *linear("model.layers.{L}.self_attn.k_proj", "layers.{L}.attn.k"),
        *linear("model.layers.{L}.self_attn.v_proj", "layers.{L}.attn.v"),
        Rule("model.layers.{L}.self_attn.o_proj.weight", ("layers.{L}.attn.o.weight",)),
        Rule("model.layers.{L}.self_attn.q_norm.weight", ("layers.{L}.attn.q_norm.weight",)),
        Rule("model.layers.{L}.self_attn.k_norm.weight", ("layers.{L}.attn.k_norm.weight",)),
        Rule("model.layers.{L}.post_attention_layernorm.weight", ("layers.{L}.mlp_norm.weight",)),
        Rule("model.layers.{L}.mlp.gate_proj.weight", ("layers.{L}.mlp.gate.weight",)),
        Rule("model.layers.{L}.mlp.up_proj.weight", ("layers.{L}.mlp.up.weight",)),
        Rule("model.layers.{L}.mlp.down_proj.weight", ("layers.{L}.mlp.down.weight",)),
        Rule("model.layers.{L}.mlp.gate.weight", ("layers.{L}.moe.router.weight",)),
        Rule("model.layers.{L}.mlp.gate.e_score_correction_bias", ("layers.{L}.moe.router.expert_bias",)),
        Rule("model.layers.{L}.mlp.shared_experts.gate_proj.weight", ("layers.{L}.moe.shared.gate.weight",)),
        Rule("model.layers.{L}.mlp.shared_experts.up_proj.weight", ("layers.{L}.moe.shared.up.weight",)),
        Rule("model.layers.{L}.mlp.shared_experts.down_proj.weight", ("layers.{L}.moe.shared.down.weight",)),
    ),
    expert=(
        Rule("model.layers.{L}.mlp.experts.{E}.gate_proj.weight", ("layers.{L}.moe.experts.{E}.gate.weight",)),
        Rule("model.layers.{L}.mlp.experts.{E}.up_proj.weight", ("layers.{L}.moe.experts.{E}.up.weight",)),
        Rule("model.layers.{L}.mlp.experts.{E}.down_proj.weight", ("layers.{L}.moe.experts.{E}.down.weight",)),
    ),
    head=(Rule("model.norm.weight", ("final_norm.weight",)), Rule("lm_head.weight", ("lm_head.weight",))),
    mtp=MTP,
)
# transformers 5's in-memory names (a raw state_dict() saved as it is)
FUSED = dataclasses.replace(TABLE, expert=(), expert_stack=(
    Rule("model.layers.{L}.mlp.experts.gate_up_proj",
         ("layers.{L}.moe.experts.{E}.gate.weight", "layers.{L}.moe.experts.{E}.up.weight"), STACK_GATE_UP),
    Rule("model.layers.{L}.mlp.experts.down_proj", ("layers.{L}.moe.experts.{E}.down.weight",), STACK),
))
FUSED_MARKER = ".mlp.experts.gate_up_proj"
# What the saver writes: the hub layout, with the MTP layers' copies of the embedding and head (as GLM-4.5 ships)
SAVE_TABLE = dataclasses.replace(TABLE, mtp=MTP + MTP_COPIES)
# Present in some checkpoints, never model weights: rotary frequencies (recomputed from the config).
DROP = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)
EMBED_KEY = "model.embed_tokens.weight"

# transformers' Glm4MoeConfig defaults, for fields config.json leaves out
DEFAULTS = {"vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944, "num_hidden_layers": 46,
            "num_attention_heads": 96, "num_key_value_heads": 8, "hidden_act": "silu",
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "attention_bias": False, "moe_intermediate_size": 1408, "num_experts_per_tok": 8, "n_shared_experts": 1,
            "n_routed_experts": 128, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
            "first_k_dense_replace": 1, "norm_topk_prob": True, "use_qk_norm": False, "num_nextn_predict_layers": 1,
            "partial_rotary_factor": 0.5}


def _partial_rotary(hf: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """(config.json without it, partial_rotary_factor): transformers 5 keeps it in rope_parameters, older configs
    (and the hub's) at the top level; Glm4MoeConfig's default is 0.5."""
    params = hf.get("rope_parameters")
    inner = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    factor = inner if inner is not None else hf.get("partial_rotary_factor", DEFAULTS["partial_rotary_factor"])
    if isinstance(params, dict):
        hf = hf | {"rope_parameters": {k: v for k, v in params.items() if k != "partial_rotary_factor"}}
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        raise ConvertError(f"partial_rotary_factor {factor!r}: expected a number in (0, 1]")
    return hf, float(factor)


def config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    """The IR config of a GLM-4.5 config.json (MTP modules as announced; the loader counts the tensors)."""
    if hf.get("model_type") != MODEL_TYPE:
        raise ConvertError(f"{where}: model_type {hf.get('model_type')!r} is not a GLM-4.5 model (expected "
                           f"{MODEL_TYPE!r})")
    hf = DEFAULTS | {k: v for k, v in hf.items() if v is not None}
    hf, factor = _partial_rotary(hf)
    experts, groups = int(hf["n_routed_experts"]), int(hf["n_group"])
    unsupported = [what for what, bad in (
        (f"hidden_act {hf['hidden_act']!r} (expected 'silu')", hf["hidden_act"] != "silu"),
        ("no routed experts (n_routed_experts)", experts <= 0),
        ("no shared experts (n_shared_experts)", int(hf["n_shared_experts"]) <= 0),
        (f"topk_group={hf['topk_group']} with n_group=1 (transformers keeps topk_group of n_group groups)",
         groups == 1 and int(hf["topk_group"]) != 1),
    ) if bad]
    if unsupported:
        raise ConvertError(f"{where}: a GLM-4.5 model mconvert cannot carry: {', '.join(unsupported)}")

    def build() -> ModelConfig:
        fields = rope_decoder_fields(hf)
        layers = fields["num_layers"]
        return ModelConfig(
            family=MODEL_TYPE, **fields, qkv_bias=bool(hf["attention_bias"]), qk_norm=bool(hf["use_qk_norm"]),
            rotary_percent=factor, num_experts=experts, moe_top_k=int(hf["num_experts_per_tok"]),
            moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
            dense_layers=tuple(range(min(int(hf["first_k_dense_replace"]), layers))),
            moe_norm_topk=bool(hf["norm_topk_prob"]),
            moe_shared_expert_ffn_hidden_size=int(hf["n_shared_experts"]) * int(hf["moe_intermediate_size"]),
            moe_router_score="sigmoid", moe_router_expert_bias=True,
            # one group is no grouping: every token keeps the only group
            moe_router_groups=groups if groups > 1 else None,
            moe_router_group_topk=int(hf["topk_group"]) if groups > 1 else None,
            moe_router_scaling_factor=float(hf["routed_scaling_factor"]),
            mtp_layers=int(hf["num_nextn_predict_layers"] or 0))

    return parse(where, build)


def config_to_hf(c: ModelConfig) -> dict[str, Any]:
    """A GLM-4.5 config.json for the IR config; refuses what Glm4MoeForCausalLM cannot compute."""
    first_dense = len(c.dense_layers)
    shared = c.moe_shared_expert_ffn_hidden_size
    unsupported = [what for what, bad in (
        ("no experts", not c.is_moe),
        (f"dense layers {list(c.dense_layers)} (GLM-4.5's dense layers are the first ones)",
         c.is_moe and c.dense_layers != tuple(range(first_dense))),
        ("softmax router scores (GLM-4.5's are sigmoid)", c.is_moe and c.moe_router_score != "sigmoid"),
        ("no router expert bias (e_score_correction_bias)", c.is_moe and not c.moe_router_expert_bias),
        ("no shared experts", c.is_moe and not shared),
        (f"a shared-expert FFN of {shared}, not a multiple of the expert FFN {c.expert_ffn_hidden_size}",
         c.is_moe and bool(shared) and shared % c.expert_ffn_hidden_size != 0),
        ("multi-latent attention (save it as deepseek_v3)", c.is_mla),
        (f"{c.norm} (GLM-4.5 uses RMSNorm)", c.norm != "rmsnorm"),
        (f"activation {c.activation} (GLM-4.5 uses SwiGLU)", c.activation != "swiglu"),
        ("learned position embeddings (it uses rotary)", c.position_embedding != "rope"),
        ("MLP biases", c.mlp_bias),
        ("an output projection bias (o_proj has none)", c.proj_bias),
        (f"a sliding window of {c.sliding_window}", c.sliding_window is not None),
    ) if bad] + missing_features(c, SUPPORTS)
    if unsupported:
        raise ConvertError(f"HF GLM-4.5 cannot hold this model: {', '.join(unsupported)}")
    hf = rope_decoder_config(c, ARCHITECTURE, MODEL_TYPE)
    hf["rope_parameters"] = hf["rope_parameters"] | {"partial_rotary_factor": c.rotary_percent}
    return hf | {
        "partial_rotary_factor": c.rotary_percent, "attention_bias": c.qkv_bias, "use_qk_norm": c.qk_norm,
        "first_k_dense_replace": first_dense, "moe_intermediate_size": c.expert_ffn_hidden_size,
        "n_routed_experts": c.num_experts, "n_shared_experts": shared // c.expert_ffn_hidden_size,
        "num_experts_per_tok": c.moe_top_k, "norm_topk_prob": c.moe_norm_topk,
        "n_group": c.moe_router_groups or 1, "topk_group": c.moe_router_group_topk or 1,
        "routed_scaling_factor": c.moe_router_scaling_factor, "num_nextn_predict_layers": c.mtp_layers,
        "output_router_logits": False,
    }


def load(path: Path, options: Options) -> ModelIR:
    """Hugging Face GLM-4.5 / 4.6 (Glm4MoeForCausalLM), with its MTP layers: safetensors or .bin, sharded or not."""
    root = hf_dir.resolve(path)
    where = str(root / "config.json")
    source = hf_dir.open_weights(root)
    _, config = read_config(root, config_from_hf, source)
    if EMBED_KEY in source:
        config = config.replace(dtype=dtype_name(source[EMBED_KEY].dtype_name))
    config, notes = mtp_layers(config, source, where)
    fused = any(k.endswith(FUSED_MARKER) for k in source)
    tensors = with_mtp_copies(source, FUSED if fused else TABLE, config, root, DROP)
    layout = {"experts": "fused (transformers 5 in-memory names)" if fused else "one tensor per expert"}
    assets = hf_dir.tokenizer_files(options.tokenizer or root)
    return ModelIR(config, tensors, SourceInfo("glm4_moe_hf (Hugging Face)", root, layout, notes=notes), assets)


def save(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    """Hugging Face GLM-4.5: sharded safetensors + index (one tensor per expert), MTP layers, config, tokenizer."""
    save_hf(ir, out, options, progress, table=SAVE_TABLE, config_to_hf=config_to_hf, where="saver glm4_moe_hf")


FAMILY = register_family(HFFamily("glm4_moe_hf", {MODEL_TYPE: ARCHITECTURE}, load, save, SUPPORTS,
                                  aliases=("glm4_moe",)))
