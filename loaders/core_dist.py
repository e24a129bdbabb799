"""Megatron-core distributed checkpoints (`torch_dist`, `zarr`), read by the `core` loader.

Layer-stacked tensors are read one layer slice at a time (the storage readers map or fetch only the chunks
covering that layer), so memory stays at about one layer whatever the model size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mconvert.config_checks import MEGATRON_INTEGERS, check_integers, with_where
from mconvert.errors import ConvertError, mismatch
from mconvert.formats import hf_dir
from mconvert.formats.dcp import DcpReader
from mconvert.formats.integrity import Manifest
from mconvert.formats.torch_pickle import safe_load
from mconvert.ir import LazyTensor, LoadCache, ModelConfig, ModelIR, SourceInfo, dtype_name
from mconvert.lazy import torch
from mconvert.mapping import Row, to_ir, verify_copies
from mconvert.options import Options
from mconvert.rules import Ctx
from mconvert.schemas import core, core_dist


def is_dist_checkpoint(it_dir: Path) -> bool:
    return (it_dir / core_dist.METADATA_JSON).is_file()


def open_store(it_dir: Path):
    manifest = Manifest.find(it_dir)
    if manifest is not None:  # metadata.json picks the reader: verified before it is believed
        manifest.check_file(core_dist.METADATA_JSON)
    meta = hf_dir.read_json(it_dir / core_dist.METADATA_JSON)
    backend = meta.get("sharded_backend")
    if backend == "torch_dist":
        return DcpReader(it_dir), backend
    if backend == "zarr":
        from mconvert.formats.zarr_io import ZarrReader  # tensorstore: slow to import, only for zarr

        return ZarrReader(it_dir), backend
    raise ConvertError(f"{it_dir / core_dist.METADATA_JSON}: unknown sharded_backend {backend!r}; this tool reads "
                       f"{' and '.join(core_dist.BACKENDS)} distributed checkpoints")


def read_common(it_dir: Path, store) -> dict[str, Any]:
    """The non-tensor state: `common.pt` (older Megatron) or the in-checkpoint `common_state` object (newer).

    With an integrity manifest, `metadata.json` and `common.pt` are verified before use (the `.distcp` files as
    they are read, see mconvert.formats.integrity).
    """
    manifest = getattr(store, "manifest", None)
    if manifest is not None:
        manifest.check_file(core_dist.METADATA_JSON)
    if (it_dir / core_dist.COMMON_FILE).is_file():
        if manifest is not None:
            manifest.check_file(core_dist.COMMON_FILE)
        common = safe_load(it_dir / core_dist.COMMON_FILE, mmap=False)
    elif core_dist.COMMON_STATE in getattr(store, "bytes_items", {}):
        common = store.read_object(core_dist.COMMON_STATE)
        common = common[0] if isinstance(common, list) and common else common
    else:
        raise ConvertError(f"{it_dir}: neither {core_dist.COMMON_FILE} nor a {core_dist.COMMON_STATE} entry: "
                           "cannot find the checkpoint's args")
    if not isinstance(common, dict) or common.get("args") is None:
        raise ConvertError(f"{it_dir}: the common state has no 'args'; cannot tell the model shape")
    if not hasattr(common["args"], "__dict__"):
        raise ConvertError(f"{it_dir}: 'args' is a {type(common['args']).__name__}, not a namespace of Megatron "
                           "arguments")
    check_integers(vars(common["args"]), MEGATRON_INTEGERS, str(it_dir), "args.")
    return common


def load_dist(it_dir: Path, iteration: int | None, options: Options) -> ModelIR:
    store, backend = open_store(it_dir)
    common = read_common(it_dir, store)
    args = common["args"]
    embed_key = "embedding.word_embeddings.weight"
    if embed_key not in store.tensors:
        raise ConvertError(f"{it_dir}: no {embed_key} in the checkpoint")
    shape, dtype = _shape_dtype(store, embed_key)
    padded = shape[0]
    from mconvert.loaders.megatron_files import tokenizer  # (that module imports this one)

    notes: list[str] = []
    assets = tokenizer(options, it_dir, args, notes)  # --tokenizer, iter_*/tokenizer or args.tokenizer_model
    vocab, vocab_notes = core.true_vocab_size(args, options.true_vocab_size, assets, padded, where=str(it_dir))
    notes += vocab_notes
    config = config_from_args(args, vocab_size=int(vocab), padded_vocab_size=padded, dtype=dtype_name(dtype),
                              where=str(it_dir))

    source: dict[str, list[LazyTensor]] = {}
    rows: list[Row] = []
    impl, per_layer = core_dist.detect_impl(store.tensors), core_dist.detect_per_layer(store.tensors)
    singleton = core_dist.detect_singleton(store.tensors)
    if singleton and config.mtp_layers:
        raise ConvertError(f"{it_dir}: multi-token-prediction modules in a checkpoint saved with "
                           "singleton_local_shards are not read: this tool reads MTP modules from megatron-core's "
                           "default torch_dist layout only")
    placed_blocks = core_dist.placements(config, impl, per_layer=per_layer, singleton=singleton)
    for placed in placed_blocks:
        rows.append(placed.row)
        source[placed.row.key] = [_lazy(store, placed, it_dir)]
    used = {placed.key for placed in placed_blocks}
    missing = sorted(k for k in used if k not in store.tensors)
    tied_copy = "output_layer.weight" if config.tie_embeddings else None
    extra = sorted(k for k in store.tensors if k not in used and k != tied_copy)
    if missing or extra:
        raise ConvertError(f"{it_dir}: the tensors do not match a {config.family} model with these args. "
                           + mismatch(missing, extra))
    tensors = to_ir(source, rows, Ctx(config, padded), where=str(it_dir), cache=LoadCache(4))
    if tied_copy in store.tensors:  # a stored copy of the tied embedding: checked, never silently dropped
        copy = LazyTensor(*_shape_dtype(store, tied_copy), lambda: store.read(tied_copy), f"{it_dir.name}:{tied_copy}")
        verify_copies(tensors, "embed.weight", [[copy]], core.TIED_OUTPUT, Ctx(config, padded))
    layout = {"format": backend, "padded_vocab": padded,
              "transformer_impl": impl if config.is_moe or config.is_mla else "any",
              "layers": "one key per layer" if per_layer else "stacked",
              "common": "common.pt" if (it_dir / core_dist.COMMON_FILE).is_file() else core_dist.COMMON_STATE}
    if singleton:
        layout["singleton_local_shards"] = True
    if getattr(store, "manifest", None) is not None:
        layout["integrity"] = f"{len(store.manifest.digests)} files (SHA-256, verified as read)"
    return ModelIR(config, tensors, SourceInfo(f"core (Megatron {backend})", it_dir, layout, iteration, notes), assets)


def config_from_args(args: Any, *, where: str, **fields) -> ModelConfig:
    """`core.config_from_args`, with a value ModelConfig refuses (NaN epsilon, ...) reported against `where`."""
    return with_where(where, lambda: core.config_from_args(args, where=where, **fields))


def _shape_dtype(store, key: str) -> tuple[tuple[int, ...], torch.dtype]:
    entry = store.tensors[key]
    return (tuple(entry.shape), entry.dtype) if hasattr(entry, "shape") else entry


def _lazy(store, placed: core_dist.Placed, it_dir: Path) -> LazyTensor:
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
    return LazyTensor(tuple(shape[len(index):]), dtype, lambda: store.read(key, index), origin, blocks)
