"""Hugging Face DeepSeek-V3 (and DeepSeek-V2 with greedy routing): the key tables and the config.json mapping.

On disk, what `save_pretrained` writes and DeepSeek ships (layer i, routed expert e, MTP module m at layer
N + m, N = num_hidden_layers):

    model.layers.{i}.self_attn.q_a_proj / q_a_layernorm / q_b_proj   (q_proj without a query LoRA)
    model.layers.{i}.self_attn.kv_a_proj_with_mqa / kv_a_layernorm / kv_b_proj / o_proj
    model.layers.{i}.mlp.{gate,up,down}_proj                         the first `first_k_dense_replace` layers
    model.layers.{i}.mlp.gate.weight, mlp.gate.e_score_correction_bias    the router (bias kept in float32)
    model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj, mlp.shared_experts.{gate,up,down}_proj
    model.layers.{N+m}.{enorm,hnorm,eh_proj,shared_head.norm}        MTP module m (+ its decoder layer), and
    model.layers.{N+m}.embed_tokens, shared_head.head                copies of the embedding and the head

Rotary rows are interleaved when config.json says `rope_interleave` (DeepSeek's own layout, transformers'
default), half-split otherwise (see mconvert/rules/mla.py). transformers 5 fuses the experts in memory
(`mlp.experts.gate_up_proj` [E, 2f, h], `mlp.experts.down_proj` [E, h, f]); a file saved from a raw
`state_dict()` has those names, which the loader reads too.

Reading (plugin `deepseek_hf`): Hugging Face DeepSeek-V3 directories (hub layout or transformers 5's fused experts).

The multi-token-prediction (MTP) modules are the layers after `num_hidden_layers`: their number is what the
tensors hold (config.json's `num_nextn_predict_layers` is often 1 for a model saved without them; the
difference is noted). Their copies of the embedding and head are checked against the model's own.

Writing (plugin `deepseek_hf`): a Hugging Face DeepSeek-V3 directory in DeepSeek's own layout (interleaved rotary rows,
one tensor per expert, MTP layers after the last layer with their copies of the embedding and head).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from mconvert.errors import ConvertError
from mconvert.hf.config import config_dtype, parse, rope_from_hf, rope_to_hf
from mconvert.hf.family import HFFamily, read_config, register_family, save_hf
from mconvert.io import hf_dir
from mconvert.ir.config import ModelConfig
from mconvert.ir.dtypes import dtype_name
from mconvert.ir.tensors import LazyTensor, ModelIR, SourceInfo
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.rules import fp8
from mconvert.rules.experts import STACK, STACK_GATE_UP
from mconvert.rules.mapping import expand, take_copies, to_ir, verify_copies
from mconvert.rules.mla import KV_ROPE, Q_ROPE
from mconvert.rules.table import IDENTITY, Ctx, Join, Rule, Table

MODEL_TYPE = "deepseek_v3"
ARCHITECTURE = "DeepseekV3ForCausalLM"
# DeepSeek-V2 has the same weights (no score bias, no MTP) and softmax routing; transformers' V2 router never
# renormalizes the top-k weights and scores a group by its best expert (group_limited_greedy, which the IR's
# top-2 group scores cannot express: refused).
V2 = "deepseek_v2"
ARCHITECTURES = {MODEL_TYPE: ARCHITECTURE, V2: "DeepseekV2ForCausalLM"}
# The IR features (mconvert.ir.features.FEATURES) this family holds: DeepSeek's (per-head q/k norms it has not)
SUPPORTS = frozenset({"mla", "shared_experts", "router_score", "router_expert_bias", "group_routing",
                      "router_scaling", "mtp"})


def _layer(q: Join, kv: Join) -> tuple[Rule, ...]:
    """A decoder layer's rules; `q` and `kv` join the rotary rows (interleaved or not on disk)."""
    return (
        Rule("model.layers.{L}.input_layernorm.weight", ("layers.{L}.attn_norm.weight",)),
        Rule("model.layers.{L}.self_attn.q_proj.weight", ("layers.{L}.attn.q.weight",), q),
        Rule("model.layers.{L}.self_attn.q_a_proj.weight", ("layers.{L}.attn.q_down.weight",)),
        Rule("model.layers.{L}.self_attn.q_a_layernorm.weight", ("layers.{L}.attn.q_norm.weight",)),
        Rule("model.layers.{L}.self_attn.q_b_proj.weight", ("layers.{L}.attn.q_up.weight",), q),
        Rule("model.layers.{L}.self_attn.kv_a_proj_with_mqa.weight", ("layers.{L}.attn.kv_down.weight",), kv),
        Rule("model.layers.{L}.self_attn.kv_a_layernorm.weight", ("layers.{L}.attn.kv_norm.weight",)),
        Rule("model.layers.{L}.self_attn.kv_b_proj.weight", ("layers.{L}.attn.kv_up.weight",)),
        Rule("model.layers.{L}.self_attn.o_proj.weight", ("layers.{L}.attn.o.weight",)),
        Rule("model.layers.{L}.post_attention_layernorm.weight", ("layers.{L}.mlp_norm.weight",)),
        Rule("model.layers.{L}.mlp.gate_proj.weight", ("layers.{L}.mlp.gate.weight",)),
        Rule("model.layers.{L}.mlp.up_proj.weight", ("layers.{L}.mlp.up.weight",)),
        Rule("model.layers.{L}.mlp.down_proj.weight", ("layers.{L}.mlp.down.weight",)),
        Rule("model.layers.{L}.mlp.gate.weight", ("layers.{L}.moe.router.weight",)),
        Rule("model.layers.{L}.mlp.gate.e_score_correction_bias", ("layers.{L}.moe.router.expert_bias",)),
        Rule("model.layers.{L}.mlp.shared_experts.gate_proj.weight", ("layers.{L}.moe.shared.gate.weight",)),
        Rule("model.layers.{L}.mlp.shared_experts.up_proj.weight", ("layers.{L}.moe.shared.up.weight",)),
        Rule("model.layers.{L}.mlp.shared_experts.down_proj.weight", ("layers.{L}.moe.shared.down.weight",)),
    )


