"""PyTorch distributed checkpoints (torch.distributed.checkpoint, "DCP") read and written offline.

On disk: `.metadata` (a pickled `torch.distributed.checkpoint.metadata.Metadata`: per key its global shape,
dtype and chunks, and where each chunk's bytes are) and `__{rank}_{i}.distcp` files, in which every tensor
chunk is a small torch.save archive and every bytes item raw bytes, at recorded offsets.

Reading needs no process group: `.metadata` is unpickled with an allow-list of DCP's own classes (torch's
reader uses plain pickle, which would run code from an untrusted file), and chunks are memory-mapped, so asking
for one layer of a layer-stacked tensor touches only that layer's bytes. Neither the metadata nor where a block's
bytes lie (`DcpReader.elements`, for `mconvert inspect`) needs torch: shapes are tuples, dtypes names, and the
chunks' archive headers are parsed by `mconvert.io.torch_archive`.

Writing is planned, then done file by file, possibly in parallel: see `mconvert.io.dcp_writer`.
"""

from __future__ import annotations

import collections
import functools
import io
import math
import mmap
import os
import pathlib
import pickle
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mconvert.errors import ConvertError, format_names
from mconvert.io import torch_archive
from mconvert.io.contained import inside
from mconvert.io.integrity import Manifest
from mconvert.io.torch_archive import StoredTensor, TorchDType, Unreadable, dtype_of
from mconvert.io.torch_pickle import locate_tensor, safe_load_bytes
from mconvert.ir import dtypes
from mconvert.ir.blocks import Blocks, FileBytes
from mconvert.ir.tensors import Elements, LazyTensor
from mconvert.lazy import torch

METADATA = ".metadata"

# What a DCP .metadata pickle may name. DCP's own classes become plain records here: reading needs only their
# attributes, and torch.distributed.checkpoint (half a second to import, and whose module paths move between
# releases) is not imported to read a checkpoint.
_DCP_CLASSES = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *(("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")),
    *(("torch.distributed.checkpoint.planner", n) for n in ("SavePlan", "WriteItem", "WriteItemType",
                                                             "TensorWriteData")),
}
_PLAIN = {
    ("torch", "Size"): lambda *args: tuple(*args),  # a tuple: reading the metadata imports no torch
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("pathlib", "PosixPath"): pathlib.PosixPath,  # StorageMeta.checkpoint_id, as torch's own dcp.save records it
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("torch.serialization", "_get_layout"): lambda name: name,  # TensorProperties.layout: not needed to read
}
_DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
           "float8_e4m3fn", "float8_e5m2")


class Record:
    """A DCP metadata object read back as its attributes only (a dataclass or an enum member in the pickle)."""

    def __init__(self, *args) -> None:  # enums pickle as Class(value)
        self.args = args

    def __setstate__(self, state) -> None:
        if isinstance(state, tuple) and len(state) == 2 and all(x is None or isinstance(x, dict) for x in state):
            state = {**(state[0] or {}), **(state[1] or {})}  # (dict, slots)
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state  # a class's own __getstate__ tuple (see TensorProperties)


class _TensorProperties(Record):
    """torch pickles TensorProperties as the tuple (dtype, layout, requires_grad, memory format, pin_memory).
    The dtype is read as its name (`dtype_name`); `dtype` gives the torch.dtype."""

    @property
    def dtype_name(self) -> str | None:
        return dtype_of(self.__dict__["dtype"] if "dtype" in self.__dict__ else self.state[0])

    @property
    def dtype(self) -> torch.dtype:
        return dtypes.to_torch(self.dtype_name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


_RECORDS = {key: type(key[1], (_TensorProperties if key[1] == "TensorProperties" else Record,),
                      {"__module__": "mconvert.io.dcp.records"}) for key in _DCP_CLASSES}
# megatron-core's subclasses in `.metadata` files of its torch_dist checkpoints (Oct-Nov 2025: MCoreMetadata, a
# Metadata with an `mcore_data` field; MCoreSavePlan, a SavePlan): read as the records of their base classes.
_MCORE = "megatron.core.dist_checkpointing.strategies.torch"
_RECORDS |= {(_MCORE, "MCoreMetadata"): _RECORDS[("torch.distributed.checkpoint.metadata", "Metadata")],
             (_MCORE, "MCoreSavePlan"): _RECORDS[("torch.distributed.checkpoint.planner", "SavePlan")]}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f, where: Path) -> None:
        super().__init__(f)
        self.where = where

    def find_class(self, module: str, name: str):
        key = (module, name)
        if key in _RECORDS:
            return _RECORDS[key]
        if key in _PLAIN:
            return _PLAIN[key]
        if module == "torch" and name in _DTYPES:
            return TorchDType(name)
        raise ConvertError(f"{self.where}: refusing to unpickle: it asks for the Python global `{module}.{name}`, "
                           "which is not one of torch.distributed.checkpoint's metadata classes")


