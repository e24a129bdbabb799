"""Megatron-core distributed checkpoints (`torch_dist`, and the older `zarr`): keys, layout, common state.

The same tensors as the `torch` format, but stored once, unsharded, independent of the TP/PP layout:

    iter_0000001/metadata.json     {"sharded_backend": "torch_dist"|"zarr", "sharded_backend_version": 1, ...}
    iter_0000001/common.pt         args, checkpoint_version, iteration, ... (newer Megatron: a `common_state/
                                   shard_0_1` bytes entry inside the checkpoint instead)
    iter_0000001/.metadata, __R_I.distcp   (torch_dist)    or   one zarr array directory per key (zarr)

Layer tensors are stacked along a leading layer axis under a key without the layer number
(`decoder.layers.self_attention.linear_qkv.weight` is [L, rows, h]); expert tensors add an expert axis
(`decoder.layers.mlp.experts.experts.linear_fc1.weight` is [L, E, 2f, h], the same key for Megatron's sequential
and grouped experts). SwiGLU's fc1 is the whole-tensor [all gate ; all up] (per expert). Norms use the
Transformer-Engine names for both specs (multi-latent attention layers excepted: their local spec keeps its own
names). Each module's `_extra_state` is a pickled one-element list per layer (and expert) under
`<stacked module>._extra_state/shard_{offsets}_{shape}`, e.g. `shard_3_4` or `shard_3.1_4.8`.

When the layers differ (a `moe_layer_freq` pattern: dense layers among the expert layers, as in Qwen3-MoE with
`mlp_only_layers` or DeepSeek's first dense layers), megatron-core does not stack them: each layer keeps its global
number (`decoder.layers.3.self_attention.linear_qkv.weight` [rows, h], `decoder.layers.3.mlp.experts.experts.
linear_fc1.weight` [E, 2f, h]) and its extra states are `shard_0_1` (experts `shard_{e}_{E}`). The loader reads
either layout, whatever the args say. Multi-token-prediction modules are keyed one by one in every case,
`mtp.layers.{m}.` and `mtp.layers.{m}.transformer_layer.` (a layer's keys), and the embedding is stored once.

Checkpoints saved with megatron-core's `singleton_local_shards` metadata (Megatron-LM's default in Sept-Oct
2025, recorded in the common state's `content_metadata`) also keep every layer under its own number, and in
addition every expert under its own key and SwiGLU's fc1 as its two halves (mconvert.schemas.swiglu_halves):

    decoder.layers.3.mlp.linear_fc1.weight_w                   [f, h]     gate of layer 3
    decoder.layers.3.mlp.experts.experts.1.linear_fc1.weight_v [f, h]     up of layer 3's expert 1
    decoder.layers.3.mlp.experts.experts.1.linear_fc2.weight   [h, f]

(Multi-token-prediction modules saved that way are refused: none has been seen.)
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from mconvert.ir import ModelConfig
from mconvert.mapping import Row, expand
from mconvert.rules import GATE_UP, Rule, Table, norm
from mconvert.schemas import core, core_deepseek
from mconvert.schemas.swiglu_halves import HALF_KEY, halves

METADATA_JSON = "metadata.json"
COMMON_FILE = "common.pt"
COMMON_STATE = "common_state/shard_0_1"  # newer Megatron keeps the common dict inside the checkpoint
BACKENDS = ("torch_dist", "zarr")
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
LAYER_PREFIX = "decoder.layers.{l}."
STACKED_PREFIX = "decoder.layers."  # the keys of the layer stack: no layer number


EXPERTS = "decoder.layers.mlp.experts.experts"
EXPERT_RULES = (
    Rule(f"{EXPERTS}.linear_fc1.weight", ("layers.{L}.moe.experts.{E}.gate.weight",
                                          "layers.{L}.moe.experts.{E}.up.weight"), GATE_UP),
    Rule(f"{EXPERTS}.linear_fc2.weight", ("layers.{L}.moe.experts.{E}.down.weight",)),
)


SINGLETON_EXPERTS = "decoder.layers.{L}.mlp.experts.experts.{E}"
SINGLETON_EXPERT_RULES = (
    Rule(f"{SINGLETON_EXPERTS}.linear_fc1.weight", ("layers.{L}.moe.experts.{E}.gate.weight",
                                                    "layers.{L}.moe.experts.{E}.up.weight"), GATE_UP),
    Rule(f"{SINGLETON_EXPERTS}.linear_fc2.weight", ("layers.{L}.moe.experts.{E}.down.weight",)),
)


# Norms take Transformer Engine's names under both specs: Megatron's local spec maps `input_layernorm` and
# `pre_mlp_layernorm` onto them when it saves (in MoE layers too), while under TE the pre-MLP norm of MoE layers
# is a module of its own (`pre_mlp_layernorm.weight`). Megatron's MLA specs map nothing.
_LOCAL_LAYER = (
    *norm("decoder.layers.{l}.self_attention.linear_qkv", "layers.{L}.attn_norm", fused=True),
    *core.ATTENTION,
    *norm("decoder.layers.{l}.mlp.linear_fc1", "layers.{L}.mlp_norm", fused=True),
    *core.MLP,
)
TABLES = {("local", False): dataclasses.replace(core.table("local"), layer=_LOCAL_LAYER),
          ("te", False): core.table("te"), ("local", True): core.table("local", mla=True),
          ("te", True): core.table("te", mla=True)}


def table(impl: core.Impl = "local", mla: bool = False) -> Table:
    """Per-layer rules (keys still carry `{l}`; `stacked_key` removes it); experts are in EXPERT_RULES."""
    return TABLES[(impl, mla)]


def detect_impl(keys) -> core.Impl:
    """Only MoE or MLA checkpoints tell the specs apart: TE keeps `pre_mlp_layernorm` as its own module (local
    maps it onto fc1), and fuses MLA's latent norms into the up projections."""
    keys = list(keys)
    if any(k.endswith("self_attention.linear_kv_up_proj.layer_norm_weight") for k in keys):
        return "te"
    if any(k.endswith("self_attention.kv_layernorm.weight") for k in keys):
        return "local"
    return "te" if any(re.fullmatch(r"decoder\.layers\.(\d+\.)?pre_mlp_layernorm\.weight", k) for k in keys) \
        else "local"


