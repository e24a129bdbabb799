"""Megatron-core distributed checkpoints (`torch_dist`, and the older `zarr`): keys, layout, common state.

The same tensors as the `torch` format, but stored once, unsharded, independent of the TP/PP layout:

    iter_0000001/metadata.json     {"sharded_backend": "torch_dist"|"zarr", "sharded_backend_version": 1, ...}
    iter_0000001/common.pt         args, checkpoint_version, iteration, ... (newer Megatron: a `common_state/
                                   shard_0_1` bytes entry inside the checkpoint instead)
    iter_0000001/.metadata, __R_I.distcp   (torch_dist)    or   one zarr array directory per key (zarr)

Layer tensors are stacked along a leading layer axis under a key without the layer number
(`decoder.layers.self_attention.linear_qkv.weight` is [L, rows, h]); SwiGLU's fc1 is the whole-tensor
[all gate ; all up]. Norms use the Transformer-Engine names for both specs. Each layer module's `_extra_state`
is a pickled object per layer under `decoder.layers.<module>._extra_state/shard_{L}_{num_layers}`.
"""

from __future__ import annotations

from mconvert.rules import Table
from mconvert.schemas import core

METADATA_JSON = "metadata.json"
COMMON_FILE = "common.pt"
COMMON_STATE = "common_state/shard_0_1"  # newer Megatron keeps the common dict inside the checkpoint
BACKENDS = ("torch_dist", "zarr")
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
LAYER_PREFIX = "decoder.layers.{l}."


def table(moe: bool = False) -> Table:
    """Per-layer rules (keys still carry `{l}`; `stacked_key` removes it), with TE norm names for every spec."""
    return core.table("te", moe=moe)


def stacked_key(key: str, layer: int) -> str:
    """`decoder.layers.3.mlp.linear_fc1.weight` -> `decoder.layers.mlp.linear_fc1.weight` (layer 3 of the stack)."""
    prefix = LAYER_PREFIX.format(l=layer)
    return "decoder.layers." + key[len(prefix):] if key.startswith(prefix) else key


def extra_state_key(module_template: str, layer: int, num_layers: int) -> str:
    return f"{stacked_key(module_template.format(l=layer), layer)}._extra_state/shard_{layer}_{num_layers}"


def extra_state_modules(impl: core.Impl) -> tuple[str, ...]:
    """The layer modules whose `_extra_state` a distributed checkpoint stores (as Megatron's specs do)."""
    return core.extra_state_modules(impl)


def metadata_json(backend: str) -> dict:
    return {"sharded_backend": backend, "sharded_backend_version": 1, "common_backend": "torch",
            "common_backend_version": 1}