EXPERTS = (
    Rule("model.layers.{L}.mlp.experts.{E}.gate_proj.weight", ("layers.{L}.moe.experts.{E}.gate.weight",)),
    Rule("model.layers.{L}.mlp.experts.{E}.up_proj.weight", ("layers.{L}.moe.experts.{E}.up.weight",)),
    Rule("model.layers.{L}.mlp.experts.{E}.down_proj.weight", ("layers.{L}.moe.experts.{E}.down.weight",)),
)
FUSED_EXPERTS = (
    Rule("model.layers.{L}.mlp.experts.gate_up_proj",
         ("layers.{L}.moe.experts.{E}.gate.weight", "layers.{L}.moe.experts.{E}.up.weight"), STACK_GATE_UP),
    Rule("model.layers.{L}.mlp.experts.down_proj", ("layers.{L}.moe.experts.{E}.down.weight",), STACK),
)
FUSED_MARKER = ".mlp.experts.gate_up_proj"
MTP = (
    Rule("model.layers.{L}.enorm.weight", ("mtp.{M}.enorm.weight",)),
    Rule("model.layers.{L}.hnorm.weight", ("mtp.{M}.hnorm.weight",)),
    Rule("model.layers.{L}.eh_proj.weight", ("mtp.{M}.eh_proj.weight",)),
    Rule("model.layers.{L}.shared_head.norm.weight", ("mtp.{M}.final_norm.weight",)),
)
# DeepSeek's checkpoints repeat the shared embedding and head in every MTP layer; the saver writes them too and
# the loader checks that they are copies.
MTP_COPIES = (
    Rule("model.layers.{L}.embed_tokens.weight", ("embed.weight",)),
    Rule("model.layers.{L}.shared_head.head.weight", ("lm_head.weight",)),
)