def per_layer_keys(config: ModelConfig) -> bool:
    """Does megatron-core store this model's layers one by one rather than stacked? It does when the args carry a
    moe_layer_freq pattern, which ours do exactly when there are dense layers among the expert layers."""
    return bool(config.dense_layers)


def detect_per_layer(keys) -> bool:
    """Are the decoder layers of these stored keys one by one (`decoder.layers.3.`) rather than stacked?"""
    return any(re.match(r"decoder\.layers\.\d+\.", k) for k in keys)


def layer_prefix(config: ModelConfig, layer: int, per_layer: bool) -> str:
    """Where the keys of layer `layer` start: `decoder.layers.` in the stack, `decoder.layers.{layer}.` one by one,
    `mtp.layers.{m}.transformer_layer.` for the layer of MTP module m (IR layer num_layers + m, never stacked)."""
    n = config.num_layers
    if layer >= n:
        return core_deepseek.MTP_LAYER_PREFIX.format(m=layer - n)
    return LAYER_PREFIX.format(l=layer) if per_layer else STACKED_PREFIX


def layer_key(key: str, prefix: str) -> str:
    """A stacked key under a layer's own prefix: `decoder.layers.mlp.experts.experts.linear_fc1.weight` ->
    `decoder.layers.3.mlp.experts.experts.linear_fc1.weight` (prefix `decoder.layers.3.`)."""
    return prefix + key.removeprefix(STACKED_PREFIX)


def detect_singleton(keys) -> bool:
    """Saved with `singleton_local_shards`: experts under their own numbers, or SwiGLU halves (a dense model
    without SwiGLU stores the same keys either way)."""
    return any(re.match(r"decoder\.layers\.\d+\.mlp\.experts\.experts\.\d+\.", k) or HALF_KEY.fullmatch(k)
               for k in keys)


@dataclass(frozen=True)
class Placed:
    """One stored block: the row (IR names, rule; a unique key), the stored key, its leading indices in the stack
    and the stack's sizes: () a whole tensor, (L,) of [layers] or (L, E) of [layers, experts] when stacked, (E,)
    of [experts] for a layer of its own."""

    row: Row
    key: str
    index: tuple[int, ...] = ()
    stack: tuple[int, ...] = ()


def placements(config: ModelConfig, impl: core.Impl = "local", per_layer: bool | None = None, *,
               singleton: bool = False) -> list[Placed]:
    """Every block of the checkpoint in file order: embeddings, each layer (dense rules, then its experts), head,
    MTP modules (their own tensors, then their layer's). Layers are stacked unless `per_layer` (by default: as
    megatron-core stores this config); with `singleton` (read only; see the module docstring) every block is a
    whole tensor of its own. Loader and saver both walk this list, so the two directions cannot disagree."""
    t, n = table(impl, config.is_mla), config.num_layers
    per_layer = per_layer_keys(config) if per_layer is None else per_layer
    out = [Placed(r, r.key) for r in expand(t, config, layers=[], head=False)]
    for L in range(n):
        rows = expand(t, config, layers=[(L, L)], experts=[], embedding=False, head=False)
        out += _singleton_blocks(config, L, rows) if singleton else \
            _layer_blocks(config, L, rows, layer_prefix(config, L, per_layer))
    out += [Placed(r, r.key) for r in expand(t, config, layers=[], embedding=False, mtp=[])]
    for M in range(config.mtp_layers):
        rows = expand(t, config, layers=[], experts=[], embedding=False, head=False, mtp=[(M, M)])
        out += _layer_blocks(config, n + M, rows, layer_prefix(config, n + M, per_layer))
    return out


