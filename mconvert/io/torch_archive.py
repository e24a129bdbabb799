"""torch.save zip archives read without importing torch: the pickled objects, with each tensor as a record of where
its bytes are.

`import torch` costs about a second, and reading a Megatron checkpoint's settings (`args`), its iteration and the
shapes of its tensors needs none of it. An archive is a zip file (stored, not compressed) holding `data.pkl`, the
pickle, and `data/<key>`, one record per storage. The pickle names a storage by a persistent id
`('storage', torch.<Type>Storage, key, location, numel)` and builds each tensor by calling
`torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks, ...)`; here those calls make
`StoredTensor` records (dtype, shape, stride, and the file offset of the storage's bytes) and nothing is read.

The unpickler is allow-listed like `mconvert.io.torch_pickle.safe_load`: plain containers, `argparse.Namespace`,
`types.SimpleNamespace`, `signal.Signals`, paths, torch dtypes (as `TorchDType` names) and the stand-ins for
Megatron's and numpy's classes. Anything else, and anything this reader does not know (an old non-zip archive, a
big-endian one, a compressed record), raises `Unreadable`: the caller then reads the file with torch
(`safe_load`), which refuses what is unsafe with its established messages.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import io
import math
import mmap
import os
import pathlib
import pickle
import signal
import struct
import threading
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mconvert.errors import ConvertError
from mconvert.io.torch_pickle import STAND_INS, StandIn, _ReadWindow, _stand_in, safe_load
from mconvert.ir import dtypes
from mconvert.ir.blocks import Blocks, FileBytes
from mconvert.ir.tensors import Elements, LazyTensor
from mconvert.lazy import loaded, torch

# torch.<Name>Storage in a persistent id -> the dtype of its elements
STORAGE_DTYPES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8",
    "ByteStorage": "uint8", "BoolStorage": "bool", "Float8_e4m3fnStorage": "float8_e4m3fn",
    "Float8_e5m2Storage": "float8_e5m2",
}
# numpy's classes in Megatron's RNG state: kept as inert stand-ins (their values are not needed to read a model)
NUMPY_STAND_INS = tuple(f"{module}.{name}" for module in ("numpy.core.multiarray", "numpy._core.multiarray")
                        for name in ("_reconstruct",)) + ("numpy.ndarray", "numpy.dtype", "numpy.dtypes.UInt32DType",
                                                          "torch.Generator")


class Unreadable(Exception):
    """This reader cannot read the file (or refuses a global): read it with torch instead."""


@dataclass(frozen=True)
class TorchDType:
    """A torch.dtype named in a pickle (`args.params_dtype`), by name; shown as torch shows it."""

    name: str

    def __str__(self) -> str:
        return f"torch.{self.name}"

    __repr__ = __str__


@dataclass(frozen=True, eq=False)
class StoredTensor:
    """A tensor of a torch.save archive, not read: its storage's bytes are `storage_nbytes` at `data_offset` of
    `path`; the tensor views them with `shape`, `stride` and `storage_offset` (in elements)."""

    path: str
    dtype_name: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    data_offset: int
    storage_nbytes: int
    identity: tuple[int, int, int, int]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def is_contiguous(self) -> bool:
        expected = 1
        for size, step in reversed(list(zip(self.shape, self.stride))):
            if size != 1 and step != expected:
                return False
            expected *= size
        return True

    def dense(self) -> StoredTensor | None:
        """A non-contiguous view whose elements are the consecutive elements of its storage in another order (a
        transposed matrix): those elements as a flat contiguous tensor, else None."""
        if self.is_contiguous() or not self.numel:
            return None
        expected = 1
        for step, size in sorted((s, n) for n, s in zip(self.shape, self.stride) if n != 1):
            if step != expected:
                return None
            expected *= size
        return dataclasses.replace(self, shape=(self.numel,), stride=(1,))

    def file_bytes(self) -> FileBytes | None:
        """Where the tensor's elements lie in the file, row-major, when they do (a contiguous view)."""
        if not self.is_contiguous():
            return None
        return FileBytes(self.path, self.data_offset + self.storage_offset * dtypes.itemsize(self.dtype_name),
                         self.identity)

    def load(self, mapping) -> torch.Tensor:
        """The tensor, viewing `mapping` (the file, memory-mapped): nothing copied."""
        dtype = dtypes.to_torch(self.dtype_name)
        if not self.storage_nbytes:
            return torch.empty(self.shape, dtype=dtype)
        flat = torch.frombuffer(mapping, dtype=dtype, count=self.storage_nbytes // dtype.itemsize,
                                offset=self.data_offset)
        return flat.as_strided(self.shape, self.stride, self.storage_offset)