def _table(q: Join, kv: Join, fused: bool) -> Table:
    return Table(
        embedding=(Rule("model.embed_tokens.weight", ("embed.weight",)),),
        layer=_layer(q, kv),
        expert=() if fused else EXPERTS,
        expert_stack=FUSED_EXPERTS if fused else (),
        head=(Rule("model.norm.weight", ("final_norm.weight",)), Rule("lm_head.weight", ("lm_head.weight",))),
        mtp=MTP,
    )


# (rope_interleave, fused experts) -> table
TABLES = {(interleaved, fused): _table(Q_ROPE if interleaved else IDENTITY, KV_ROPE if interleaved else IDENTITY,
                                       fused)
          for interleaved in (True, False) for fused in (False, True)}
# Present in some checkpoints, never model weights: rotary frequencies (recomputed from the config).
DROP = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)

# transformers' DeepseekV3Config defaults, for fields config.json leaves out
DEFAULTS = {"vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
            "num_hidden_layers": 61, "num_attention_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
            "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
            "first_k_dense_replace": 3, "norm_topk_prob": True, "hidden_act": "silu",
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 1,
            "tie_word_embeddings": False, "rope_interleave": True, "attention_bias": False,
            "num_nextn_predict_layers": 1}


# transformers' DeepseekV2Config defaults where they differ
V2_DEFAULTS = DEFAULTS | {"vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 11008,
                          "moe_intermediate_size": 1407, "num_hidden_layers": 32, "num_attention_heads": 32,
                          "n_shared_experts": 2, "n_routed_experts": 64, "routed_scaling_factor": 1.0,
                          "first_k_dense_replace": 0, "norm_topk_prob": False, "max_position_embeddings": 2048,
                          "bos_token_id": 1, "eos_token_id": 2, "topk_method": "greedy", "n_group": None,
                          "topk_group": None, "num_nextn_predict_layers": 0}


def _latent_eps(hf: dict[str, Any]) -> tuple[tuple[str, bool], ...]:
    """transformers normalizes the query and key/value latents with epsilon 1e-6 whatever rms_norm_eps says; the IR
    (as Megatron) has one epsilon for every norm, so they must agree."""
    eps = float(hf["rms_norm_eps"])
    return ((f"rms_norm_eps {eps} (transformers' latent norms use 1e-6: one epsilon for all norms is carried)",
             eps != 1e-6),)


def rope_interleaved(hf: dict[str, Any]) -> bool:
    """DeepSeek-V2's rotary rows are always interleaved (transformers rotates them as complex pairs)."""
    return hf.get("model_type") == V2 or bool((DEFAULTS | hf)["rope_interleave"])


def config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    """The IR config of a DeepSeek-V3 or V2 config.json (MTP modules as announced; the loader checks the tensors)."""
    if hf.get("model_type") not in ARCHITECTURES:
        raise ConvertError(f"{where}: model_type {hf.get('model_type')!r} is not a DeepSeek-V3 or V2 model (expected "
                           f"{' or '.join(map(repr, ARCHITECTURES))})")
    v2 = hf["model_type"] == V2
    # an explicit null means none (no query LoRA, no groups, no such token), not transformers' default
    kept = ("q_lora_rank", "n_group", "bos_token_id", "eos_token_id", "pad_token_id")
    hf = (V2_DEFAULTS if v2 else DEFAULTS) | {k: v for k, v in hf.items() if v is not None or k in kept}
    if v2:
        return _v2_config(hf, where)
    unsupported = [what for what, bad in (
        (f"hidden_act {hf['hidden_act']!r} (expected 'silu')", hf["hidden_act"] != "silu"),
        ("attention_bias", bool(hf["attention_bias"])),
        (f"scoring_func {hf.get('scoring_func')!r} (transformers computes 'sigmoid')",
         hf.get("scoring_func", "sigmoid") != "sigmoid"),
        (f"topk_method {hf.get('topk_method')!r} (transformers computes 'noaux_tc')",
         hf.get("topk_method", "noaux_tc") != "noaux_tc"),
        (f"moe_layer_freq {hf.get('moe_layer_freq')!r} (transformers puts experts in every layer after the first "
         "first_k_dense_replace)", hf.get("moe_layer_freq", 1) != 1),
        ("num_key_value_heads different from num_attention_heads (MLA has one key/value per head)",
         hf.get("num_key_value_heads") not in (None, hf["num_attention_heads"])),
        ("no routed experts (n_routed_experts)", not hf["n_routed_experts"]),
        *_latent_eps(hf),
    ) if bad]
    if unsupported:
        raise ConvertError(f"{where}: a DeepSeek-V3 model mconvert cannot carry: {', '.join(unsupported)}")
    return parse(where, lambda: _config(hf))


