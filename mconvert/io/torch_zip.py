"""The torch.save zip format: a streaming writer (reading is torch's own `torch.load`, see `mconvert.io.torch_pickle`).

A torch.save file is a stored (uncompressed) zip archive `<name>/data.pkl`, `<name>/data/<key>` (raw storage
bytes, 64-byte aligned), `.format_version`, `.storage_alignment`, `byteorder`, `version`.

Each tensor record's data is 64-byte aligned (`.storage_alignment` says 64) and, among those offsets, placed
page-congruent with the source bytes it is copied from where their offset allows (a multiple of 64 modulo 4096:
torch.save files, our own outputs), so the kernel copies page for page (`mconvert.io.page_offsets`); that costs
up to 4032 bytes of padding per such record, in the local header's extra field only (torch's writer also keeps
its padding out of the central directory). A reader finds the data from the local header, as zip readers do;
torch computes offsets from minimal padding only for archives claiming a `.format_version` (see below), which
ours do not.

Writing streams: `TorchFileWriter.add(tensor)` queues the tensor's bytes for the archive at once and returns a
small handle; `finish(obj)` pickles the object tree (with handles in place of tensors) last. Memory stays at a
couple of tensors, whatever the file size. The archive is written with Python's zipfile (CRC-32 by zlib, much
faster than torch's own writer) and can start anywhere in an open file: distributed-checkpoint files embed one
such archive per tensor chunk.

Nothing here imports torch: `add` takes torch tensors, `Blocks` or `ByteBlocks` (numpy views of a source file's
bytes), and the pickle names torch's classes and dtypes (`_rebuild_tensor_v2`, `torch.BFloat16Storage`,
`torch.Size`, `torch.bfloat16`, a `TorchDType`) through `Global`, written by the pure-Python pickler, which gives
the opcodes and memo the C pickler gives for torch's own objects (tests/test_byte_path.py compares them).

Records are laid out by Python's zipfile, not by torch's writer (miniz), so the archive does not claim torch's
`.format_version`: with it, torch would compute storage offsets from miniz's layout (its
`calculate_storage_offsets` option and meta-device loads) instead of reading each record's header.

Why not torch.save itself with `torch.serialization.skip_data()` (records laid out, bytes filled in later)? It
writes each data record's CRC-32 as 0 (checked with torch 2.13: `zipfile.testzip` names `data/0`), so filling in
the bytes afterwards would also mean patching every local header and the central directory: more code than
writing the records here, where the CRC is computed as the bytes go out.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import io
import pickle
import struct
import zipfile
from pathlib import Path
from typing import Any, BinaryIO

from mconvert.io import page_offsets
from mconvert.io.block_writer import Sender
from mconvert.io.integrity import WriteDigest
from mconvert.io.torch_archive import TorchDType
from mconvert.io.writeback import Writeback
from mconvert.ir import dtypes
from mconvert.ir.blocks import Blocks, ByteBlocks, as_blocks
from mconvert.lazy import loaded, torch

try:  # ISA-L's CRC-32 (the very same checksum) runs about 6x faster than zlib's; zipfile calls it for every byte
    from isal.isal_zlib import crc32 as _fast_crc32

    zipfile.crc32 = _fast_crc32
except ImportError:  # pragma: no cover - the `isal` wheel is a dependency; zlib's is only slower
    pass

ALIGN = 64
# zipfile's record writer counts the bytes and CRC it is given in these two attributes (CPython 3.6 to 3.13); the
# tensor bytes are sent past it, so they are set directly. Without them, tensors go through write() (slower).
_COUNTS_BYTES = all(a in zipfile._ZipWriteFile.__init__.__code__.co_names for a in ("_file_size", "_crc"))


class Global:
    """A module-level name of torch (`torch._utils._rebuild_tensor_v2`, `torch.BFloat16Storage`, `torch.bfloat16`)
    pickled by name without importing torch: `GLOBAL module name`, what pickling the real object writes. One
    object per name (`named`), so that a name pickled twice is memoized as the real object is."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"

    def __call__(self, *args, **kwargs):  # the pickler asks a reduction's function to be callable; never called
        raise TypeError(f"{self} is only a name to pickle")


    def __eq__(self, other: object) -> bool:
        return isinstance(other, Global) and (other.module, other.name) == (self.module, self.name)

    def __hash__(self) -> int:
        return hash((self.module, self.name))