@dataclass(frozen=True)
class _Storage:
    dtype_name: str
    data_offset: int
    nbytes: int


def _rebuild_tensor(path: str, identity) -> Any:
    def rebuild(storage, storage_offset, size, stride, *_rest) -> StoredTensor:
        if not isinstance(storage, _Storage) or not _ints(size) or not _ints(stride) or len(size) != len(stride) \
                or not isinstance(storage_offset, int) or storage_offset < 0:
            raise Unreadable("a tensor with unexpected arguments")
        itemsize = dtypes.itemsize(storage.dtype_name)
        reach = storage_offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1 if all(size) else 0
        if reach * itemsize > storage.nbytes:
            raise Unreadable("a tensor reaching beyond its storage")
        return StoredTensor(path, storage.dtype_name, tuple(size), tuple(stride), storage_offset,
                            storage.data_offset, storage.nbytes, identity)
    return rebuild


def _ints(value) -> bool:
    return isinstance(value, (tuple, list)) and all(isinstance(x, int) and x >= 0 for x in value)


_PLAIN = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("argparse", "Namespace"): argparse.Namespace,
    ("types", "SimpleNamespace"): types.SimpleNamespace,
    ("signal", "Signals"): signal.Signals,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("io", "BytesIO"): io.BytesIO,
    ("torch", "Size"): lambda *args: tuple(*args),
    ("torch._utils", "_rebuild_parameter"): lambda data, *_rest: data,
}
_STAND_INS = dict(_stand_in(name)[::-1] for name in STAND_INS + NUMPY_STAND_INS)


class _Unpickler(pickle._Unpickler):
    """pickle's Python unpickler (whose opcodes can be overridden) with the allow-list; BUILD (setting an object's
    state) only on the plain records that take it, not on shared objects such as enum members."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, data: bytes, records: dict[str, tuple[int, int]], path: str, identity) -> None:
        super().__init__(io.BytesIO(data))
        self.records, self.rebuild = records, _rebuild_tensor(path, identity)

    def load_build(self) -> None:
        if not isinstance(self.stack[-2], (argparse.Namespace, types.SimpleNamespace, StandIn, collections.OrderedDict,
                                           io.BytesIO)):
            raise Unreadable(f"state set on a {type(self.stack[-2]).__name__}")
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build

    def find_class(self, module: str, name: str):
        key = (module, name)
        if key in _PLAIN:
            return _PLAIN[key]
        if key == ("torch._utils", "_rebuild_tensor_v2"):
            return self.rebuild
        if module == "torch" and (name in STORAGE_DTYPES or name in dtypes.ITEMSIZE):
            return name if name in STORAGE_DTYPES else TorchDType(name)
        full = f"{module}.{name}"
        if full in _STAND_INS:
            return _STAND_INS[full]
        raise Unreadable(f"global {full}")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and pid[1] in STORAGE_DTYPES):
            raise Unreadable(f"persistent id {pid!r:.80}")
        dtype, key, numel = STORAGE_DTYPES[pid[1]], pid[2], pid[4]
        if str(key) not in self.records or not isinstance(numel, int):
            raise Unreadable(f"storage {key!r:.40}")
        offset, size = self.records[str(key)]
        nbytes = numel * dtypes.itemsize(dtype)
        if nbytes > size:
            raise Unreadable(f"storage {key} is shorter than its {numel} elements")
        return _Storage(dtype, offset, nbytes)


def read(path: Path | str, offset: int = 0, length: int | None = None) -> Any:
    """The objects a torch.save zip archive holds, tensors as `StoredTensor`s; `Unreadable` when this reader cannot
    read it (see the module's docstring). `offset` and `length`: an archive embedded in a bigger file (a DCP
    bytes entry)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            identity = FileBytes.identity_of(os.fstat(f.fileno()))
            size = identity[2] - offset if length is None else length
            window = _ReadWindow(f, offset, size)
            with zipfile.ZipFile(window) as archive:
                infos = archive.infolist()
                pickles = [i for i in infos if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
                if len(pickles) != 1:
                    raise Unreadable("not one data.pkl")
                if any(i.compress_type != zipfile.ZIP_STORED for i in infos):  # as torch.save writes; and no
                    raise Unreadable("compressed records")  # record read here can be larger than the file
                prefix = pickles[0].filename[:-len("data.pkl")]
                names = {i.filename for i in infos}
                if prefix + "byteorder" in names and archive.read(prefix + "byteorder") != b"little":
                    raise Unreadable("big-endian")
                stored = [i for i in infos if i.filename.startswith(prefix + "data/")]
                records = {i.filename[len(prefix) + 5:]: (offset + _data_offset(window, i), i.file_size)
                           for i in stored}
                if any(at + n > offset + size for at, n in records.values()):
                    raise Unreadable("a record beyond the archive's end")
                data = archive.read(pickles[0])
        return _Unpickler(data, records, os.path.abspath(path), identity).load()
    except Unreadable:
        raise
    except Exception as e:  # not a zip, truncated, a damaged pickle: torch's reader gives the established error
        raise Unreadable(f"{type(e).__name__}: {e}") from None


def read_plain(path: Path | str, offset: int = 0, length: int | None = None) -> Any:
    """`read` for archives of settings (a common state, args): `Unreadable` also when the objects hold a tensor,
    which callers then want as torch's own (read with torch)."""
    value = read(path, offset, length)
    if _holds_tensor(value):
        raise Unreadable("the objects hold tensors")
    return value


def _holds_tensor(value: Any) -> bool:
    """Is there a tensor anywhere in `value` (containers and objects' attributes, each object visited once)?"""
    seen: set[int] = set()
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, StoredTensor):
            return True
        if id(item) in seen:
            continue
        seen.add(id(item))
        inner = getattr(item, "__dict__", None)
        if isinstance(item, dict):
            todo += item.values()
        elif isinstance(item, (list, tuple)):
            todo += item
        elif isinstance(inner, dict):
            todo += inner.values()
    return False