def _v2_config(hf: dict[str, Any], where: str) -> ModelConfig:
    unsupported = [what for what, bad in (
        (f"hidden_act {hf['hidden_act']!r} (expected 'silu')", hf["hidden_act"] != "silu"),
        ("attention_bias", bool(hf["attention_bias"])),
        (f"topk_method {hf['topk_method']!r} (transformers' group_limited_greedy scores a group by its best "
         "expert; only greedy can be carried)", hf["topk_method"] != "greedy"),
        ("norm_topk_prob true (transformers' V2 router never renormalizes)", bool(hf["norm_topk_prob"])),
        ("num_key_value_heads different from num_attention_heads", hf.get("num_key_value_heads") not in
         (None, hf["num_attention_heads"])),
        ("no routed experts (n_routed_experts)", not hf["n_routed_experts"]),
        *_latent_eps(hf),
    ) if bad]
    if unsupported:
        raise ConvertError(f"{where}: a DeepSeek-V2 model mconvert cannot carry: {', '.join(unsupported)}")
    fields = dict(family=V2, moe_router_score="softmax", moe_router_expert_bias=False, moe_router_groups=None,
                  moe_router_group_topk=None, moe_norm_topk=False, mtp_layers=0)
    return parse(where, lambda: _config(hf).replace(**fields))


def _config(hf: dict[str, Any]) -> ModelConfig:
    layers, experts = int(hf["num_hidden_layers"]), int(hf["n_routed_experts"])
    theta, scaling = rope_from_hf(hf)
    if hf["n_group"] is not None and int(hf["n_group"]) < 1:  # 0 was read as "no groups": say so, do not guess
        raise ConvertError(f"n_group={hf['n_group']}: expected a number of expert groups >= 1, or null for none")
    groups = int(hf["n_group"] or 1)
    shared = int(hf["n_shared_experts"] or 0) * int(hf["moe_intermediate_size"])
    return ModelConfig(
        family="deepseek_v3", num_layers=layers, hidden_size=int(hf["hidden_size"]),
        ffn_hidden_size=int(hf["intermediate_size"]), moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
        dense_layers=tuple(range(min(int(hf["first_k_dense_replace"]), layers))),
        num_attention_heads=int(hf["num_attention_heads"]), num_query_groups=int(hf["num_attention_heads"]),
        head_dim=int(hf["qk_nope_head_dim"]) + int(hf["qk_rope_head_dim"]), vocab_size=int(hf["vocab_size"]),
        max_position_embeddings=int(hf["max_position_embeddings"]), norm_eps=float(hf["rms_norm_eps"]),
        rope_theta=theta, rope_scaling=scaling, tie_embeddings=bool(hf["tie_word_embeddings"]),
        num_experts=experts, moe_top_k=int(hf["num_experts_per_tok"]), moe_norm_topk=bool(hf["norm_topk_prob"]),
        dtype=config_dtype(hf), bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"),
        pad_token_id=hf.get("pad_token_id"),
        q_lora_rank=int(hf["q_lora_rank"]) if hf["q_lora_rank"] else None, kv_lora_rank=int(hf["kv_lora_rank"]),
        qk_rope_head_dim=int(hf["qk_rope_head_dim"]), v_head_dim=int(hf["v_head_dim"]),
        moe_shared_expert_ffn_hidden_size=shared or None, moe_router_score="sigmoid", moe_router_expert_bias=True,
        # one group is no grouping: every token keeps the only group
        moe_router_groups=groups if groups > 1 else None,
        moe_router_group_topk=int(hf["topk_group"]) if groups > 1 else None,
        moe_router_scaling_factor=float(hf["routed_scaling_factor"]),
        mtp_layers=int(hf["num_nextn_predict_layers"] or 0),
    )