_NAMED: dict[tuple[str, str], Global] = {}


def named(module: str, name: str) -> Global:
    """The one `Global` of a name: every thread gets the same object (dict.setdefault is atomic), so a pickle's
    memo never meets two objects for one name (which would write the name twice, not what torch writes)."""
    found = _NAMED.get((module, name))
    return found if found is not None else _NAMED.setdefault((module, name), Global(module, name))


def dtype_global(dtype_name: str) -> Global:
    """A torch dtype by name, pickled as `torch.<name>` (a `TorchDType`, Megatron's `args.params_dtype`, is too)."""
    return named("torch", dtype_name)


# dtype name -> the legacy storage class torch.save pickles: torch.storage._dtype_to_storage_type_map() for the
# dtypes weights come in (tests/test_byte_path.py compares them); torch's own map answers for any other
STORAGE_TYPES = {"float64": "DoubleStorage", "float32": "FloatStorage", "float16": "HalfStorage",
                 "bfloat16": "BFloat16Storage", "int64": "LongStorage", "int32": "IntStorage", "int16": "ShortStorage",
                 "int8": "CharStorage", "uint8": "ByteStorage", "bool": "BoolStorage"}


def storage_type(dtype_name: str) -> str:
    if dtype_name in STORAGE_TYPES:
        return STORAGE_TYPES[dtype_name]
    return torch.storage._dtype_to_storage_type_map()[dtypes.to_torch(dtype_name)]


class _StorageRef:
    """A storage already written to the archive; the pickler turns it into a persistent id."""

    def __init__(self, key: str, dtype_name: str, numel: int) -> None:
        self.key, self.dtype_name, self.numel = key, dtype_name, numel


class _Size(tuple):
    """`torch.Size(shape)` as pickled: `torch.Size` called on the tuple."""

    def __reduce__(self):
        return named("torch", "Size"), (tuple(self),)


class StoredTensor:
    """A handle to a tensor whose bytes are (being) written to the archive; pickles as that tensor."""

    def __init__(self, storage: _StorageRef, shape: tuple[int, ...]) -> None:
        self.storage, self.shape = storage, tuple(shape)

    @property
    def dtype(self) -> torch.dtype:
        return dtypes.to_torch(self.storage.dtype_name)

    def __reduce_ex__(self, protocol: int):
        stride, acc = [], 1
        for size in reversed(self.shape):
            stride.append(acc)
            acc *= size
        args = (self.storage, 0, _Size(self.shape), tuple(reversed(stride)), False, collections.OrderedDict())
        return named("torch._utils", "_rebuild_tensor_v2"), args


class _Pickler(pickle._Pickler):
    """The pure-Python pickler, which alone lets a name be written without importing its module (the C one imports
    it to check the object); it writes the same opcodes and memo as the C one. `Global`s and the storages
    written are pickled as torch's own objects; a torch tensor (or `Blocks`, `ByteBlocks`) met in the tree is added to
    the archive first."""

    dispatch = dict(pickle._Pickler.dispatch)

    def __init__(self, file, writer: TorchFileWriter) -> None:
        super().__init__(file, protocol=2)
        self.writer = writer

    def persistent_id(self, obj: Any):
        if isinstance(obj, _StorageRef):
            return "storage", named("torch", storage_type(obj.dtype_name)), obj.key, "cpu", obj.numel
        return None

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        torch_module = loaded("torch")
        if torch_module is not None and type(obj) is torch_module.dtype:  # the same one object as a TorchDType's
            obj = dtype_global(dtypes.name_of(obj))
        super().save(obj, save_persistent_id)

    def reducer_override(self, obj: Any):
        if isinstance(obj, (Blocks, ByteBlocks)):  # a tensor's bytes met in the tree: stored, then pickled as one
            return self.writer.add(obj).__reduce_ex__(2)
        torch_module = loaded("torch")  # a tensor exists only once torch is imported
        if torch_module is not None and isinstance(obj, torch_module.Tensor):
            return self.writer.add(obj).__reduce_ex__(2)
        return NotImplemented

    def save_named(self, obj: Global) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        self.memoize(obj)

    def save_dtype(self, obj: TorchDType) -> None:
        self.save(dtype_global(obj.name))  # one object per dtype, as torch's: pickled once, then by reference

    dispatch[Global] = save_named
    dispatch[TorchDType] = save_dtype