def _data_offset(f, info: zipfile.ZipInfo) -> int:
    """Where a record's bytes start: after its local header, whose name and extra field lengths are its own."""
    f.seek(info.header_offset)
    header = f.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise Unreadable(f"bad local header of {info.filename}")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len


def is_tensor(value: Any) -> bool:
    """A tensor of either reader: a `StoredTensor`, or a torch.Tensor (checked only when torch is imported)."""
    if isinstance(value, StoredTensor):
        return True
    module = loaded("torch")
    return module is not None and isinstance(value, module.Tensor)


def dtype_of(value: Any) -> str | None:
    """The dtype name of a `TorchDType` or a torch.dtype (only when torch is imported), else None."""
    if isinstance(value, TorchDType):
        return value.name
    module = loaded("torch")
    return dtypes.name_of(value) if module is not None and isinstance(value, module.dtype) else None


def load(path: Path | str) -> Any:
    """A torch.save file's objects: read by this module when it can (no torch), else by `safe_load` (torch,
    memory-mapped), which gives real tensors and refuses what is unsafe or damaged with its own messages."""
    try:
        return read(path)
    except Unreadable:
        return safe_load(path)


def lazy_tensor(value: StoredTensor, origin: str, mapped: Mapped, *, blocks: bool = True) -> LazyTensor:
    """A stored tensor as a lazy one: viewed in its file's map when asked for, with the place of its bytes in the
    file when they lie there unchanged (`blocks`: for writers; `file_bytes`: for `inspect`). A transposed view
    (HF's legacy scripts save some so) names its storage's run of elements (`elements_of`), where `inspect` counts
    NaN/Inf without torch."""
    where, flat = value.file_bytes(), value.dense()
    elements = Elements((lazy_tensor(flat, origin, mapped, blocks=False),)) if flat is not None else None
    return LazyTensor(value.shape, value.dtype_name, lambda: mapped.tensor(value), origin,
                      (lambda: Blocks.of(mapped.tensor(value), where)) if blocks else None,
                      file_bytes=where, elements_of=elements)


class Mapped:
    """Archive files memory-mapped once each (shared by threads), and `StoredTensor`s viewed in them."""

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap] = {}
        self._lock = threading.Lock()

    def tensor(self, value: Any) -> torch.Tensor:
        """`value` as a torch.Tensor: a `StoredTensor` viewed in its file's map; a torch.Tensor as it is."""
        if not isinstance(value, StoredTensor):
            return value
        with self._lock:
            mapping = self._maps.get(value.path)
            if mapping is None:
                with open(value.path, "rb") as f:
                    if FileBytes.identity_of(os.fstat(f.fileno())) != value.identity:
                        raise ConvertError(f"{value.path}: the file changed since it was read")
                    mapping = self._maps[value.path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return value.load(mapping)