def config_to_hf(c: ModelConfig) -> dict[str, Any]:
    """A DeepSeek-V3 (or V2) config.json for the IR config; refuses what DeepseekV3ForCausalLM (or V2) cannot
    express."""
    first_dense = len(c.dense_layers)
    shared = c.moe_shared_expert_ffn_hidden_size
    v2 = c.family == V2
    routing = (
        ("sigmoid router scores (DeepSeek-V2's are softmax)", c.moe_router_score != "softmax"),
        ("a router expert bias", c.moe_router_expert_bias),
        ("group-limited routing", c.moe_router_groups is not None),
        ("top-k weights renormalized (transformers' V2 router never does)", c.moe_norm_topk),
        ("multi-token-prediction modules (--skip-mtp leaves them out)", bool(c.mtp_layers)),
    ) if v2 else (
        ("softmax router scores (DeepSeek-V3's are sigmoid)", c.moe_router_score != "sigmoid"),
        ("no router expert bias (e_score_correction_bias)", not c.moe_router_expert_bias),
    )
    unsupported = [what for what, bad in (
        ("standard attention (DeepSeek uses multi-latent attention)", not c.is_mla),
        ("no experts", not c.is_moe),
        (f"dense layers {list(c.dense_layers)} (DeepSeek's dense layers are the first ones)",
         c.is_moe and c.dense_layers != tuple(range(first_dense))),
        *routing,
        ("no shared experts", not shared),
        (f"a shared-expert FFN of {shared}, not a multiple of the expert FFN {c.expert_ffn_hidden_size}",
         bool(shared) and shared % c.expert_ffn_hidden_size != 0),
        (f"{c.norm} (DeepSeek-V3 uses RMSNorm)", c.norm != "rmsnorm"),
        (f"activation {c.activation} (DeepSeek-V3 uses SwiGLU)", c.activation != "swiglu"),
        ("MLP biases", c.mlp_bias),
        (f"a sliding window of {c.sliding_window}", c.sliding_window is not None),
    ) if bad]
    if unsupported:
        raise ConvertError(f"HF DeepSeek-{'V2' if v2 else 'V3'} cannot hold this model: {', '.join(unsupported)}")
    hf = {
        "architectures": [ARCHITECTURES[c.family if v2 else MODEL_TYPE]], "model_type": V2 if v2 else MODEL_TYPE,
        "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id, "pad_token_id": c.pad_token_id,
        "dtype": c.dtype, "torch_dtype": c.dtype, "first_k_dense_replace": first_dense,
        "head_dim": c.qk_rope_head_dim, "hidden_act": "silu", "hidden_size": c.hidden_size,
        "initializer_range": 0.02, "intermediate_size": c.ffn_hidden_size, "kv_lora_rank": c.kv_lora_rank,
        "max_position_embeddings": c.max_position_embeddings, "moe_intermediate_size": c.expert_ffn_hidden_size,
        "moe_layer_freq": 1, "n_group": c.moe_router_groups or 1, "n_routed_experts": c.num_experts,
        "n_shared_experts": shared // c.expert_ffn_hidden_size, "norm_topk_prob": c.moe_norm_topk,
        "num_attention_heads": c.num_attention_heads, "num_experts_per_tok": c.moe_top_k,
        "num_hidden_layers": c.num_layers, "num_key_value_heads": c.num_attention_heads,
        "num_nextn_predict_layers": c.mtp_layers, "q_lora_rank": c.q_lora_rank, "qk_head_dim": c.head_dim,
        "qk_nope_head_dim": c.qk_nope_head_dim, "qk_rope_head_dim": c.qk_rope_head_dim, "rms_norm_eps": c.norm_eps,
        "rope_interleave": True, "routed_scaling_factor": c.moe_router_scaling_factor, "scoring_func": "sigmoid",
        "tie_word_embeddings": c.tie_embeddings, "topk_group": c.moe_router_group_topk or 1, "topk_method": "noaux_tc",
        "use_cache": True, "v_head_dim": c.v_head_dim, "vocab_size": c.vocab_size, **rope_to_hf(c),
    }
    if v2:  # V2 names its routing differently and has no MTP, score bias or rope_interleave field
        for key in ("num_nextn_predict_layers", "scoring_func", "rope_interleave"):
            del hf[key]
        hf |= {"topk_method": "greedy", "n_group": None, "topk_group": None, "norm_topk_prob": False}
    return hf


