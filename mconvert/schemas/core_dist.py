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

Layers that differ (dense layers among expert layers: moe_layer_freq a list, as DeepSeek's) are not stacked:
Megatron then keys each layer by its global number, `decoder.layers.3.self_attention.linear_qkv.weight`, experts
`decoder.layers.3.mlp.experts.experts.linear_fc1.weight` [E, 2f, h], extra states `shard_0_1` (`shard_e_E`).
Multi-token-prediction modules are keyed the same way, `mtp.layers.{m}.` and `mtp.layers.{m}.transformer_layer.`,
and the embedding is stored once.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from mconvert.ir import ModelConfig
from mconvert.mapping import Row, expand
from mconvert.rules import GATE_UP, Rule, Table, norm
from mconvert.schemas import core, core_deepseek

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


def is_stacked(keys) -> bool:
    """Layers stacked on a leading axis, or keyed one by one (`decoder.layers.3.`)?"""
    return not any(re.match(r"decoder\.layers\.\d+\.", k) for k in keys)


@dataclass(frozen=True)
class Placed:
    """One stored block: the row (IR names, rule; a unique key), the stored key, its leading indices into the
    stacked axes, and those axes' sizes."""

    row: Row
    key: str
    index: tuple[int, ...] = ()  # () whole tensor, (L,) a layer of a stack, (L, E) / (E,) an expert
    stack: tuple[int, ...] = ()  # (num_layers,), (num_layers, num_experts) or (num_experts,)


def placements(config: ModelConfig, impl: core.Impl = "local", stacked: bool | None = None) -> list[Placed]:
    """Every block of the checkpoint in file order: embeddings, each layer (dense rules, then its experts), head,
    MTP modules. Layers are stacked unless told otherwise or unless they differ (dense and expert layers), as
    Megatron does. Loader and saver both walk this list, so the two directions cannot disagree."""
    stacked = not config.dense_layers if stacked is None else stacked
    t, n, experts = table(impl, config.is_mla), config.num_layers, config.num_experts or 0
    out = [Placed(r, r.key) for r in expand(t, config, layers=[], head=False)]
    for L in range(n):
        for r in expand(t, config, layers=[(L, L)], experts=[], embedding=False, head=False):
            out.append(Placed(r, stacked_key(r.key, L), (L,), (n,)) if stacked else Placed(r, r.key))
        for E in range(experts) if config.is_moe_layer(L) else ():
            for rule in EXPERT_RULES:
                key, names = rule.keys(L=L, E=E)
                if stacked:
                    out.append(Placed(Row(f"{key}[{L},{E}]", names, rule), key, (L, E), (n, experts)))
                else:
                    key = key.replace("decoder.layers.", f"decoder.layers.{L}.", 1)
                    out.append(Placed(Row(f"{key}[{E}]", names, rule), key, (E,), (experts,)))
    out += [Placed(r, r.key) for r in expand(t, config, layers=[], embedding=False, mtp=[])]
    for M in range(config.mtp_layers):
        out += [Placed(r, r.key) for r in expand(t, config, layers=[], experts=[], embedding=False, head=False,
                                                 mtp=[(M, M)])]
        for E in range(experts) if config.is_moe_layer(n + M) else ():
            for rule in EXPERT_RULES:
                key, names = rule.keys(L=n + M, E=E)
                key = key.replace("decoder.layers.", f"mtp.layers.{M}.transformer_layer.", 1)
                out.append(Placed(Row(f"{key}[{E}]", names, rule), key, (E,), (experts,)))
    return out


def stacked_key(key: str, layer: int) -> str:
    """`decoder.layers.3.mlp.linear_fc1.weight` -> `decoder.layers.mlp.linear_fc1.weight` (layer 3 of the stack)."""
    prefix = LAYER_PREFIX.format(l=layer)
    return "decoder.layers." + key[len(prefix):] if key.startswith(prefix) else key


def extra_states(config: ModelConfig, impl: core.Impl) -> list[str]:
    """The `_extra_state` keys of the checkpoint, as Megatron's local or Transformer-Engine specs store them."""
    n, experts, stacked = config.num_layers, config.num_experts or 0, not config.dense_layers
    keys = []
    for L in range(n + config.mtp_layers):
        mtp = L >= n
        prefix = f"mtp.layers.{L - n}.transformer_layer." if mtp else "decoder.layers." if stacked \
            else f"decoder.layers.{L}."
        whole, per_layer = ("0", "1") if mtp or not stacked else (str(L), str(n))
        layer, expert = _layer_extra_states(config, impl, L)
        keys += [f"{prefix}{m}._extra_state/shard_{whole}_{per_layer}" for m in layer]
        keys += [f"{prefix}{m}._extra_state/shard_{'' if mtp or not stacked else f'{L}.'}{E}_"
                 f"{'' if mtp or not stacked else f'{n}.'}{experts}" for E in range(experts) for m in expert]
    if impl == "te":
        keys.append("decoder.final_layernorm._extra_state/shard_0_1")
    for M in range(config.mtp_layers):
        keys += [f"mtp.layers.{M}.{m}._extra_state/shard_0_1" for m in core_deepseek.mtp_extra_states(impl)]
    return keys


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
