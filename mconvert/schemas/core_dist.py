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
Transformer-Engine names for both specs. Each module's `_extra_state` is a pickled one-element list per layer
(and expert) under `<stacked module>._extra_state/shard_{offsets}_{shape}`, e.g. `shard_3_4` or `shard_3.1_4.8`.

When the layers differ (a `moe_layer_freq` pattern: dense layers among the expert layers), megatron-core does not
stack them: each layer keeps its global number (`decoder.layers.3.self_attention.linear_qkv.weight` [rows, h],
`decoder.layers.3.mlp.experts.experts.linear_fc1.weight` [E, 2f, h]) and its extra states are `shard_0_1` (experts
`shard_{e}_{E}`).

Checkpoints saved with megatron-core's `singleton_local_shards` metadata (Megatron-LM's default in Sept-Oct
2025, recorded in the common state's `content_metadata`) also keep every layer under its own number, and in
addition every expert under its own key and SwiGLU's fc1 as its two halves (mconvert.schemas.swiglu_halves):

    decoder.layers.3.mlp.linear_fc1.weight_w                   [f, h]     gate of layer 3
    decoder.layers.3.mlp.experts.experts.1.linear_fc1.weight_v [f, h]     up of layer 3's expert 1
    decoder.layers.3.mlp.experts.experts.1.linear_fc2.weight   [h, f]
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from mconvert.ir import ModelConfig
from mconvert.mapping import Row, expand
from mconvert.rules import GATE_UP, Rule, Table, norm
from mconvert.schemas import core
from mconvert.schemas.swiglu_halves import HALF_KEY, halves

METADATA_JSON = "metadata.json"
COMMON_FILE = "common.pt"
COMMON_STATE = "common_state/shard_0_1"  # newer Megatron keeps the common dict inside the checkpoint
BACKENDS = ("torch_dist", "zarr")
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
LAYER_PREFIX = "decoder.layers.{l}."


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
# is a module of its own (`pre_mlp_layernorm.weight`).
_LOCAL_LAYER = (
    *norm("decoder.layers.{l}.self_attention.linear_qkv", "layers.{L}.attn_norm", fused=True),
    *core.ATTENTION,
    *norm("decoder.layers.{l}.mlp.linear_fc1", "layers.{L}.mlp_norm", fused=True),
    *core.MLP,
)
TABLES = {"local": dataclasses.replace(core.table("local"), layer=_LOCAL_LAYER), "te": core.table("te")}


def table(impl: core.Impl = "local") -> Table:
    """Per-layer rules (keys still carry `{l}`; `stacked_key` removes it); experts are in EXPERT_RULES."""
    return TABLES[impl]


def detect_impl(keys) -> core.Impl:
    """Only MoE checkpoints tell the specs apart: TE keeps `pre_mlp_layernorm` as its own module."""
    return "te" if any(re.fullmatch(r"decoder\.layers\.(\d+\.)?pre_mlp_layernorm\.weight", k) for k in keys) \
        else "local"


def per_layer_keys(config: ModelConfig) -> bool:
    """Does megatron-core store this model's layers one by one rather than stacked? It does when the args carry a
    moe_layer_freq pattern, which ours do exactly when there are dense layers among the expert layers."""
    return bool(config.dense_layers)


def detect_per_layer(keys) -> bool:
    return any(re.match(r"decoder\.layers\.\d+\.", k) for k in keys)


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
    index: tuple[int, ...]
    stack: tuple[int, ...] = ()


def placements(config: ModelConfig, impl: core.Impl = "local", per_layer: bool | None = None, *,
               singleton: bool = False) -> list[Placed]:
    """Every block of the checkpoint in file order: embeddings, each layer (dense rules, then its experts), head.

    Loader and saver both walk this list, so the two directions cannot disagree about what goes where. With
    `singleton` (read only; see the module docstring) every block is a whole tensor of its own.
    """
    t, n, experts = table(impl), config.num_layers, config.num_experts or 0
    per_layer = per_layer_keys(config) if per_layer is None else per_layer
    out = [Placed(r, r.key, ()) for r in expand(t, config, layers=[], head=False)]
    for L in range(n):
        if singleton:
            dense = expand(t, config, layers=[(L, L)], experts=[], embedding=False, head=False)
            own = [Row(*rule.keys(L=L, E=E), rule) for E in (range(experts) if config.is_moe_layer(L) else ())
                   for rule in SINGLETON_EXPERT_RULES]
            out += [Placed(r, r.key, ()) for r in halves(dense + own)]
            continue
        for r in expand(t, config, layers=[(L, L)], experts=[], embedding=False, head=False):
            out.append(Placed(r, r.key, ()) if per_layer else Placed(r, stacked_key(r.key, L), (L,), (n,)))
        for E in range(experts) if config.is_moe_layer(L) else ():
            for rule in EXPERT_RULES:
                key, names = rule.keys(L=L, E=E)
                row = Row(f"{key}[{L},{E}]", names, rule)
                out.append(Placed(row, layer_key(key, L), (E,), (experts,)) if per_layer
                           else Placed(row, key, (L, E), (n, experts)))
    out += [Placed(r, r.key, ()) for r in expand(t, config, layers=[], embedding=False)]
    return out


def layer_key(key: str, layer: int) -> str:
    """`decoder.layers.mlp.experts.experts.linear_fc1.weight` -> `decoder.layers.3.mlp.experts...` (layer 3's)."""
    return f"decoder.layers.{layer}." + key.removeprefix("decoder.layers.")


def stacked_key(key: str, layer: int) -> str:
    """`decoder.layers.3.mlp.linear_fc1.weight` -> `decoder.layers.mlp.linear_fc1.weight` (layer 3 of the stack)."""
    prefix = LAYER_PREFIX.format(l=layer)
    return "decoder.layers." + key[len(prefix):] if key.startswith(prefix) else key


def extra_states(config: ModelConfig, impl: core.Impl) -> list[str]:
    """The `_extra_state` keys of the checkpoint, as Megatron's local or Transformer-Engine specs store them."""
    n, experts = config.num_layers, config.num_experts or 0
    moe = [L for L in range(n) if config.is_moe_layer(L)]
    per_layer = per_layer_keys(config)

    def key(module: str, L: int, offsets: tuple[int, ...] = (), shape: tuple[int, ...] = ()) -> str:
        """module (a `{l}` template or a stacked key) of layer L, at `offsets` of `shape` after the layer axis."""
        stacked = stacked_key(module.format(l=L), L)
        if per_layer:
            name, offsets, shape = layer_key(stacked, L), offsets or (0,), shape or (1,)
        else:
            name, offsets, shape = stacked, (L, *offsets), (n, *shape)
        return f"{name}._extra_state/shard_{'.'.join(map(str, offsets))}_{'.'.join(map(str, shape))}"

    keys = [key(m, L) for L in range(n) for m in core.extra_state_modules(impl, qk_norm=config.qk_norm)
            if not (L in moe and ".mlp." in m)]
    if impl == "te":  # a TENorm of its own in MoE layers
        keys += [key("decoder.layers.pre_mlp_layernorm", L) for L in moe]
    keys += [key(f"{EXPERTS}.linear_fc{k}", L, (E,), (experts,)) for L in moe for E in range(experts) for k in (1, 2)]
    if impl == "te":
        keys.append("decoder.final_layernorm._extra_state/shard_0_1")
    return keys


def metadata_json(backend: str) -> dict:
    return {"sharded_backend": backend, "sharded_backend_version": 1, "common_backend": "torch",
            "common_backend_version": 1}