# The weights DeepSeek-V3 ships FP8 (mconvert.rules.fp8): the linear layers of the decoder layers, MTP layers included;
# the router, norms, embeddings, head and MTP projection stay in bfloat16.
FP8_WEIGHT = re.compile(r"model\.layers\.\d+\.(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj"
                        r"|o_proj)|mlp\.((experts\.\d+\.|shared_experts\.)?(gate_proj|up_proj|down_proj)))\.weight")


def is_fp8_weight(key: str) -> bool:
    return FP8_WEIGHT.fullmatch(key) is not None


# What the saver writes: DeepSeek's own layout, rotary rows interleaved, the copies in every MTP layer.
SAVE_TABLE = dataclasses.replace(TABLES[(True, False)], mtp=MTP + MTP_COPIES)


EMBED_KEY = "model.embed_tokens.weight"


def load(path: Path, options: Options) -> ModelIR:
    """Hugging Face DeepSeek-V3 (with MTP layers, FP8 or not) and DeepSeek-V2 with greedy routing."""
    root = hf_dir.resolve(path)
    where = str(root / "config.json")
    stored = hf_dir.open_weights(root)
    hf, config = read_config(root, config_from_hf, stored)
    source, notes = _dequantized(hf, stored, where)
    if EMBED_KEY in source:
        config = config.replace(dtype=dtype_name(source[EMBED_KEY].dtype_name))
    config, mtp_notes = mtp_layers(config, source, where)
    notes += mtp_notes
    fused = any(k.endswith(FUSED_MARKER) for k in source)
    tensors = with_mtp_copies(source, TABLES[(rope_interleaved(hf), fused)], config, root, DROP)
    layout = {"experts": "fused (transformers 5 in-memory names)" if fused else "one tensor per expert",
              "rotary rows": "interleaved (rope_interleave)" if rope_interleaved(hf) else "half split"}
    assets = hf_dir.tokenizer_files(options.tokenizer or root)
    return ModelIR(config, tensors, SourceInfo("deepseek_hf (Hugging Face)", root, layout, notes=notes), assets)


def _dequantized(hf: dict, source: dict[str, LazyTensor], where: str) -> tuple[dict[str, LazyTensor], list[str]]:
    """FP8 block-quantized weights (DeepSeek's release) become lazy bfloat16 tensors, dequantized when read."""
    quant = hf.get("quantization_config") or {}
    if not isinstance(quant, dict):
        raise ConvertError(f"{where}: quantization_config {quant!r}: expected a mapping such as "
                           f"{fp8.QUANTIZATION_CONFIG}")
    if not quant and not any(k.endswith(".weight" + fp8.SCALE_SUFFIX) for k in source):
        return source, []
    if quant.get("quant_method", "fp8") != "fp8" or quant.get("fmt", "e4m3") != "e4m3":
        raise ConvertError(f"{where}: quantization_config {quant} is not FP8 e4m3 with block scales, the only "
                           "quantization mconvert reads")
    block = quant.get("weight_block_size", list(fp8.BLOCK))
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ConvertError(f"{where}: quantization_config.weight_block_size {block!r}: expected two positive "
                           f"integers, the rows and columns of a scaled block (DeepSeek-V3: {list(fp8.BLOCK)})")
    block = tuple(block)
    source, count = fp8.dequantized(source, block)
    return source, [f"{count} FP8 weights ({block[0]}x{block[1]} block scales) dequantized to bfloat16 as they are "
                    "read"]


