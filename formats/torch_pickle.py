"""torch.save files: a safe, memory-mapped reader and a streaming writer.

Reading never executes code from the file: `torch.load(weights_only=True)` with an explicit allow-list. Megatron
pickles its args with a few of its own classes inside (enums); those names map to inert stand-ins, so reading
needs no Megatron install. Anything else the pickle asks for is refused with an error naming the global.

Writing streams: `TorchFileWriter.add(tensor)` writes the tensor's bytes into the zip archive at once and
returns a small handle; `finish(obj)` pickles the object tree (with handles in place of tensors) last. Memory
stays at one tensor, whatever the file size, and the result is an ordinary file for `torch.load`.
"""

from __future__ import annotations

import argparse
import collections
import io
import pickle
import re
import signal
import types
from pathlib import Path
from typing import Any

import torch

from mconvert.errors import ConvertError


class MegatronStandIn:
    """An inert stand-in for a Megatron class found in a pickle (its enums): it only keeps its arguments."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    @property
    def value(self) -> Any:
        return self.args[0] if self.args else None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(map(repr, self.args))})"


# Megatron classes known to appear in pickled args (enums), each mapped to an inert stand-in of the same name.
MEGATRON_GLOBALS = (
    "megatron.core.enums.ModelType",
    "megatron.core.enums.Fp8Recipe",
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.transformer.enums.AttnType",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.transformer.enums.InferenceCudaGraphScope",
    "megatron.core.transformer.enums.LayerType",
    "megatron.model.enums.ModelType",
    "megatron.model.enums.AttnMaskType",
    "megatron.model.enums.PositionEmbeddingType",
)


def _stand_in(full_name: str) -> tuple[type, str]:
    return type(full_name.rsplit(".", 1)[1], (MegatronStandIn,), {"__module__": "mconvert.standins"}), full_name


SAFE_GLOBALS: list = [
    argparse.Namespace,
    types.SimpleNamespace,
    signal.Signals,
    collections.OrderedDict,
    *(_stand_in(name) for name in MEGATRON_GLOBALS),
]

_UNSAFE = re.compile(r"GLOBAL ([\w.]+)")


def safe_load(path: Path | str, *, mmap: bool = True) -> Any:
    """Load a torch.save file without executing code; tensors stay memory-mapped when the file allows it."""
    path = Path(path)
    if not path.is_file():
        raise ConvertError(f"{path}: file not found")
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            except RuntimeError as e:
                if mmap and "mmap" in str(e):  # pre-zip (legacy) serialization cannot be mapped
                    return torch.load(path, map_location="cpu", weights_only=True)
                raise
    except pickle.UnpicklingError as e:
        found = _UNSAFE.search(str(e))
        if found:
            raise ConvertError(
                f"{path}: refusing to unpickle: the file asks for the Python global `{found.group(1)}`, which is "
                "not on the allow-list of safe types (tensors, dtypes, argparse.Namespace, Megatron's enums). "
                "A checkpoint can run arbitrary code through such a global; if you trust this file, re-save "
                "it with plain tensors and dicts."
            ) from None
        raise ConvertError(f"{path}: refusing to unpickle: {_first_line(e)}") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise ConvertError(
            f"{path}: not a readable torch checkpoint (truncated or corrupt?): {_first_line(e)}"
        ) from None


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    for line in text.splitlines():
        if "WeightsUnpickler error" in line:
            return line.strip()
    return text.splitlines()[0] if text else type(e).__name__


_STORAGE_TYPES = {dtype: getattr(torch, name) for dtype, name in torch.storage._dtype_to_storage_type_map().items()}


class _StorageRef:
    """A storage already written to the archive; the pickler turns it into a persistent id."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class StoredTensor:
    """A handle to a tensor whose bytes are already in the archive; pickles as that tensor."""

    def __init__(self, storage: _StorageRef, shape: tuple[int, ...]) -> None:
        self.storage, self.shape = storage, tuple(shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    def __reduce_ex__(self, protocol: int):
        stride, acc = [], 1
        for size in reversed(self.shape):
            stride.append(acc)
            acc *= size
        args = (self.storage, 0, torch.Size(self.shape), tuple(reversed(stride)), False, collections.OrderedDict())
        return torch._utils._rebuild_tensor_v2, args


class TorchFileWriter:
    """Write a torch.save-compatible file tensor by tensor (see the module docstring)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._stream = None
        name = str(self.path)
        if name.isascii():
            self._zip = torch._C.PyTorchFileWriter(name, torch.serialization.get_crc32_options(), 64)
        else:  # the C++ writer takes only ascii names; hand it a Python file instead
            self._stream = open(self.path, "wb")  # noqa: SIM115
            self._zip = torch._C.PyTorchFileWriter(self._stream, torch.serialization.get_crc32_options(), 64)
        self._count = 0
        self.bytes_written = 0

    def add(self, tensor: torch.Tensor) -> StoredTensor:
        """Write the tensor's bytes now; return a handle to put in the object passed to `finish`."""
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.nbytes:
            t = t.clone()  # a view into a larger storage: write only its own bytes
        key = str(self._count)
        self._count += 1
        self._zip.write_record(f"data/{key}", t.untyped_storage(), t.nbytes)
        self.bytes_written += t.nbytes
        return StoredTensor(_StorageRef(key, t.dtype, t.numel()), tuple(t.shape))

    def finish(self, obj: Any) -> int:
        """Pickle `obj` (tensors already replaced by `add` handles, or small tensors added now) and close."""
        buf = io.BytesIO()
        writer = self

        class _Pickler(pickle.Pickler):
            def persistent_id(self, o: Any):
                if isinstance(o, _StorageRef):
                    return ("storage", _STORAGE_TYPES[o.dtype], o.key, "cpu", o.numel)
                return None

            def reducer_override(self, o: Any):
                if isinstance(o, torch.Tensor):
                    return writer.add(o).__reduce_ex__(2)
                return NotImplemented

        _Pickler(buf, protocol=2).dump(obj)
        data = buf.getvalue()
        for name, value in (("data.pkl", data), (".format_version", b"1"), (".storage_alignment", b"64"),
                            ("byteorder", b"little")):
            self._zip.write_record(name, value, len(value))
        self._zip.write_end_of_file()
        if self._stream is not None:
            self._stream.close()
        self.bytes_written += len(data)
        return self.bytes_written


def save(obj: Any, path: Path | str) -> int:
    """`torch.save` through the streaming writer (same file, bytes written returned)."""
    return TorchFileWriter(path).finish(obj)
