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
import concurrent.futures
import io
import pickle
import re
import signal
import struct
import types
import zipfile
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
    """Write a torch.save-compatible file tensor by tensor (see the module docstring).

    The archive is written with Python's zipfile (stored, zip64, CRC-32 by zlib, which is much faster than
    torch's own writer) with each record's data aligned to 64 bytes as torch does, so `torch.load(mmap=True)`
    maps tensors in place. Tensor bytes are handed to a background thread, so checksumming and writing
    overlap with preparing the next tensor; at most `max_pending` tensors wait at a time.
    """

    ALIGN = 64

    def __init__(self, path: Path | str, max_pending: int = 2) -> None:
        self.path = Path(path)
        self._prefix = self.path.stem
        self._file = open(self.path, "wb")  # noqa: SIM115
        self._zip = zipfile.ZipFile(self._file, "w", zipfile.ZIP_STORED, allowZip64=True)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self._pending: collections.deque[concurrent.futures.Future] = collections.deque()
        self._max_pending = max_pending
        self._count = 0
        self.bytes_written = 0

    def _record(self, name: str, data) -> None:
        info = zipfile.ZipInfo(f"{self._prefix}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
        # Local header = 30 bytes + name + our padding field (4 + n) + the zip64 field (20): pad the data to ALIGN.
        header = 30 + len(info.filename.encode()) + 4 + 20
        pad = -(self._file.tell() + header) % self.ALIGN
        info.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
        with self._zip.open(info, "w", force_zip64=True) as f:
            assert self._file.tell() % self.ALIGN == 0
            f.write(data)

    def _write_tensor(self, key: str, t: torch.Tensor) -> None:
        data = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""
        self._record(f"data/{key}", data)

    def _wait(self, keep: int) -> None:
        while len(self._pending) > keep:
            self._pending.popleft().result()  # re-raises a failed write here

    def add(self, tensor: torch.Tensor) -> StoredTensor:
        """Queue the tensor's bytes for writing now; return a handle to put in the object passed to `finish`."""
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()  # a contiguous view is written as is: only its own bytes go to the file
        key = str(self._count)
        self._count += 1
        self._wait(self._max_pending - 1)
        self._pending.append(self._pool.submit(self._write_tensor, key, t))
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
        self._wait(0)
        data = buf.getvalue()
        for name, value in (("data.pkl", data), (".format_version", b"1"), (".storage_alignment", b"64"),
                            ("byteorder", b"little"), ("version", b"3\n")):
            self._record(name, value)
        self.close()
        self.bytes_written += len(data)
        return self.bytes_written

    def close(self) -> None:
        """Close the file (also after a failure: pending writes are finished or abandoned)."""
        try:
            self._wait(0)
        finally:
            self._pool.shutdown(wait=True)
            if self._file.closed:
                return
            try:
                self._zip.close()
            finally:
                self._file.close()


def save(obj: Any, path: Path | str) -> int:
    """`torch.save` through the streaming writer (same file, bytes written returned)."""
    return TorchFileWriter(path).finish(obj)