def with_mtp_copies(source: dict[str, LazyTensor], table: Table, config: ModelConfig, root: Path,
                    drop: tuple[str, ...]) -> dict[str, LazyTensor]:
    """The IR tensors of `source` by `table`; the MTP layers' copies of the embedding and head (when stored) and a
    tied model's stored lm_head.weight are checked to be copies (when read), never silently dropped."""
    ctx = Ctx(config, config.vocab_size)
    pieces = {k: [v] for k, v in source.items()}
    copies = {name: take_copies(pieces, rf"model\.layers\.\d+\.{re.escape(suffix)}")
              for name, suffix in (("embed.weight", "embed_tokens.weight"),
                                   ("lm_head.weight", "shared_head.head.weight"))}
    # tied: a stored lm_head.weight must be the embedding again, never a distinct matrix silently dropped
    tied = take_copies(pieces, r"lm_head\.weight") if config.tie_embeddings else []
    tensors = to_ir(pieces, expand(table, config), ctx, where=str(root), drop=drop)
    for name, found in copies.items():
        verify_copies(tensors, name if name in tensors else "embed.weight", found, MTP_COPIES[0], ctx,
                      kept_for="the MTP layers")
    verify_copies(tensors, "embed.weight", tied, MTP_COPIES[0], ctx)
    return tensors


def mtp_layers(config: ModelConfig, source: dict[str, LazyTensor], where: str) -> tuple[ModelConfig, list[str]]:
    """The number of MTP modules the tensors hold (layers numbered from num_hidden_layers on, without gaps)."""
    found = sorted({int(m.group(1)) for k in source for m in [re.match(r"model\.layers\.(\d+)\.", k)]
                    if m and int(m.group(1)) >= config.num_layers})
    count = len(found)
    if found != list(range(config.num_layers, config.num_layers + count)):
        raise ConvertError(f"{where}: the checkpoint's layers after num_hidden_layers={config.num_layers} are "
                           f"{found}; MTP layers must follow the last layer without gaps")
    if 0 < count < config.mtp_layers:  # a model saved without its MTP layers holds none; part of them is damage
        raise ConvertError(f"{where}: num_nextn_predict_layers={config.mtp_layers}, but the weights hold {count} MTP "
                           f"layer(s) (model.layers.{config.num_layers} to model.layers.{found[-1]}): the config "
                           "contradicts the tensors")
    notes = []
    if count != config.mtp_layers:
        notes.append(f"config.json announces {config.mtp_layers} MTP layer(s) (num_nextn_predict_layers), the "
                     f"weights hold {count}: converting {count}")
    return config.replace(mtp_layers=count), notes


def save(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    """Hugging Face DeepSeek-V3: sharded safetensors + index, config, tokenizer; FP8 weights with --fp8-weights."""
    def with_quantization(c):
        return config_to_hf(c) | ({"quantization_config": fp8.QUANTIZATION_CONFIG} if options.fp8_weights else {})

    save_hf(ir, out, options, progress, table=SAVE_TABLE, config_to_hf=with_quantization,
            where="saver deepseek_hf", fp8=is_fp8_weight if options.fp8_weights else None)


FAMILY = register_family(HFFamily("deepseek_hf", ARCHITECTURES, load, save, SUPPORTS,
                                  aliases=("deepseek", "deepseek_v3"),
                                  save_options=("max_shard_size", "tokenizer", "fp8_weights")))
