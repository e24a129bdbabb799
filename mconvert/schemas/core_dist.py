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

Checkpoints saved with megatron-core's `singleton_local_shards` metadata (Megatron-LM's default in Sept-Oct
2025, recorded in the common state's `content_metadata`) store every layer and expert under its own key, and
SwiGLU's fc1 as its two halves (see mconvert.schemas.swiglu_halves):

    decoder.layers.3.mlp.linear_fc1.weight_w                   [f, h]     gate of layer 3
    decoder.layers.3.mlp.experts.experts.1.linear_fc1.weight_v [f, h]     up of layer 3's expert 1
    decoder.layers.3.mlp.experts.experts.1.linear_fc2.weight   [h, f]
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mconvert.ir import ModelConfig
from mconvert.mapping import Row, expand
from mconvert.rules import GATE_UP, Rule, Table
from mconvert.schemas import core
from mconvert.schemas.swiglu_halves import halves

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
_PER_LAYER_KEY = re.compile(r"decoder\.layers\.\d+\.")


def table(moe: bool = False, impl: core.Impl = "local") -> Table:
    """Per-layer rules (keys still carry `{l}`; `stacked_key` removes it).

    Norms take the Transformer-Engine names for both specs (the local spec maps its own names onto them), except
    the pre-MLP norm of MoE layers under TE, which is a module of its own there (`pre_mlp_layernorm.weight`).
    """
    return core.table("te", moe=moe and impl == "te")


def detect_impl(keys) -> core.Impl:
    """Only MoE checkpoints tell the specs apart: TE keeps `pre_mlp_layernorm` as its own module."""
    pattern = re.compile(r"decoder\.layers\.(\d+\.)?pre_mlp_layernorm\.weight")
    return "te" if any(pattern.fullmatch(k) for k in keys) else "local"


def is_singleton(keys) -> bool:
    """Per-layer keys (`decoder.layers.3.…`): saved with `singleton_local_shards`."""
    return any(_PER_LAYER_KEY.match(k) for k in keys)


@dataclass(frozen=True)
class Placed:
    """One stored block: the row (IR names, rule; a unique key), the stored key, and its leading indices."""

    row: Row
    key: str
    index: tuple[int, ...]  # () whole tensor, (L,) a layer of a stack, (L, E) an expert of a layer


def placements(config: ModelConfig, impl: core.Impl = "local", *, singleton: bool = False) -> list[Placed]:
    """Every block of the checkpoint in file order: embeddings, each layer (dense rules, then its experts), head.

    Loader and saver both walk this list, so the two directions cannot disagree about what goes where. With
    `singleton` (see the module docstring) every block is a whole tensor of its own.
    """
    t = table(moe=config.is_moe, impl=impl)
    out = [Placed(r, r.key, ()) for r in expand(t, config, layers=[], head=False)]
    for L in range(config.num_layers):
        dense = expand(t, config, layers=[(L, L)], experts=[], embedding=False, head=False)
        if singleton:
            experts = [Row(*rule.keys(L=L, E=E), rule) for E in range(config.num_experts or 0)
                       for rule in SINGLETON_EXPERT_RULES]
            out += [Placed(r, r.key, ()) for r in halves(dense + experts)]
            continue
        out += [Placed(r, stacked_key(r.key, L), (L,)) for r in dense]
        for E in range(config.num_experts or 0):
            for rule in EXPERT_RULES:
                key, names = rule.keys(L=L, E=E)
                out.append(Placed(Row(f"{key}[{L},{E}]", names, rule), key, (L, E)))
    out += [Placed(r, r.key, ()) for r in expand(t, config, layers=[], embedding=False)]
    return out


def stacked_key(key: str, layer: int) -> str:
    """`decoder.layers.3.mlp.linear_fc1.weight` -> `decoder.layers.mlp.linear_fc1.weight` (layer 3 of the stack)."""
    prefix = LAYER_PREFIX.format(l=layer)
    return "decoder.layers." + key[len(prefix):] if key.startswith(prefix) else key


def extra_states(config: ModelConfig, impl: core.Impl) -> list[str]:
    """The `_extra_state` keys of the checkpoint, as Megatron's local or Transformer-Engine specs store them."""
    n, experts = config.num_layers, config.num_experts or 0
    modules = [m for m in core.extra_state_modules(impl) if not (config.is_moe and ".mlp." in m)]
    keys = [f"{stacked_key(m.format(l=L), L)}._extra_state/shard_{L}_{n}" for L in range(n) for m in modules]
    if config.is_moe:
        if impl == "te":  # a TENorm of its own in MoE layers
            keys += [f"decoder.layers.pre_mlp_layernorm._extra_state/shard_{L}_{n}" for L in range(n)]
        keys += [f"{EXPERTS}.linear_fc{k}._extra_state/shard_{L}.{E}_{n}.{experts}"
                 for L in range(n) for E in range(experts) for k in (1, 2)]
    if impl == "te":
        keys.append("decoder.final_layernorm._extra_state/shard_0_1")
    return keys


def metadata_json(backend: str) -> dict:
    return {"sharded_backend": backend, "sharded_backend_version": 1, "common_backend": "torch",
            "common_backend_version": 1}
