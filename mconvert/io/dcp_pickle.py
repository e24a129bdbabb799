"""A DCP `.metadata` pickle written without importing torch.distributed.checkpoint (about 0.7 s of CPU, more than
a gigabyte's worth of copying): stand-in classes pickled under the real classes' names, with the state the real
classes give, so the file is byte for byte what `pickle.dump` of torch's own objects writes (checked by the tests
against them). Readers unpickle torch's classes, as ever.

    Metadata(state_dict_metadata={fqn: TensorStorageMetadata | BytesStorageMetadata}, storage_data={
             MetadataIndex: _StorageInfo})                      torch.distributed.checkpoint.metadata / .filesystem

torch's own objects in it (`torch.Size`, the dtypes, `torch.strided`) are named the same way, so writing it imports
no torch at all. The memo follows object identity, so the names' strings are laid out as torch's give them: the
dtypes share one module string ("torch"), `torch.Size` has another (a different str object), and `torch.strided`
is `torch.serialization._get_layout("torch.strided")`, the reduction torch registers for layouts.

The pure-Python pickler is used because only it lets a class be written by name without importing its module; it
writes the same opcodes, memo and frames as the C one.
"""

from __future__ import annotations

import copyreg
import pickle
from typing import Any, BinaryIO

from mconvert.io.torch_archive import TorchDType
from mconvert.io.torch_zip import Global, dtype_global
from mconvert.ir import dtypes

_METADATA = "torch.distributed.checkpoint.metadata"
_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
_SIZE = Global("".join(("tor", "ch")), "Size")  # torch.Size's `__module__`: equal, but not the same object


def dtype(name_or_dtype) -> Global:
    """A torch dtype (given by name, a `TorchDType` or the torch dtype itself) as pickled: `torch.<name>`, one
    object per dtype (`torch_zip.dtype_global`) whose module string is the one str object "torch" that every torch
    dtype's `__module__` is, so a second mention refers back to the first as in torch's own pickle."""
    return dtype_global(name_or_dtype.name if isinstance(name_or_dtype, TorchDType) else dtypes.name_of(name_or_dtype))


class Size(tuple):
    """`torch.Size(shape)` as pickled: `torch.Size` called on the tuple."""

    def __reduce__(self):
        return _SIZE, (tuple(self),)


class _Layout:
    """`torch.strided` as pickled: the reduction torch registers for layouts (copyreg)."""

    def __reduce_ex__(self, protocol: int):
        return _GET_LAYOUT, ("torch.strided",)


_GET_LAYOUT = Global("torch.serialization", "_get_layout")
_STRIDED = _Layout()  # one object, as torch.strided is


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
            self.offset = Size(offset)


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

    def __init__(self, dtype) -> None:  # a dtype name (or a torch dtype)
        self.dtype = dtype

    def _state(self) -> Any:
        return dtype(self.dtype), _STRIDED, False, _CONTIGUOUS, False


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
    dispatch = dict(pickle._Pickler.dispatch)

    def save_named(self, obj: Global) -> None:
        """A name of torch (`Global`), written as the C pickler writes the real object's (protocol 4 and above)."""
        self.save(obj.module)
        self.save(obj.name)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)

    dispatch[Global] = save_named

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