def read_metadata(root: Path, manifest: Manifest | None = None) -> Record:
    """The `.metadata` of a DCP directory, read through the allow-list (as plain records); verified against the
    directory's integrity manifest, when given, before it is unpickled."""
    path = root / METADATA
    if not path.is_file():
        raise ConvertError(f"{root}: no {METADATA} file: not a torch.distributed.checkpoint directory, or an "
                           "incomplete copy (the file name starts with a dot: keep it when copying)")
    data = path.read_bytes()
    if manifest is not None:
        manifest.check_bytes(METADATA, data)
    try:
        md = _MetadataUnpickler(io.BytesIO(data), path).load()
    except ConvertError:
        raise
    except Exception as e:  # whatever a damaged pickle makes the unpickler trip over
        raise ConvertError(f"{path}: corrupt distributed-checkpoint metadata: {type(e).__name__}: {e}") from None
    if type(md).__name__ != "Metadata" or not hasattr(md, "state_dict_metadata"):
        raise ConvertError(f"{path}: holds a {type(md).__name__}, not DCP Metadata")
    try:
        check_records(md, path)
    except (AttributeError, TypeError, IndexError, KeyError, ValueError) as e:
        raise ConvertError(f"{path}: corrupt distributed-checkpoint metadata: {type(e).__name__}: {e}") from None
    return md


def check_records(md, path: Path) -> None:
    """The fields readers use have the types DCP writes (a crafted file could put anything there), and each
    tensor's chunks tile it. `md`: a `Record` or DCP's own `Metadata` (mtrain's resume reads with the real classes)."""
    def ints(value) -> bool:
        return isinstance(value, (tuple, list)) and all(isinstance(x, int) and x >= 0 for x in value)

    state, storage = getattr(md, "state_dict_metadata", None), getattr(md, "storage_data", None)
    if not isinstance(state, dict) or not isinstance(storage, dict):
        raise ConvertError(f"{path}: corrupt distributed-checkpoint metadata: no state_dict_metadata or storage_data "
                           "mapping")
    for key, info in storage.items():
        fields = (getattr(info, "relative_path", None), getattr(info, "offset", None), getattr(info, "length", None))
        if not (isinstance(getattr(key, "fqn", None), str) and isinstance(fields[0], str)
                and all(isinstance(x, int) and x >= 0 for x in fields[1:])):
            raise ConvertError(f"{path}: corrupt storage record for {getattr(key, 'fqn', key)!r}: {fields}")
    for fqn, meta in state.items():
        if type(meta).__name__ != "TensorStorageMetadata":
            continue
        chunks = getattr(meta, "chunks", None)
        properties = getattr(meta, "properties", None)
        dtype = getattr(properties, "dtype_name", None) if isinstance(properties, Record) else \
            dtype_of(getattr(properties, "dtype", None))  # DCP's own TensorProperties (mtrain's resume)
        if not (ints(getattr(meta, "size", None)) and dtype in _DTYPES and isinstance(chunks, list)
                and all(ints(getattr(c, "offsets", None)) and ints(getattr(c, "sizes", None)) for c in chunks)):
            raise ConvertError(f"{path}: corrupt tensor record for {fqn!r}")
        check_tiling(path, fqn, tuple(meta.size), [(tuple(c.offsets), tuple(c.sizes)) for c in chunks])