class Window:
    """A file object that starts at the current position of `f`: what zipfile sees as offset 0."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.base = f, f.tell()

    def write(self, data) -> int:
        return self.f.write(data)

    def tell(self) -> int:
        return self.f.tell() - self.base

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence == 0:
            pos += self.base
        return self.f.seek(pos, whence) - self.base

    def flush(self) -> None:
        self.f.flush()


def _header_bytes(filename: str) -> int:
    """A record's local header before its padding: 30 bytes + name + our padding field's own 4 + the zip64 field
    (20)."""
    return 30 + len(filename.encode()) + 4 + 20


def first_data_offset(archive: str = "archive") -> int:
    """Where the first tensor's data starts, from the start of an archive named `archive`, when it needs no
    padding beyond ALIGN (its source's bytes are already page-congruent there, or it has none)."""
    header = _header_bytes(f"{archive}/data/0")
    return header + (-header % ALIGN)


class TorchFileWriter:
    """Write a torch.save-compatible archive tensor by tensor (see the module docstring).

    `target` is a path, or an open binary file positioned where the archive starts (left open; one without a file
    descriptor, such as `io.BytesIO`, gets every record through `write`). With
    `background` the tensor bytes are checksummed and written by a helper thread, overlapping with the caller
    preparing the next tensor; at most `max_pending` tensors wait at a time. `sender` (see mconvert.io.block_writer)
    may be shared by archives written one after another by one thread (DCP files hold one per chunk). With
    `digest` (`mconvert.io.integrity.WriteDigest` of the file, written in the caller's thread), the tensor bytes
    are hashed from memory as each record is done, not read back.
    """

    def __init__(self, target: Path | str | BinaryIO, *, archive: str | None = None, background: bool = True,
                 max_pending: int = 2, sender: Sender | None = None, digest: WriteDigest | None = None) -> None:
        if isinstance(target, (str, Path)):
            self._file, self._own = open(target, "wb"), True  # noqa: SIM115
            archive = archive or Path(target).stem
        else:
            self._file, self._own = target, False
        self._out = Window(self._file)
        try:
            self._fd: int | None = self._file.fileno()
        except (AttributeError, io.UnsupportedOperation):  # in memory (a DCP bytes item): bytes written by write()
            self._fd = None
        self._writeback = Writeback(self._fd, self._file.tell()) if self._fd is not None else None
        self._sender, self._own_sender = (sender, False) if sender else (Sender(), True)  # one writing thread
        self._prefix = archive or "archive"
        self._zip = zipfile.ZipFile(self._out, "w", zipfile.ZIP_STORED, allowZip64=True)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1) if background else None
        self._pending: collections.deque[concurrent.futures.Future] = collections.deque()
        self._max_pending = max_pending
        self._count = 0
        self._digest = digest
        self._closed = False
        self.bytes_written = 0

    def _record(self, name: str, data: bytes | Blocks | ByteBlocks) -> None:
        """One stored record of `data`: bytes, or blocks sent by `mconvert.io.block_writer` (file to file where it can)
        behind zipfile's back, telling it the size and CRC it would have counted."""
        if self._fd is None and not isinstance(data, bytes):
            data = b"".join(bytes(buffer) for buffer in self._sender.buffers(data))
        info = zipfile.ZipInfo(f"{self._prefix}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
        # Pad the data to ALIGN, and further, in steps of ALIGN, to put copied bytes page-congruent with their
        # sources (page_offsets).
        header = _header_bytes(info.filename)
        pad = -(self._out.tell() + header) % ALIGN
        if self._fd is not None and not isinstance(data, bytes):
            pad += page_offsets.gap(data, self._file.tell() + header + pad, ALIGN) or 0
        info.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
        with self._zip.open(info, "w", force_zip64=True) as f:
            if isinstance(data, bytes):
                f.write(data)
            elif not _COUNTS_BYTES:
                for buffer in self._sender.buffers(data):
                    f.write(buffer)
            else:
                self._file.flush()
                start = self._file.tell()
                end, crc = self._sender.send(data, self._file.fileno(), start, crc=0, writeback=self._writeback)
                self._file.seek(end)
                f._file_size, f._crc = end - start, crc  # what f.write() would have counted
        info.extra = b""  # the padding is the local header's alone (as torch's writer does): none in the directory
        if self._digest is not None and not isinstance(data, bytes) and _COUNTS_BYTES:
            # The local header before the data is final only now (zipfile rewrote it with the CRC): hash it
            # (read back, a few dozen bytes), then the data from the memory it was written from.
            for buffer in self._sender.buffers(data):
                self._digest.feed(start, buffer)
                start += len(buffer)
        if self._writeback is not None:
            self._writeback.advance(self._file.tell())

    def _write_tensor(self, key: str, blocks: Blocks | ByteBlocks) -> None:
        self._record(f"data/{key}", blocks)

    def _wait(self, keep: int) -> None:
        while len(self._pending) > keep:
            self._pending.popleft().result()  # re-raises a failed write here

    def add(self, tensor: torch.Tensor | Blocks | ByteBlocks) -> StoredTensor:
        """Write (or queue) the tensor's bytes; return a handle to put in the object passed to `finish`. Blocks
        (see mconvert.ir.blocks) are written one after another, never joined."""
        blocks = tensor if isinstance(tensor, ByteBlocks) else as_blocks(tensor)
        key = str(self._count)
        self._count += 1
        if self._pool is None:
            try:
                self._write_tensor(key, blocks)
            except BaseException:  # e.g. a full disk: release the archive now, not in ZipFile.__del__
                with contextlib.suppress(Exception):
                    self.close()
                raise
        else:
            self._wait(self._max_pending - 1)
            self._pending.append(self._pool.submit(self._write_tensor, key, blocks))
        self.bytes_written += blocks.nbytes
        name = blocks.dtype_name if isinstance(blocks, ByteBlocks) else dtypes.name_of(blocks.dtype)
        return StoredTensor(_StorageRef(key, name, blocks.nbytes // dtypes.itemsize(name)), blocks.shape)

    def finish(self, obj: Any) -> int:
        """Pickle `obj` (tensors already replaced by `add` handles, or small tensors added now) and close."""
        buf = io.BytesIO()
        try:
            _Pickler(buf, self).dump(obj)
            self._wait(0)
            data = buf.getvalue()
            for name, value in (("data.pkl", data), (".storage_alignment", b"64"), ("byteorder", b"little"),
                                ("version", b"3\n")):
                self._record(name, value)
        except BaseException:  # e.g. a full disk: release the file now, not in ZipFile.__del__ (which would fail)
            with contextlib.suppress(Exception):
                self.close()
            raise
        self.close()
        self.bytes_written += len(data)
        return self.bytes_written

    def close(self) -> None:
        """Close the archive (also after a failure: pending writes are finished or abandoned)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._wait(0)
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            try:
                self._zip.close()
            finally:
                if self._own_sender:
                    self._sender.close()
                if self._own:
                    self._file.close()


def save(obj: Any, target: Path | str | BinaryIO, **kwargs) -> int:
    """`torch.save` through the streaming writer (same format); returns the bytes written."""
    return TorchFileWriter(target, **kwargs).finish(obj)
