"""Megatron-core GPT checkpoints (`torch` format): key table, directory layout, and the args <-> config mapping.

Keys are flat and local to each file: `decoder.layers.{l}` counts from 0 in every pipeline chunk. The local
spec names norms as modules (`input_layernorm.weight`); the Transformer Engine spec fuses them into the next
linear (`self_attention.linear_qkv.layer_norm_weight`, `mlp.linear_fc1.layer_norm_weight`). Linears carry an
`_extra_state` entry (None for the local spec). MoE layers (router and experts) are in `core_moe`.

    latest_checkpointed_iteration.txt      the iteration number, or "release"
    iter_0000001/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt
        {"args", "checkpoint_version": 3.0, "iteration", "model" (or "model0".."model{V-1}"), ...}

`mp_rank_00_001` is PP stage 1 when PP>1 and EP=1, but EP rank 1 when PP=1 and EP>1: only the stored args
(pipeline/expert_model_parallel_size) tell them apart. Every EP rank's file repeats the dense weights.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from mconvert.errors import ConvertError
from mconvert.ir.blocks import ByteBlocks
from mconvert.ir.config import ModelConfig
from mconvert.lazy import np
from mconvert.megatron import mla as mla_keys
from mconvert.megatron import moe as core_moe
from mconvert.options import ExpertLayout, Options
from mconvert.rules.layout import Chunk, ParallelLayout
from mconvert.rules.table import (
    COLUMN,
    GATE_UP,
    GATED_COLUMN,
    QKV,
    REPLICATE,
    ROW,
    VOCAB,
    Rule,
    Table,
    linear,
    moved,
    norm,
)

Impl = Literal["local", "te"]
TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_FILE = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0
RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")


def iteration_dir(iteration: int | Literal["release"]) -> str:
    return "release" if iteration == "release" else f"iter_{iteration:07d}"


def rank_dir(tp: int, pp: int, ep: int, layout: ParallelLayout) -> str:
    """`mp_rank_{tp:02d}`, plus `_{pp:03d}` when pipelined, plus `_{ep:03d}` with expert parallelism."""
    name = f"mp_rank_{tp:02d}"
    if layout.pp > 1:
        name += f"_{pp:03d}"
    if layout.ep > 1:
        name += f"_{ep:03d}"
    return name


EMBEDDING = (
    Rule("embedding.word_embeddings.weight", ("embed.weight",), VOCAB, COLUMN),
    Rule("embedding.position_embeddings.weight", ("pos_embed.weight",)),
)
ATTENTION = (
    *linear("decoder.layers.{l}.self_attention.linear_proj", "layers.{L}.attn.o", shard=ROW, bias_shard=REPLICATE),
    *linear("decoder.layers.{l}.self_attention.linear_qkv", "layers.{L}.attn.q", "layers.{L}.attn.k",
            "layers.{L}.attn.v", join=QKV, shard=COLUMN),
    # qk_layernorm: one norm over head_dim, the same name under both specs (a TENorm under TE)
    *norm("decoder.layers.{l}.self_attention.q_layernorm", "layers.{L}.attn.q_norm"),
    *norm("decoder.layers.{l}.self_attention.k_layernorm", "layers.{L}.attn.k_norm"),
    # sandwich norms (Gemma 3): megatron-core's TransformerLayer has no norm after a sublayer; these are the names
    # of Megatron-Bridge's Gemma layers, whose linear_proj / linear_fc2 normalize their own output
    *norm("decoder.layers.{l}.self_attention.linear_proj.post_layernorm", "layers.{L}.post_attn_norm"),
    # softmax_type="learnable": one offset (the attention sink) per head, split over TP with the heads
    Rule("decoder.layers.{l}.self_attention.core_attention.softmax_offset", ("layers.{L}.attn.sinks",), shard=COLUMN),
)
MLP = (  # gated fc1 first: it wins when the model has a gate (see rules.active)
    *linear("decoder.layers.{l}.mlp.linear_fc1", "layers.{L}.mlp.gate", "layers.{L}.mlp.up", join=GATE_UP,
            shard=GATED_COLUMN),
    *linear("decoder.layers.{l}.mlp.linear_fc1", "layers.{L}.mlp.up", shard=COLUMN),
    *linear("decoder.layers.{l}.mlp.linear_fc2", "layers.{L}.mlp.down", shard=ROW, bias_shard=REPLICATE),
    *norm("decoder.layers.{l}.mlp.linear_fc2.post_layernorm", "layers.{L}.post_mlp_norm"),
    core_moe.ROUTER,
    core_moe.ROUTER_LINEAR_BIAS,
    core_moe.ROUTER_BIAS,
    *core_moe.SHARED_EXPERTS,
)
_PRE_MLP = {
    "local": norm("decoder.layers.{l}.pre_mlp_layernorm", "layers.{L}.mlp_norm"),
    # Transformer Engine fuses it into fc1, except in MoE layers (no fc1 there).
    "te": (*norm("decoder.layers.{l}.mlp.linear_fc1", "layers.{L}.mlp_norm", fused=True, only="dense"),
           *norm("decoder.layers.{l}.pre_mlp_layernorm", "layers.{L}.mlp_norm", only="moe")),
}
_LAYERS = {
    # Local spec: each norm is a module of its own.
    "local": (*norm("decoder.layers.{l}.input_layernorm", "layers.{L}.attn_norm"), *ATTENTION, *_PRE_MLP["local"],
              *MLP),
    # Transformer Engine: norms fused into the next linear.
    "te": (*norm("decoder.layers.{l}.self_attention.linear_qkv", "layers.{L}.attn_norm", fused=True), *ATTENTION,
           *_PRE_MLP["te"], *MLP),
}
# Multi-latent attention (DeepSeek, see core_deepseek): its input norm is a module of its own under both specs.
_MLA_LAYERS = {impl: (*mla_keys.ATTENTION[impl], *_PRE_MLP[impl], *MLP) for impl in _PRE_MLP}
HEAD = (
    *norm("decoder.final_layernorm", "final_norm"),
    Rule("output_layer.weight", ("lm_head.weight",), VOCAB, COLUMN),
)


def _table(layer: tuple[Rule, ...], experts: ExpertLayout) -> Table:
    """The table of one layer kind and expert layout; an MTP module's transformer layer is the same layer stored
    under `mtp.layers.{m}.transformer_layer.`."""
    expert, stack = core_moe.EXPERTS[experts]
    prefixes = mla_keys.LAYER_PREFIX, mla_keys.MTP_LAYER_PREFIX
    return Table(embedding=EMBEDDING, layer=layer, expert=expert, expert_stack=stack, head=HEAD, mtp=mla_keys.MTP,
                 mtp_layer=moved(layer, *prefixes), mtp_expert=moved(expert, *prefixes),
                 mtp_expert_stack=moved(stack, *prefixes))


# One table per (transformer implementation, expert layout, multi-latent attention); dense models use the
# sequential one (no experts).
TABLES: dict[tuple[str, str, bool], Table] = {
    (impl, experts, mla): _table((_MLA_LAYERS if mla else _LAYERS)[impl], experts)
    for impl in _LAYERS for experts in core_moe.EXPERTS for mla in (False, True)
}


# megatron-core's BertModel: GPT's layers under `encoder.` (its TransformerBlock), token types beside the
# embeddings; after the final norm the MLM head's transform (`lm_head`, plain Linear and LayerNorm modules under both
# specs), the output layer with its bias (split over TP like the vocabulary), the pooler and the binary head
# (plain Linears, replicated).
BERT_PREFIX = "encoder."
BERT_EMBEDDING = (*EMBEDDING, Rule("embedding.tokentype_embeddings.weight", ("token_type_embed.weight",)))
BERT_HEAD = (
    *norm("encoder.final_layernorm", "final_norm"),
    *linear("lm_head.dense", "mlm_head.dense"),
    *norm("lm_head.layer_norm", "mlm_head.norm"),
    Rule("output_layer.weight", ("lm_head.weight",), VOCAB, COLUMN),
    Rule("output_layer.bias", ("lm_head.bias",), VOCAB, COLUMN),
    *linear("binary_head", "nsp_head"),
    *linear("pooler.dense", "pooler"),
)
BERT_TABLES = {impl: Table(embedding=BERT_EMBEDDING, layer=moved(layers, "decoder.", BERT_PREFIX), head=BERT_HEAD)
               for impl, layers in _LAYERS.items()}


def table(impl: Impl, expert_layout: ExpertLayout = "sequential", mla: bool = False, bert: bool = False) -> Table:
    """The core key table for one transformer implementation (`local` or `te`), expert layout (see
    mconvert.megatron.moe; the layout's shards read the local expert count and expert TP from the Ctx) and
    attention (multi-latent or not); `bert`: megatron-core's BertModel (dense, standard attention)."""
    return BERT_TABLES[impl] if bert else TABLES[(impl, expert_layout, mla)]


def is_bert_model(keys) -> bool:
    """Are these the keys of a megatron-core BertModel (its layers under `encoder.`, an MLM head) rather than of a
    GPTModel (`decoder.`)?"""
    return any(k.startswith((BERT_PREFIX, "lm_head.", "embedding.tokentype_embeddings.")) for k in keys)


# With tied embeddings and several pipeline stages the last stage keeps its own copy of the (padded) word
# embeddings as output_layer.weight, kept in sync by Megatron during training.
TIED_OUTPUT = Rule("output_layer.weight", ("embed.weight",), VOCAB, COLUMN)
# With multi-token prediction the last stage keeps the embedding too (the MTP modules embed the next tokens).
MTP_EMBEDDING = Rule("embedding.word_embeddings.weight", ("embed.weight",), VOCAB, COLUMN)


def extra_state_modules(impl: Impl, *, expert_layout: ExpertLayout | None = None, local_experts: int = 0,
                        config: ModelConfig | None = None) -> tuple[str, ...]:
    """Modules (templates) that store an `_extra_state` entry in every layer (MoE layers: give the layout; MLA,
    q/k norms and shared experts: give the config)."""
    if config is not None and config.is_mla:
        modules = mla_keys.attention_extra_states(impl, config)
    else:
        modules = ("self_attention.linear_proj", "self_attention.linear_qkv")
        if impl == "te":
            modules = ("self_attention.core_attention", *modules)
            if config is not None and config.qk_norm:  # TENorm modules, like MoE layers' pre_mlp_layernorm
                modules += ("self_attention.q_layernorm", "self_attention.k_layernorm")
            if config is not None and config.sandwich_norms:  # TENorms inside Megatron-Bridge's Gemma linears
                modules += ("self_attention.linear_proj.post_layernorm", "mlp.linear_fc2.post_layernorm")
    if expert_layout is None:
        modules += ("mlp.linear_fc1", "mlp.linear_fc2")
    shared = config is not None and bool(config.moe_shared_expert_ffn_hidden_size)
    moe = core_moe.extra_state_modules(expert_layout, impl, local_experts, shared) if expert_layout else ()
    prefix = BERT_PREFIX if config is not None and config.is_bert else "decoder."
    return tuple(f"{prefix}layers.{{l}}.{m}" for m in modules) + moe


METADATA_JSON = "metadata.json"


def is_dist_checkpoint(it_dir: Path) -> bool:
    return (it_dir / METADATA_JSON).is_file()


def check_model(c: ModelConfig, options: Options) -> None:
    """Refuse, before writing, a model this layout or implementation cannot hold."""
    problems = mla_keys.saver_problems(c, options.layout.tp, options.transformer_impl)
    if c.mtp_layers and c.tie_embeddings and options.layout.pp > 1 and options.ckpt_format == "torch":
        problems.append("multi-token prediction with tied embeddings over pipeline stages (which copy Megatron keeps "
                        "on the last stage is not settled here): use --pp 1 or --ckpt-format torch_dist")
    if c.is_moe and c.mlp_bias and options.expert_layout in ("legacy_grouped", "single_grouped"):
        problems.append(f"expert biases in the {options.expert_layout} expert layout, which has no place for them "
                        "(use --expert-layout sequential or grouped)")
    if c.is_bert:
        problems += bert_problems(c)
    if problems:
        raise ConvertError("saver core: " + "; ".join(problems))
    options.layout.check_model(c)


def bert_problems(c: ModelConfig) -> list[str]:
    """What megatron-core's BertModel cannot hold of a BERT model."""
    return [what for what, bad in (
        ("post-LN layers (HF 'bert'): megatron-core's BertModel normalizes before each sublayer (pre-LN)",
         c.post_norm),
        (f"an MLM head computing {c.mlm_head_activation}: megatron-core's BertLMHead computes exact gelu",
         c.mlm_head_activation != "gelu"),
        ("a pooler without the binary head: megatron-core's BertModel builds both or neither",
         c.pooler != c.binary_head),
    ) if bad]


def is_dcp_checkpoint(it_dir: Path) -> bool:
    """A torch.distributed.checkpoint directory that is neither torch_dist (metadata.json) nor mtrain's."""
    return (it_dir / ".metadata").is_file() and not (it_dir / "metadata.json").is_file() \
        and not (it_dir / "mtrain.json").is_file()


def te_empty_state() -> ByteBlocks:
    """Transformer Engine's `_extra_state` without FP8, an empty uint8 tensor, as bytes: no torch needed
    (`mconvert.io.torch_zip` stores it as torch's own empty uint8 tensor)."""
    return ByteBlocks((0,), "uint8", (np.empty(0, dtype=np.uint8),))


def extra_states(chunk: Chunk, options: Options, config: ModelConfig | None = None) -> dict[str, object]:
    """The `_extra_state` entries of one chunk: None for Megatron's own modules, TE's empty byte tensor
    (`te_empty_state`)."""
    te = options.transformer_impl == "te"
    value = te_empty_state() if te else None
    out = {}
    for l, L in enumerate(chunk.layers):
        for module in _layer_extra_states(L, options, config):
            out[f"{module.format(l=l)}._extra_state"] = value
    if chunk.has_head:
        if te:  # a TENorm (BertModel's block takes TE's norm whenever TE is installed)
            prefix = BERT_PREFIX if config is not None and config.is_bert else "decoder."
            out[f"{prefix}final_layernorm._extra_state"] = value
        out["output_layer._extra_state"] = None  # Megatron's ColumnParallelLinear, under either spec
        for m in range(config.mtp_layers if config is not None else 0):  # the MTP modules go with the head
            prefix = f"mtp.layers.{m}."
            out |= {f"{prefix}{module}._extra_state": value for module in
                    mla_keys.mtp_extra_states(options.transformer_impl)}
            out |= {f"{module.replace(mla_keys.LAYER_PREFIX, mla_keys.MTP_LAYER_PREFIX).format(m=m)}"
                    "._extra_state": value for module in _layer_extra_states(config.num_layers + m, options, config)}
    return out


def _layer_extra_states(layer: int, options: Options, config: ModelConfig | None) -> tuple[str, ...]:
    moe = config is not None and config.is_moe_layer(layer)
    return extra_state_modules(options.transformer_impl, expert_layout=options.expert_layout if moe else None,
                                    local_experts=config.num_experts // options.layout.ep if moe else 0, config=config)