def check_tiling(path: Path, fqn: str, shape: tuple[int, ...],
                 chunks: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
    """The chunks (offsets, sizes) of tensor `fqn` lie inside its `shape`, overlap nowhere, and together hold
    every element: they tile it. Element counts alone are not enough: two chunks overlapping by as many rows as
    they leave uncovered add up right, and the uncovered rows would be read from uninitialized memory."""
    total = 1
    for n in shape:
        total *= n
    held = 0
    for offsets, sizes in chunks:
        if len(offsets) != len(shape) or len(sizes) != len(shape) or \
                any(o + s > n for o, s, n in zip(offsets, sizes, shape)):
            raise ConvertError(f"{path}: a chunk of {fqn} (offsets {list(offsets)}, sizes {list(sizes)}) does not "
                               f"fit in its shape {list(shape)}")
        count = 1
        for s in sizes:
            count *= s
        held += count
    # Overlaps: a sweep along the dimension where the offsets differ most (where the tensor was split).
    dim = max(range(len(shape)), key=lambda d: len({o[d] for o, _ in chunks}), default=None)
    if dim is not None:
        boxes = sorted((c for c in chunks if all(c[1])), key=lambda c: c[0][dim])
        for i, (a_off, a_size) in enumerate(boxes):
            for b_off, b_size in boxes[i + 1:]:
                if b_off[dim] >= a_off[dim] + a_size[dim]:
                    break
                if all(bo < ao + asz and ao < bo + bsz for ao, asz, bo, bsz in zip(a_off, a_size, b_off, b_size)):
                    raise ConvertError(f"{path}: the chunks of {fqn} overlap (offsets {list(a_off)} sizes "
                                       f"{list(a_size)}, and offsets {list(b_off)} sizes {list(b_size)}): some "
                                       "elements are stored twice; refusing a tensor that is not whole")
    if held != total:
        raise ConvertError(f"{path}: the chunks of {fqn} hold {held} of its {total} elements (shape {list(shape)}): "
                           "the checkpoint is incomplete")


@dataclass(frozen=True)
class StoredChunk:
    """One stored piece of a tensor: where it sits in the whole tensor (offsets, sizes) and which bytes hold it
    (file relative to the checkpoint, start, length). Not a pipeline chunk (mconvert.rules.layout.Chunk)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    start: int
    length: int


@dataclass(frozen=True)
class TensorEntry:
    shape: tuple[int, ...]
    dtype_name: str
    chunks: tuple[StoredChunk, ...]

    @property
    def dtype(self) -> torch.dtype:
        return dtypes.to_torch(self.dtype_name)


class DcpReader:
    """Random access to the tensors and bytes items of a DCP directory, without a process group."""

    def __init__(self, root: Path, *, verify: bool = True) -> None:
        self.root = Path(root)
        # integrity.json: each file is verified when first mapped (unless the caller reads without checking)
        self.manifest = Manifest.find(self.root) if verify else None
        md = read_metadata(self.root, self.manifest)
        where = {}  # (fqn, chunk offsets) -> storage; a dataclass default (offset None) is not in the pickle
        for k, v in md.storage_data.items():
            offset = getattr(k, "offset", None)
            where[(k.fqn, tuple(offset) if offset is not None else None)] = v
        self.tensors: dict[str, TensorEntry] = {}
        self.bytes_items: dict[str, Record] = {}
        for fqn, meta in md.state_dict_metadata.items():
            kind = type(meta).__name__
            if kind == "BytesStorageMetadata":
                self.bytes_items[fqn] = self._storage(where, fqn, None)
            elif kind == "TensorStorageMetadata":
                chunks = []
                for c in meta.chunks:
                    info = self._storage(where, fqn, tuple(c.offsets))
                    chunks.append(StoredChunk(tuple(c.offsets), tuple(c.sizes), info.relative_path, info.offset,
                                        info.length))
                self.tensors[fqn] = TensorEntry(tuple(meta.size), meta.properties.dtype_name, tuple(chunks))
        self._check_files()
        if self.manifest is not None:
            self.manifest.check_complete()
        self._maps: dict[str, mmap.mmap] = {}
        self._identities: dict[str, tuple[int, int, int, int]] = {}
        self._decoded: dict[tuple[str, int], tuple[torch.Tensor, FileBytes | None]] = {}
        self._headers: dict[tuple[str, int], StoredTensor | None] = {}
        self._lock = threading.Lock()

    def _storage(self, where: dict, fqn: str, offsets) -> Record:
        info = where.get((fqn, offsets))
        if info is None:
            raise ConvertError(f"{self.root / METADATA}: no storage recorded for {fqn} at {offsets}")
        if getattr(info, "transform_descriptors", None):
            raise ConvertError(f"{self.root}: {fqn} is stored with transforms {info.transform_descriptors} "
                               "(compression?), which this reader does not support")
        return info

    def _check_files(self) -> None:
        need: dict[str, int] = {}
        for entry in self.tensors.values():
            for c in entry.chunks:
                need[c.file] = max(need.get(c.file, 0), c.start + c.length)
        for info in self.bytes_items.values():
            need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
        for f in need:  # names written in .metadata: they must stay inside the checkpoint
            if not isinstance(f, str):
                raise ConvertError(f"{self.root / METADATA}: a relative_path is {f!r}, not a file name")
            inside(self.root, f, f"{METADATA} relative_path")
        missing = [f for f in need if not (self.root / f).is_file()]
        if missing:
            raise ConvertError(f"{self.root}: missing checkpoint file(s) {format_names(sorted(missing))} listed in "
                               f"{METADATA}")
        for f, size in need.items():
            have = (self.root / f).stat().st_size
            if have < size:
                raise ConvertError(f"{self.root / f}: truncated: {METADATA} places data up to byte {size}, the file "
                                   f"has {have} bytes")

    def values_bound(self, fqns: Iterable[str]) -> int:
        """At most how many values the tensors `fqns` hold: their shapes' element count, and no more than the bytes
        of the files their chunks lie in (a value takes a byte at least; a crafted .metadata can claim any shape,
        the bytes must still be on disk). What mconvert.ir.sizes compares a config with."""
        entries = [self.tensors[f] for f in fqns]
        files = {c.file for e in entries for c in e.chunks}
        return min(sum(math.prod(e.shape) for e in entries), sum((self.root / f).stat().st_size for f in files))

    def _map(self, file: str) -> mmap.mmap:
        with self._lock:
            if file not in self._maps:
                with open(self.root / file, "rb") as f:
                    self._maps[file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                    self._identities[file] = FileBytes.identity_of(os.fstat(f.fileno()))
            mapping = self._maps[file]
        if self.manifest is not None:  # hashed in one pass through the map its bytes are then read from
            self.manifest.check_file(file, mapping)
        return mapping

    def _chunk(self, c: StoredChunk) -> torch.Tensor:
        return self._sourced_chunk(c)[0]

    def _sourced_chunk(self, c: StoredChunk) -> tuple[torch.Tensor, FileBytes | None]:
        """The chunk (a view of the file's map: decoded once, its archive header costs ~0.3 ms to parse, and a
        layer-stacked chunk is asked for once per layer) and, when contiguous, where its bytes are in its file."""
        key = (c.file, c.start)
        found = self._decoded.get(key)
        if found is None:
            t, at = locate_tensor(self.root / c.file, c.start, c.length, self._map(c.file))
            source = None
            if t.numel() and t.is_contiguous():
                source = FileBytes(os.path.abspath(self.root / c.file), at, self._identities[c.file], t._version)
            found = self._decoded.setdefault(key, (t, source))
        return found

    def _select(self, fqn: str, index: int | tuple[int, ...]):
        """(entry, index, bounds [lo, hi) of the block asked for, the chunks overlapping it)."""
        entry = self.tensors.get(fqn)
        if entry is None:
            raise ConvertError(f"{self.root}: no tensor {fqn!r} in the checkpoint")
        index = (index,) if isinstance(index, int) else tuple(index)
        k = len(index)
        lo = index + (0,) * (len(entry.shape) - k)
        hi = tuple(i + 1 for i in index) + entry.shape[k:]
        pieces = [c for c in entry.chunks
                  if all(o < h and o + s > a for o, s, a, h in zip(c.offsets, c.sizes, lo, hi))]
        return entry, index, lo, hi, pieces

    def read_blocks(self, fqn: str, index: int | tuple[int, ...] = ()) -> Blocks:
        """`read` as Blocks: when the chunks tile the block along its first dimension (Megatron stores SwiGLU's
        fc1 as its gate and up halves), the mapped chunks themselves, without joining them."""
        entry, index, lo, hi, pieces = self._select(fqn, index)
        k = len(index)
        pieces = sorted(pieces, key=lambda c: c.offsets[k] if k < len(c.offsets) else 0)
        rows, parts, sources = lo[k] if k < len(lo) else 0, [], []
        for c in pieces:
            whole = all(o <= a and o + s >= b for o, s, a, b in zip(c.offsets[:k], c.sizes[:k], lo, hi)) and \
                all(o == a and s == b - a for o, s, a, b in zip(c.offsets[k + 1:], c.sizes[k + 1:], lo[k + 1:],
                                                                  hi[k + 1:]))
            if k >= len(entry.shape) or not whole or c.offsets[k] != rows:
                return Blocks.of(self.read(fqn, index))
            chunk, source = self._sourced_chunk(c)
            part = chunk[tuple(i - o for i, o in zip(index, c.offsets))]
            parts.append(part)
            sources.append(source.within(chunk, part) if source is not None else None)
            rows += c.sizes[k]
        if k >= len(entry.shape) or rows != hi[k]:
            return Blocks.of(self.read(fqn, index))
        return Blocks(tuple(entry.shape[k:]), entry.dtype, tuple(parts), tuple(sources))

    def read(self, fqn: str, index: int | tuple[int, ...] = ()) -> torch.Tensor:
        """The whole tensor, or its block at leading `index` (one layer of a stack, or one layer's expert)."""
        entry, index, lo, hi, pieces = self._select(fqn, index)
        k = len(index)
        if len(pieces) == 1 and _covers(pieces[0], lo, hi, k):  # a window on one mapped chunk: no copy
            c = pieces[0]
            return self._chunk(c)[tuple(i - o for i, o in zip(index, c.offsets))]
        out = torch.empty(entry.shape[k:], dtype=entry.dtype)
        view = out.reshape((1,) * k + tuple(out.shape))
        covered = 0
        for c in pieces:
            src = self._chunk(c)
            a = [max(o, x) for o, x in zip(c.offsets, lo)]
            b = [min(o + s, h) for o, s, h in zip(c.offsets, c.sizes, hi)]
            view[tuple(slice(x - l, y - l) for x, y, l in zip(a, b, lo))] = \
                src[tuple(slice(x - o, y - o) for x, y, o in zip(a, b, c.offsets))]
            n = 1
            for x, y in zip(a, b):
                n *= y - x
            covered += n
        if covered != out.numel():
            raise ConvertError(f"{self.root}: the chunks of {fqn} cover {covered} of the {out.numel()} elements "
                               f"asked for (index {index}): the checkpoint is incomplete")
        return out

    def elements(self, fqn: str, index: tuple[int, ...] = ()) -> Elements | None:
        """The stored chunks' parts that make up the block at leading `index` (see `read`), each with the place of
        its bytes in its file, found from the chunks' archive headers without torch; None where a chunk is not
        read this way (the block is then read by `read`). Their files are verified against the integrity
        manifest first, as `read` verifies each file it maps."""
        entry, index, lo, hi, pieces = self._select(fqn, index)
        for file in sorted({c.file for c in pieces}) if self.manifest is not None else ():
            self.manifest.check_file(file)
        k, parts = len(index), []
        pieces = sorted(pieces, key=lambda c: c.offsets[k:])
        for c in pieces:
            stored = self._header(c)
            if stored is None or stored.dtype_name != entry.dtype_name or stored.shape != c.sizes or \
                    not stored.is_contiguous() or any(not o <= i < o + s for i, o, s in zip(index, c.offsets, c.sizes)):
                return None
            at = stored.storage_offset + sum((i - o) * step for i, o, step in zip(index, c.offsets, stored.stride))
            where = FileBytes(stored.path, stored.data_offset + at * dtypes.itemsize(entry.dtype_name),
                              stored.identity)
            view = tuple(i - o for i, o in zip(index, c.offsets))
            parts.append(LazyTensor(c.sizes[k:], entry.dtype_name, lambda c=c, view=view: self._chunk(c)[view],
                                    f"{c.file}:{fqn}", file_bytes=where))
        # cut along the block's first dimension only: the parts' bytes, one after another, are the block's
        in_order = k < len(entry.shape) and all(c.offsets[k + 1:] == (0,) * len(c.offsets[k + 1:]) and
                                                c.sizes[k + 1:] == entry.shape[k + 1:] for c in pieces)
        return Elements(tuple(parts), in_order=in_order or len(parts) == 1)

    def lazy_elements(self, fqn: str, index: tuple[int, ...] = ()) -> Elements:
        """`elements`, found when first asked (`Elements.find`): building a model's lazy tensors parses no header."""
        return Elements(find=functools.cache(lambda: self.elements(fqn, index)))

    def _header(self, c: StoredChunk) -> StoredTensor | None:
        """Chunk `c`'s tensor as its archive header describes it (read once, without torch), or None when that
        reader does not read it."""
        key = (c.file, c.start)
        if key not in self._headers:
            try:
                found = torch_archive.read(self.root / c.file, c.start, c.length)
            except Unreadable:
                found = None
            self._headers[key] = found if isinstance(found, StoredTensor) else None
        return self._headers[key]
    def read_range(self, fqn: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of a 1-d tensor (one parameter's window on a flat optimizer buffer): a view of
        the mapped chunk holding them all, else copied from the chunks overlapping them."""
        entry = self.tensors.get(fqn)
        if entry is None or len(entry.shape) != 1 or not 0 <= start <= stop <= entry.shape[0]:
            raise ConvertError(f"{self.root}: no 1-d tensor {fqn!r} holding elements [{start}, {stop})")
        pieces = [c for c in entry.chunks if c.offsets[0] < stop and c.offsets[0] + c.sizes[0] > start]
        if len(pieces) == 1 and pieces[0].offsets[0] <= start and stop <= pieces[0].offsets[0] + pieces[0].sizes[0]:
            o = pieces[0].offsets[0]
            return self._chunk(pieces[0])[start - o:stop - o]
        out, covered = torch.empty(stop - start, dtype=entry.dtype), 0
        for c in pieces:
            a, b = max(c.offsets[0], start), min(c.offsets[0] + c.sizes[0], stop)
            out[a - start:b - start] = self._chunk(c)[a - c.offsets[0]:b - c.offsets[0]]
            covered += b - a
        if covered != stop - start:
            raise ConvertError(f"{self.root}: the chunks of {fqn} cover {covered} of the {stop - start} elements "
                               f"[{start}, {stop}) asked for: the checkpoint is incomplete")
        return out

    def read_bytes(self, fqn: str) -> bytes:
        info = self.bytes_items.get(fqn)
        if info is None:
            raise ConvertError(f"{self.root}: no bytes item {fqn!r} in the checkpoint")
        return bytes(self._map(info.relative_path)[info.offset:info.offset + info.length])

    def read_object(self, fqn: str):
        """A bytes item holding a torch.save'd object, unpickled safely: without torch when it holds no tensor
        (`torch_archive.read_plain`), else by torch."""
        data = self.read_bytes(fqn)  # verified against the manifest, if any
        info = self.bytes_items[fqn]
        try:
            return torch_archive.read_plain(self.root / info.relative_path, info.offset, info.length)
        except Unreadable:
            return safe_load_bytes(data, f"{self.root}:{fqn}")


def _covers(c: StoredChunk, lo: Sequence[int], hi: Sequence[int], k: int) -> bool:
    """Does chunk `c` hold all of [lo, hi), with the trailing (non-index) dimensions whole?"""
    return all(o <= a and o + s >= b for o, s, a, b in zip(c.offsets, c.sizes, lo, hi)) and \
        all(o == a and s == b - a for o, s, a, b in zip(c.offsets[k:], c.sizes[k:], lo[k:], hi[k:]))
