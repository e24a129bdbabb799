"""A DCP `.metadata` pickle written without importing torch.distributed.checkpoint (about 0.7 s of CPU, more than
a gigabyte's worth of copying): stand-in classes pickled under the real classes' names, with the state the real
classes give, so the file is byte for byte what `pickle.dump` of torch's own objects writes (checked by the tests
against them). Readers unpickle torch's classes, as ever.

    Metadata(state_dict_metadata={fqn: TensorStorageMetadata | BytesStorageMetadata}, storage_data={
             MetadataIndex: _StorageInfo})                      torch.distributed.checkpoint.metadata / .filesystem

The pure-Python pickler is used because only it lets a class be written by name without importing its module; it
writes the same opcodes, memo and frames as the C one.
"""

from __future__ import annotations

import copyreg
import pickle
from typing import Any, BinaryIO

from mconvert.lazy import torch

_METADATA = "torch.distributed.checkpoint.metadata"
_FILESYSTEM = "torch.distributed.checkpoint.filesystem"


class _StandIn:
    """An object pickled as an instance of `_class` (module, qualified name) with state `_state()`."""

    _class: tuple[str, str]

    def _state(self) -> Any:
        return self.__dict__ or None

    def __reduce_ex__(self, protocol: int):
        return copyreg.__newobj__, (type(self),), self._state()


class Metadata(_StandIn):
    _class = (_METADATA, "Metadata")

    def __init__(self, state_dict_metadata: dict, storage_data: dict) -> None:
        self.state_dict_metadata = state_dict_metadata
        self.planner_data = None
        self.storage_data = storage_data
        self.storage_meta = None
        self.version = None


class MetadataIndex(_StandIn):
    _class = (_METADATA, "MetadataIndex")

    def __init__(self, fqn: str, offset=None) -> None:  # the order torch's __init__ sets them in
        self.fqn = fqn
        self.index = None
        if offset is not None:
            self.offset = torch.Size(offset)


class StorageInfo(_StandIn):
    _class = (_FILESYSTEM, "_StorageInfo")

    def __init__(self, relative_path: str, offset: int, length: int) -> None:
        self.relative_path, self.offset, self.length = relative_path, offset, length


class BytesStorageMetadata(_StandIn):
    _class = (_METADATA, "BytesStorageMetadata")


class ChunkStorageMetadata(_StandIn):
    _class = (_METADATA, "ChunkStorageMetadata")

    def __init__(self, offsets, sizes) -> None:
        self.offsets, self.sizes = offsets, sizes


class TensorProperties(_StandIn):
    """Pickled as torch's `__getstate__` gives it: (dtype, layout, requires_grad, memory format code, pinned)."""

    _class = (_METADATA, "TensorProperties")

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def _state(self) -> Any:
        return self.dtype, torch.strided, False, _CONTIGUOUS, False


class TensorStorageMetadata(_StandIn):
    _class = (_METADATA, "TensorStorageMetadata")

    def __init__(self, properties: TensorProperties, size, chunks: list) -> None:
        self.properties, self.size, self.chunks = properties, size, chunks


class _MemFormat:
    """torch's `_MEM_FORMAT_ENCODING` member `value` (an Enum: pickled as the class called on its value)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __reduce_ex__(self, protocol: int):
        return _MemFormatClass, (self.value,)


class _MemFormatClass:  # only ever pickled by name
    _class = (_METADATA, "_MEM_FORMAT_ENCODING")


_CONTIGUOUS = _MemFormat(0)  # one object, as the enum member is: pickled once, then by reference


class _Pickler(pickle._Pickler):
    def save_global(self, obj, name=None):
        where = getattr(obj, "_class", None) if isinstance(obj, type) else None
        if where is None or not issubclass(obj, (_StandIn, _MemFormatClass)):
            return super().save_global(obj, name)
        module, qualname = where
        if self.proto < 4:
            raise pickle.PicklingError("stand-in classes are written for protocol 4 and above")
        self.save(module)
        self.save(qualname)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)
        return None


def dump(obj: Metadata, f: BinaryIO) -> None:
    """`pickle.dump(obj, f)` as torch's own classes would be pickled (the default protocol)."""
    _Pickler(f, pickle.DEFAULT_PROTOCOL).dump(obj)