def _singleton_blocks(config: ModelConfig, L: int, rows: list[Row]) -> list[Placed]:
    """Layer L saved with `singleton_local_shards`: whole tensors, experts under their own numbers, SwiGLU halves."""
    experts = range(config.num_experts or 0) if config.is_moe_layer(L) else ()
    own = [Row(*rule.keys(L=L, E=E), rule) for E in experts for rule in SINGLETON_EXPERT_RULES]
    return [Placed(r, r.key) for r in halves(rows + own)]


def _layer_blocks(config: ModelConfig, L: int, rows: list[Row], prefix: str) -> list[Placed]:
    """Layer L's blocks: its rows (keys numbered by layer, or an MTP module's), then each expert's tensors."""
    n, experts, stacked = config.num_layers, config.num_experts or 0, prefix == STACKED_PREFIX
    out = [Placed(r, stacked_key(r.key, L), (L,), (n,)) if stacked else Placed(r, r.key) for r in rows]
    for E in range(experts) if config.is_moe_layer(L) else ():
        for rule in EXPERT_RULES:
            key, names = rule.keys(L=L, E=E)
            if stacked:
                out.append(Placed(Row(f"{key}[{L},{E}]", names, rule), key, (L, E), (n, experts)))
            else:
                key = layer_key(key, prefix)
                out.append(Placed(Row(f"{key}[{E}]", names, rule), key, (E,), (experts,)))
    return out


def stacked_key(key: str, layer: int) -> str:
    """`decoder.layers.3.mlp.linear_fc1.weight` -> `decoder.layers.mlp.linear_fc1.weight` (layer 3 of the stack)."""
    prefix = LAYER_PREFIX.format(l=layer)
    return STACKED_PREFIX + key[len(prefix):] if key.startswith(prefix) else key


def extra_states(config: ModelConfig, impl: core.Impl) -> list[str]:
    """The `_extra_state` keys of the checkpoint, as Megatron's local or Transformer-Engine specs store them."""
    n, experts, per_layer = config.num_layers, config.num_experts or 0, per_layer_keys(config)
    keys = []
    for L in range(n + config.mtp_layers):
        prefix = layer_prefix(config, L, per_layer)
        # a layer of the stack is entry L of n; a layer keyed on its own (MTP modules too) entry 0 of 1
        at, of = ((L,), (n,)) if prefix == STACKED_PREFIX else ((), ())
        layer, expert = _layer_extra_states(config, impl, L)
        keys += [_extra_state(prefix + m, at or (0,), of or (1,)) for m in layer]
        keys += [_extra_state(prefix + m, (*at, E), (*of, experts)) for E in range(experts) for m in expert]
    if impl == "te":
        keys.append(_extra_state("decoder.final_layernorm", (0,), (1,)))
    for M in range(config.mtp_layers):
        keys += [_extra_state(f"mtp.layers.{M}.{m}", (0,), (1,)) for m in core_deepseek.mtp_extra_states(impl)]
    return keys


def _extra_state(module: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> str:
    """`module`'s extra state at `offsets` of the stacked `shape`: `….linear_fc1._extra_state/shard_3.1_4.8`."""
    return f"{module}._extra_state/shard_{'.'.join(map(str, offsets))}_{'.'.join(map(str, shape))}"


def _layer_extra_states(config: ModelConfig, impl: core.Impl, layer: int) -> tuple[list[str], list[str]]:
    """(modules of `layer` with one `_extra_state`, expert modules with one per expert), relative to the layer."""
    moe = config.is_moe_layer(layer)
    modules = [m.removeprefix(LAYER_PREFIX) for m in core.extra_state_modules(impl, config=config)
               if not (moe and ".mlp." in m)]
    if moe:
        modules += ["pre_mlp_layernorm"] if impl == "te" else []  # a TENorm of its own in MoE layers
        modules += ["mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"] \
            if config.moe_shared_expert_ffn_hidden_size else []
    return modules, ["mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2"] if moe else []


def metadata_json(backend: str) -> dict:
    return {"sharded_backend": backend, "sharded_backend_version": 1, "common_backend": "torch",
            "common_backend_version": 1}
