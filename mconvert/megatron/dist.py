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
addition every expert under its own key and SwiGLU's fc1 as its two halves (mconvert.megatron.swiglu_halves):

    decoder.layers.3.mlp.linear_fc1.weight_w                   [f, h]     gate of layer 3
    decoder.layers.3.mlp.experts.experts.1.linear_fc1.weight_v [f, h]     up of layer 3's expert 1
    decoder.layers.3.mlp.experts.experts.1.linear_fc2.weight   [h, f]

(Multi-token-prediction modules saved that way are refused: none has been seen.)

Reading (for the `core` loader): layer-stacked tensors are read one layer slice at a time (the storage readers map
or fetch only the chunks covering that layer), so memory stays at about one layer whatever the model size.

Writing (for the `core` saver, `--ckpt-format torch_dist` or `zarr`): the checkpoint is layout-independent: every
tensor is written whole, layers stacked, one layer block at a time. `--tp` only decides the vocabulary padding
(Megatron pads to a multiple of divisible_by x TP of the run that will load it). The common state goes to
`common.pt`, which every megatron-core release reads. torch_dist checkpoints get the SHA-256 manifest
`integrity.json` that megatron-core writes with --verify-integrity.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mconvert import workers
from mconvert.errors import ConvertError, mismatch
from mconvert.io import dcp_writer, file_views, hf_dir, torch_archive
from mconvert.io.dcp import DcpReader
from mconvert.io.file_views import FileViews
from mconvert.io.integrity import Manifest, write_manifest
from mconvert.io.torch_pickle import safe_load
from mconvert.io.torch_zip import save as torch_save
from mconvert.ir import dtypes, sizes
from mconvert.ir.blocks import ByteBlocks, as_blocks, reshape
from mconvert.ir.checks import MEGATRON_INTEGERS, check_integers
from mconvert.ir.config import ModelConfig
from mconvert.ir.dtypes import dtype_name
from mconvert.ir.tensors import Elements, LazyTensor, LoadCache, ModelIR, SourceInfo
from mconvert.lazy import torch
from mconvert.megatron import arguments, bridge_config, core, dist_optim, rank_files
from mconvert.megatron import mla as mla_keys
from mconvert.megatron.swiglu_halves import HALF_KEY, halves
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.rules.mapping import Row, check_plan, expand, to_ir, verify_copies
from mconvert.rules.row_plan import RowPlanner
from mconvert.rules.table import GATE_UP, Ctx, Rule, Table, moved, norm
from mconvert.workers import Job

COMMON_FILE = "common.pt"
COMMON_STATE = "common_state/shard_0_1"  # newer Megatron keeps the common dict inside the checkpoint
BACKENDS = ("torch_dist", "zarr")
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
STACKED_PREFIX = "decoder.layers."  # the keys of the layer stack: no layer number


EXPERTS = "decoder.layers.mlp.experts.experts"
EXPERT_RULES = (
    Rule(f"{EXPERTS}.linear_fc1.weight", ("layers.{L}.moe.experts.{E}.gate.weight",
                                          "layers.{L}.moe.experts.{E}.up.weight"), GATE_UP),
    Rule(f"{EXPERTS}.linear_fc2.weight", ("layers.{L}.moe.experts.{E}.down.weight",)),
    # expert biases (GPT-OSS)
    Rule(f"{EXPERTS}.linear_fc1.bias", ("layers.{L}.moe.experts.{E}.gate.bias", "layers.{L}.moe.experts.{E}.up.bias"),
         GATE_UP),
    Rule(f"{EXPERTS}.linear_fc2.bias", ("layers.{L}.moe.experts.{E}.down.bias",)),
)


SINGLETON_EXPERTS = "decoder.layers.{L}.mlp.experts.experts.{E}"
SINGLETON_EXPERT_RULES = (
    Rule(f"{SINGLETON_EXPERTS}.linear_fc1.weight", ("layers.{L}.moe.experts.{E}.gate.weight",
                                                    "layers.{L}.moe.experts.{E}.up.weight"), GATE_UP),
    Rule(f"{SINGLETON_EXPERTS}.linear_fc2.weight", ("layers.{L}.moe.experts.{E}.down.weight",)),
    Rule(f"{SINGLETON_EXPERTS}.linear_fc1.bias", ("layers.{L}.moe.experts.{E}.gate.bias",
                                                  "layers.{L}.moe.experts.{E}.up.bias"), GATE_UP),
    Rule(f"{SINGLETON_EXPERTS}.linear_fc2.bias", ("layers.{L}.moe.experts.{E}.down.bias",)),
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
# An MTP module's layer (standard attention: GLM-4.5) is stored with the same names as a decoder layer.
TABLES = {("local", False): dataclasses.replace(core.table("local"), layer=_LOCAL_LAYER,
                                                mtp_layer=moved(_LOCAL_LAYER, mla_keys.LAYER_PREFIX,
                                                                mla_keys.MTP_LAYER_PREFIX)),
          ("te", False): core.table("te"), ("local", True): core.table("local", mla=True),
          ("te", True): core.table("te", mla=True)}


# megatron-core's BertModel: its layers under `encoder.` (the local spec maps its norms as GPT's does)
BERT_TABLES = {"local": dataclasses.replace(core.table("local", bert=True),
                                            layer=moved(_LOCAL_LAYER, "decoder.", core.BERT_PREFIX)),
               "te": core.table("te", bert=True)}


def table(impl: core.Impl = "local", mla: bool = False, bert: bool = False) -> Table:
    """Per-layer rules (keys still carry `{l}`; `stacked_key` removes it); experts are in EXPERT_RULES."""
    return BERT_TABLES[impl] if bert else TABLES[(impl, mla)]


def stack_prefix(config: ModelConfig) -> str:
    """Where the layer stack's keys start: `decoder.layers.` (GPTModel), `encoder.layers.` (BertModel)."""
    return core.BERT_PREFIX + "layers." if config.is_bert else STACKED_PREFIX


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
        return mla_keys.MTP_LAYER_PREFIX.format(m=layer - n)
    return f"{stack_prefix(config)}{layer}." if per_layer else stack_prefix(config)


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
    t, n = table(impl, config.is_mla, config.is_bert), config.num_layers
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


def expert_rules(config: ModelConfig, rules: tuple[Rule, ...]) -> tuple[Rule, ...]:
    """The expert rules of this model: the biases only when its experts have them (GPT-OSS)."""
    return rules if config.mlp_bias else tuple(r for r in rules if not r.key.endswith(".bias"))


def _singleton_blocks(config: ModelConfig, L: int, rows: list[Row]) -> list[Placed]:
    """Layer L saved with `singleton_local_shards`: whole tensors, experts under their own numbers, SwiGLU halves."""
    experts = range(config.num_experts or 0) if config.is_moe_layer(L) else ()
    own = [Row(*rule.keys(L=L, E=E), rule) for E in experts for rule in expert_rules(config, SINGLETON_EXPERT_RULES)]
    return [Placed(r, r.key) for r in halves(rows + own)]


def _layer_blocks(config: ModelConfig, L: int, rows: list[Row], prefix: str) -> list[Placed]:
    """Layer L's blocks: its rows (keys numbered by layer, or an MTP module's), then each expert's tensors."""
    n, experts, stacked = config.num_layers, config.num_experts or 0, prefix == stack_prefix(config)
    out = [Placed(r, stacked_key(r.key, L, prefix), (L,), (n,)) if stacked else Placed(r, r.key) for r in rows]
    for E in range(experts) if config.is_moe_layer(L) else ():
        for rule in expert_rules(config, EXPERT_RULES):
            key, names = rule.keys(L=L, E=E)
            if stacked:
                out.append(Placed(Row(f"{key}[{L},{E}]", names, rule), key, (L, E), (n, experts)))
            else:
                key = layer_key(key, prefix)
                out.append(Placed(Row(f"{key}[{E}]", names, rule), key, (E,), (experts,)))
    return out


def stacked_key(key: str, layer: int, stack: str = STACKED_PREFIX) -> str:
    """`decoder.layers.3.mlp.linear_fc1.weight` -> `decoder.layers.mlp.linear_fc1.weight` (layer 3 of the stack
    under `stack`)."""
    prefix = f"{stack}{layer}."
    return stack + key[len(prefix):] if key.startswith(prefix) else key


def extra_states(config: ModelConfig, impl: core.Impl) -> list[str]:
    """The `_extra_state` keys of the checkpoint, as Megatron's local or Transformer-Engine specs store them."""
    n, experts, per_layer = config.num_layers, config.num_experts or 0, per_layer_keys(config)
    keys = []
    for L in range(n + config.mtp_layers):
        prefix = layer_prefix(config, L, per_layer)
        # a layer of the stack is entry L of n; a layer keyed on its own (MTP modules too) entry 0 of 1
        at, of = ((L,), (n,)) if prefix == stack_prefix(config) else ((), ())
        layer, expert = _layer_extra_states(config, impl, L)
        keys += [_extra_state(prefix + m, at or (0,), of or (1,)) for m in layer]
        keys += [_extra_state(prefix + m, (*at, E), (*of, experts)) for E in range(experts) for m in expert]
    if impl == "te":
        keys.append(_extra_state(("encoder" if config.is_bert else "decoder") + ".final_layernorm", (0,), (1,)))
    for M in range(config.mtp_layers):
        keys += [_extra_state(f"mtp.layers.{M}.{m}", (0,), (1,)) for m in mla_keys.mtp_extra_states(impl)]
    return keys


def _extra_state(module: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> str:
    """`module`'s extra state at `offsets` of the stacked `shape`: `….linear_fc1._extra_state/shard_3.1_4.8`."""
    return f"{module}._extra_state/shard_{'.'.join(map(str, offsets))}_{'.'.join(map(str, shape))}"


def _layer_extra_states(config: ModelConfig, impl: core.Impl, layer: int) -> tuple[list[str], list[str]]:
    """(modules of `layer` with one `_extra_state`, expert modules with one per expert), relative to the layer."""
    moe = config.is_moe_layer(layer)
    modules = [m.removeprefix(stack_prefix(config) + "{l}.") for m in core.extra_state_modules(impl, config=config)
               if not (moe and ".mlp." in m)]
    if moe:
        modules += ["pre_mlp_layernorm"] if impl == "te" else []  # a TENorm of its own in MoE layers
        modules += ["mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"] \
            if config.moe_shared_expert_ffn_hidden_size else []
    return modules, ["mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2"] if moe else []


def metadata_json(backend: str) -> dict:
    return {"sharded_backend": backend, "sharded_backend_version": 1, "common_backend": "torch",
            "common_backend_version": 1}


def open_store(it_dir: Path, *, verify: bool = True):
    """The reader of a torch_dist or zarr directory; with `verify`, its files are checked against integrity.json
    (when there is one) before they are used."""
    manifest = Manifest.find(it_dir) if verify else None
    if manifest is not None:  # metadata.json picks the reader: verified before it is believed
        manifest.check_file(core.METADATA_JSON)
    meta = hf_dir.read_json(it_dir / core.METADATA_JSON)
    backend = meta.get("sharded_backend")
    if backend == "torch_dist":
        return DcpReader(it_dir, verify=verify), backend
    if backend == "zarr":
        from mconvert.io.zarr import ZarrReader  # tensorstore: slow to import, only for zarr

        return ZarrReader(it_dir), backend
    raise ConvertError(f"{it_dir / core.METADATA_JSON}: unknown sharded_backend {backend!r}; this tool reads "
                       f"{' and '.join(BACKENDS)} distributed checkpoints")


def read_common(it_dir: Path, store) -> dict[str, Any]:
    """The non-tensor state: `common.pt` (older Megatron) or the in-checkpoint `common_state` object (newer).

    With an integrity manifest, `metadata.json` and `common.pt` are verified before use (the `.distcp` files as
    they are read, see mconvert.io.integrity).
    """
    manifest = getattr(store, "manifest", None)
    if manifest is not None:
        manifest.check_file(core.METADATA_JSON)
    if (it_dir / COMMON_FILE).is_file():
        if manifest is not None:
            manifest.check_file(COMMON_FILE)
        try:  # settings only, usually: read without torch
            common = torch_archive.read_plain(it_dir / COMMON_FILE)
        except torch_archive.Unreadable:
            common = safe_load(it_dir / COMMON_FILE, mmap=False)
    elif COMMON_STATE in getattr(store, "bytes_items", {}):
        common = store.read_object(COMMON_STATE)
        common = common[0] if isinstance(common, list) and common else common
    else:
        raise ConvertError(f"{it_dir}: neither {COMMON_FILE} nor a {COMMON_STATE} entry: "
                           "cannot find the checkpoint's args")
    if not isinstance(common, dict):
        raise ConvertError(f"{it_dir}: the common state is a {type(common).__name__}, not a dict")
    if common.get("args") is None:
        args, found = _args_from_config_file(it_dir, manifest)
        common = dict(common, args=args, config_from=found)
    if not hasattr(common["args"], "__dict__"):
        raise ConvertError(f"{it_dir}: 'args' is a {type(common['args']).__name__}, not a namespace of Megatron "
                           "arguments")
    check_integers(vars(common["args"]), MEGATRON_INTEGERS, str(it_dir), "args.")
    return common


def config_file(it_dir: Path) -> Path | None:
    """Megatron-Bridge's `iter_*/run_config.yaml`, or NeMo 2's `context/model.yaml` beside `weights/`."""
    if (it_dir / bridge_config.RUN_CONFIG).is_file():
        return it_dir / bridge_config.RUN_CONFIG
    if it_dir.name == bridge_config.NEMO_WEIGHTS and (it_dir.parent / "context").is_dir():
        return it_dir.parent / "context"
    return None


def _args_from_config_file(it_dir: Path, manifest) -> tuple[Any, str]:
    """Megatron-LM args from the model config Megatron-Bridge or NeMo 2 keep instead (see bridge_config)."""
    found = config_file(it_dir)
    if found is None:
        raise ConvertError(f"{it_dir}: the common state has no 'args' and there is no {bridge_config.RUN_CONFIG} "
                           "(Megatron-Bridge) or context/model.yaml or io.json (NeMo 2); cannot tell the model "
                           "shape")
    if manifest is not None and found.is_file():
        manifest.check_file(found.name)
    model, where = (bridge_config.bridge_model(found), found) if found.is_file() else \
        bridge_config.nemo_model(found.parent)
    return bridge_config.args_from_provider(model, str(where)), str(where.relative_to(it_dir.parent))


NEMO_PREFIX = "module."  # NeMo 2 saves the model under its MegatronParallel wrapper's name


class Unprefixed:
    """A store whose every tensor key starts with `prefix` (NeMo 2's `module.`), seen without it."""

    def __init__(self, store, prefix: str) -> None:
        self._store, self._prefix = store, prefix
        self.tensors = {k[len(prefix):]: v for k, v in store.tensors.items()}

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def read(self, key: str, index=()):
        return self._store.read(self._prefix + key, index)

    def read_blocks(self, key: str, index=()):
        return self._store.read_blocks(self._prefix + key, index)

    def values_bound(self, keys) -> int:
        return self._store.values_bound([self._prefix + k for k in keys])

    def lazy_elements(self, key: str, index=()):
        return self._store.lazy_elements(self._prefix + key, index)


def load_dist(it_dir: Path, iteration: int | None, options: Options) -> ModelIR:
    store, backend = open_store(it_dir, verify=options.verify_integrity)
    common = read_common(it_dir, store)
    if backend == "torch_dist" and store.tensors and all(k.startswith(NEMO_PREFIX) for k in store.tensors):
        store = Unprefixed(store, NEMO_PREFIX)
    args = common["args"]
    embed_key = "embedding.word_embeddings.weight"
    if embed_key not in store.tensors:
        raise ConvertError(f"{it_dir}: no {embed_key} in the checkpoint")
    shape, dtype = _shape_dtype(store, embed_key)
    padded = shape[0]
    if common.get("config_from") and args.padded_vocab_size not in (None, padded):
        raise ConvertError(f"{it_dir.parent / common['config_from']}: vocab_size {args.vocab_size} (should_pad_vocab, "
                           f"make_vocab_size_divisible_by) makes {args.padded_vocab_size} embedding rows, the "
                           f"checkpoint stores {padded}")
    notes: list[str] = []
    # --tokenizer, iter_*/tokenizer or args.tokenizer_model
    assets = rank_files.tokenizer(options, it_dir, args, notes)
    vocab, vocab_notes = arguments.true_vocab_size(args, options.true_vocab_size, assets, padded, where=str(it_dir))
    notes += vocab_notes
    values = store.values_bound(store.tensors) if backend == "torch_dist" else \
        sizes.stored_elements(_shape_dtype(store, k)[0] for k in store.tensors)  # zarr: absent chunks are fill
    config = arguments.config_from_args(args, vocab_size=int(vocab), padded_vocab_size=padded, dtype=dtype_name(dtype),
                                        where=str(it_dir), stored=values)
    if core.is_bert_model(store.tensors):
        types = store.tensors.get("embedding.tokentype_embeddings.weight")
        config = arguments.bert_config(
            config, num_tokentypes=0 if types is None else _shape_dtype(store, "embedding.tokentype_embeddings.weight")
            [0][0], binary_head="binary_head.weight" in store.tensors, where=str(it_dir))

    source: dict[str, list[LazyTensor]] = {}
    rows: list[Row] = []
    impl, per_layer = detect_impl(store.tensors), detect_per_layer(store.tensors)
    singleton = detect_singleton(store.tensors)
    if singleton and config.mtp_layers:
        raise ConvertError(f"{it_dir}: multi-token-prediction modules in a checkpoint saved with "
                           "singleton_local_shards are not read: this tool reads MTP modules from megatron-core's "
                           "default torch_dist layout only")
    placed_blocks = placements(config, impl, per_layer=per_layer, singleton=singleton)
    for placed in placed_blocks:
        rows.append(placed.row)
        source[placed.row.key] = [_lazy(store, placed, it_dir)]
    used = {placed.key for placed in placed_blocks}
    missing = sorted(k for k in used if k not in store.tensors)
    tied_copy = "output_layer.weight" if config.tie_embeddings else None
    optimizer = any(dist_optim.is_optimizer_key(k) for k in store.tensors)
    extra = sorted(k for k in store.tensors if k not in used and k != tied_copy and not dist_optim.is_optimizer_key(k))
    if missing or extra:
        raise ConvertError(f"{it_dir}: the tensors do not match a {config.family} model with these args. "
                           + mismatch(missing, extra))
    tensors = to_ir(source, rows, Ctx(config, padded), where=str(it_dir), cache=LoadCache(4))
    if tied_copy in store.tensors:  # a stored copy of the tied embedding: checked, never silently dropped
        copy = LazyTensor(*_shape_dtype(store, tied_copy), lambda: store.read(tied_copy), f"{it_dir.name}:{tied_copy}",
                          elements_of=_elements(store, tied_copy, ()))
        verify_copies(tensors, "embed.weight", [[copy]], core.TIED_OUTPUT, Ctx(config, padded))
    training = None
    if options.training_state:
        training = dist_optim.read(store, common, config, placed_blocks, _lazy, padded, it_dir, tensors)
    elif optimizer:
        notes.append("optimizer state present, not read (--training-state reads and converts it)")
    layout = {"format": backend, "padded_vocab": padded,
              "transformer_impl": impl if config.is_moe or config.is_mla else "any",
              "layers": "one key per layer" if per_layer else "stacked",
              "common": "common.pt" if (it_dir / COMMON_FILE).is_file() else COMMON_STATE}
    if common.get("config_from"):  # Megatron-Bridge or NeMo 2: no Megatron-LM args
        layout["config"] = common["config_from"]
    if singleton:
        layout["singleton_local_shards"] = True
    if getattr(store, "manifest", None) is not None:
        layout["integrity"] = f"{len(store.manifest.digests)} files (SHA-256, verified as read)"
    if training is not None:
        layout["optimizer"] = training.optimizer_kind
    return ModelIR(config, tensors, SourceInfo(f"core (Megatron {backend})", it_dir, layout, iteration, notes), assets,
                   training)


def _shape_dtype(store, key: str) -> tuple[tuple[int, ...], str]:
    """A stored tensor's shape and dtype name (read without torch)."""
    entry = store.tensors[key]
    return (tuple(entry.shape), entry.dtype_name) if hasattr(entry, "shape") else entry


def _lazy(store, placed: Placed, it_dir: Path) -> LazyTensor:
    """A block of a stored tensor; a stack whose layer (or expert) axis disagrees with the args is refused."""
    key, index = placed.key, placed.index
    if key not in store.tensors:  # reported together with the others by the caller
        return LazyTensor((0,), torch.float32, lambda: torch.empty(0), f"{it_dir.name}:{key}")
    shape, dtype = _shape_dtype(store, key)
    if tuple(shape[:len(index)]) != placed.stack:
        what = "(layers, experts)" if len(placed.stack) == 2 else "(layers)" if ".experts." not in key else "(experts)"
        raise ConvertError(f"{it_dir}: {key} stacks {list(shape[:len(index)])} {what}, the args say "
                           f"{list(placed.stack)}")
    origin = f"{it_dir.name}:{key}" + (f"{list(index)}" if index else "")
    blocks = (lambda: store.read_blocks(key, index)) if hasattr(store, "read_blocks") else None
    return LazyTensor(tuple(shape[len(index):]), dtype, lambda: store.read(key, index), origin, blocks,
                      elements_of=_elements(store, key, index))


def _elements(store, key: str, index: tuple[int, ...]) -> Elements | None:
    """Where a block's bytes lie in the files, found when first asked: `inspect` counts NaN/Inf there without
    torch."""
    return store.lazy_elements(key, index) if hasattr(store, "lazy_elements") else None


def save_dist(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    c, layout, backend = ir.config, options.layout, options.ckpt_format
    if options.training_state and backend != "torch_dist":
        raise ConvertError(f"--training-state: the core saver writes training state in --ckpt-format torch_dist "
                           f"only so far, not {backend}")
    # The weights do not depend on EP, but an MoE run's optimizer does (its experts' own optimizer at EP > 1)
    if layout.pp > 1 or layout.vpp > 1 or (layout.ep > 1 and not (options.training_state and c.is_moe)):
        raise ConvertError(f"--ckpt-format {backend} checkpoints do not depend on the pipeline or expert layout; "
                           "drop --pp/--vpp/--ep (Megatron reshards them when it loads; with --training-state, "
                           "an MoE model's --ep is the resuming run's)")
    core.check_model(c, options)
    padded, iteration, args = rank_files.core_args(ir, out, options, progress)
    it_dir = out / core.iteration_dir(iteration)
    placed_rows = placements(c, options.transformer_impl)
    check_plan(ir.tensors, [(backend, [placed.row for placed in placed_rows])], where=f"saver core ({backend})")
    it_dir.mkdir(parents=True, exist_ok=True)  # under torchrun every rank prepares the same directory
    planner = RowPlanner(Ctx(c, padded))
    # bytes moved without torch where they allow (zarr's writer takes tensors)
    view = FileViews().view if file_views.enabled() and backend == "torch_dist" else None
    planner.torch_first(((p.row.rule, [ir.tensors[n] for n in p.row.ir]) for p in placed_rows), view,
                        needed=options.training_state)
    items = [item for placed in placed_rows for item in _blocks(ir.tensors, placed, planner, view)]
    # TE >= 2.5: an empty byte tensor without FP8 (torch_dist's bytes items need no torch; zarr pickles a tensor)
    empty = core.te_empty_state() if backend == "torch_dist" else torch.empty(0, dtype=torch.uint8)
    extra_state = [empty] if options.transformer_impl == "te" else [None]
    extra_keys = extra_states(c, options.transformer_impl)
    common = {"args": args, "checkpoint_version": core.CHECKPOINT_VERSION, "iteration": iteration,
              "num_floating_point_operations_so_far": 0, "content_metadata": dict(CONTENT_METADATA)}
    objects: dict[str, Any] = {}
    if options.training_state:
        objects = _training_state(ir, options, iteration, args, common, progress)
        items += dist_optim.items(ir.training, placed_rows, lambda ts, placed: _blocks(ts, placed, planner, view),
                                  dist_optim.output_kind(ir.training, options))

    def finish(results: list) -> None:
        hashed = write_dcp_metadata(results) if backend == "torch_dist" else {}
        torch_save(common, it_dir / COMMON_FILE, background=False)
        bridge_config.write_run_config(it_dir / bridge_config.RUN_CONFIG, args, options.transformer_impl)
        hf_dir.write_json(it_dir / core.METADATA_JSON, metadata_json(backend))
        if backend == "torch_dist" and options.integrity_manifest:  # megatron-core verifies it (--verify-integrity)
            write_manifest(it_dir, known=hashed)  # the .distcp files hashed by the workers that wrote them
        rank_files.finish_checkpoint(ir, out, it_dir, iteration)

    if backend == "torch_dist":
        data = dcp_writer.object_bytes(extra_state)
        objects_data = {k: dcp_writer.object_bytes(v) for k, v in objects.items()}  # RNG of the training state
        if c.is_bert:  # BertModel's output layer (Megatron's ColumnParallelLinear under either spec): None
            objects_data[_extra_state("output_layer", (0,), (1,))] = dcp_writer.object_bytes([None])
        jobs, write_dcp_metadata = dcp_writer.plan(it_dir, items + [dcp_writer.Item(k, len(data), lambda: data)
                                                                    for k in extra_keys]
                                                   + [dcp_writer.Item(k, len(b), lambda b=b: b)
                                                      for k, b in objects_data.items()],
                                                   digests=options.integrity_manifest)
    else:
        jobs = [Job(f"{it_dir.name} ({backend})", ir.nbytes,
                    lambda advance: _write_zarr(it_dir, items, dict.fromkeys(extra_keys, extra_state), advance))]
    workers.run(jobs, workers=options.workers, progress=progress, finish=finish)


def _training_state(ir: ModelIR, options: Options, iteration: int, args, common: dict,
                    progress: Progress) -> dict[str, Any]:
    """The training state's share of the common state (and args); returns the RNG objects to store."""
    kind, rng = dist_optim.prepare(ir, options, iteration, args, progress)
    layout = options.layout
    parallel = dist_optim.experts_parallel(ir.config, layout.tp, layout.ep, layout.expert_tp)
    groups = dist_optim.target_groups(ir.training, ir.tensors, parallel)
    entries, metadata = dist_optim.common_entries(ir.training, kind, groups)
    common.update(entries)
    common["content_metadata"].update(metadata)
    return dist_optim.rng_items(rng, options.layout.tp, options.layout.pp)


def _blocks(tensors_by_name: Mapping[str, LazyTensor], placed: Placed, planner: RowPlanner,
            view: Callable[[LazyTensor], ByteBlocks | None] | None = None) -> list[dcp_writer.Item]:
    """One stored block at its place in the stack; a plain concatenation (SwiGLU's [gate ; up]) goes out as its
    parts at their offsets, as Megatron itself stores them. With `view` (mconvert.io.file_views), bytes that only
    move are viewed in the source files, without torch; shapes are planned by arithmetic where the rule's plan is
    known (`RowPlanner.piece_shapes`)."""
    rule = placed.row.rule
    tensors = [tensors_by_name[n] for n in placed.row.ir]
    whole_shape = tuple(planner.piece_shapes(rule, [t.shape for t in tensors])[0])
    stack = placed.stack
    lead = (1,) * len(stack)
    dtype = tensors[0].dtype_name
    if rule.join.concat_dim is None:
        blocks = [(whole_shape, 0, lambda: planner.forward_any(rule, tensors, view)[0])]
    else:
        starts = [sum(t.shape[rule.join.concat_dim] for t in tensors[:i]) for i in range(len(tensors))]
        blocks = [(t.shape, start, lambda t=t: (view is not None and view(t)) or t.load_blocks())
                  for t, start in zip(tensors, starts)]
    items = []
    for shape, start, produce in blocks:
        offsets = [0] * len(whole_shape)
        if rule.join.concat_dim is not None:
            offsets[rule.join.concat_dim] = start
        nbytes = dtypes.itemsize(dtype) * math.prod(shape)
        items.append(dcp_writer.Item(placed.key, nbytes, lambda p=produce, s=lead + tuple(shape): reshape(p(), s),
                                     stack + whole_shape, placed.index + tuple(offsets), lead + tuple(shape), dtype))
    return items


def _write_zarr(it_dir: Path, items: list[dcp_writer.Item], objects: dict, advance) -> None:
    from mconvert.io.zarr import ZarrWriter  # zarr: slow to import, only when asked for

    writer = ZarrWriter(it_dir)
    for item in items:
        writer.add_chunk(item.fqn, item.global_shape, item.offsets, as_blocks(item.produce()).join())
        advance(item.nbytes)
    for key, obj in objects.items():
        writer.add_object(key, obj)
