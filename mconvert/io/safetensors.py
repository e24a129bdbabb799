"""safetensors files: a validating, memory-mapped reader and a streaming writer.

The format: 8 bytes little-endian header length N, N bytes of JSON (`{name: {dtype, shape, data_offsets}}` plus an
optional `__metadata__` of strings), then the data; offsets are relative to the end of the header. The reader
checks the whole header against the file size before anything is read, so a truncated download is reported as
such, with the file name; tensors are zero-copy views of a private memory map (reclaimable page cache, not
process memory). The writer knows every shape up front, writes the header first and then each tensor as it
arrives, so a multi-GB shard never sits in memory.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from mconvert.errors import ConvertError
from mconvert.io import page_offsets
from mconvert.io.block_writer import Sender, file_turn, pwrite_all
from mconvert.io.writeback import Writeback
from mconvert.ir import dtypes
from mconvert.ir.blocks import Blocks, ByteBlocks, FileBytes, as_blocks
from mconvert.lazy import torch

# the header's dtype codes -> torch's dtype names (see mconvert.ir.dtypes)
DTYPES: dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "U16": "uint16", "U32": "uint32", "U64": "uint64",
}
CODES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype_name: str
    start: int  # absolute file offsets
    end: int

    @property
    def dtype(self) -> torch.dtype:
        return dtypes.to_torch(self.dtype_name)


class SafetensorsFile:
    """One .safetensors file, opened lazily: `infos` from the header, `get(name)` maps the bytes."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.infos, self.metadata = read_header(self.path)
        self.identity = FileBytes.identity_of(self.path.stat())  # the file whose header this is
        self._map: mmap.mmap | None = None
        self._identity: tuple[int, int, int, int] | None = None

    def get(self, name: str) -> torch.Tensor:
        info = self.infos.get(name)
        if info is None:
            raise ConvertError(f"{self.path}: no tensor named {name!r}")
        if self._map is None:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                self._identity = FileBytes.identity_of(os.fstat(f.fileno()))
        count = (info.end - info.start) // info.dtype.itemsize
        if count == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        flat = torch.frombuffer(self._map, dtype=info.dtype, count=count, offset=info.start)
        return flat.view(info.shape)

    def get_blocks(self, name: str) -> Blocks:
        """`get` as one block that knows its bytes are the file's bytes [start, end), unchanged."""
        t = self.get(name)
        if not t.numel():
            return Blocks.of(t)
        return Blocks.of(t, FileBytes(os.path.abspath(self.path), self.infos[name].start, self._identity, t._version))


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate the header of `path` against its size; raise ConvertError naming the file."""
    if not path.is_file():
        raise ConvertError(f"{path}: file not found")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConvertError(f"{path}: not a safetensors file: {size} bytes, shorter than the 8-byte header size")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise ConvertError(f"{path}: truncated or not a safetensors file: header of {n} bytes announced, "
                               f"file has {size} bytes")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise ConvertError(f"{path}: corrupt safetensors header: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise ConvertError(f"{path}: corrupt safetensors header: a JSON {type(header).__name__}, not an object")
    base = 8 + n
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise ConvertError(f"{path}: corrupt safetensors header: __metadata__ is a {type(metadata).__name__}, not an "
                           "object of strings")
    infos: dict[str, TensorInfo] = {}
    need = base
    for name, entry in header.items():
        try:
            dtype = DTYPES[entry["dtype"]]  # a name
            shape = tuple(_count(s) for s in entry["shape"])
            start, end = (_count(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ConvertError(f"{path}: corrupt safetensors header entry for {name!r}: {str(entry)[:200]}") from None
        numel = 1
        for s in shape:
            numel *= s
        if end - start != numel * dtypes.itemsize(dtype):
            raise ConvertError(f"{path}: tensor {name!r} {list(shape)} {entry['dtype']} claims bytes "
                               f"[{start}, {end}), which does not match its size")
        infos[name] = TensorInfo(shape, dtype, base + start, base + end)
        need = max(need, base + end)
    if size < need:
        raise ConvertError(f"{path}: truncated: its header describes {need} bytes of tensors and header, but the file "
                           f"has only {size} bytes (an interrupted download or copy?)")
    _check_disjoint(path, infos)
    return infos, metadata


def _count(value) -> int:
    """A shape or offset entry: a non-negative JSON integer (not a float, a bool or text)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(value)
    return value


def _check_disjoint(path: Path, infos: dict[str, TensorInfo]) -> None:
    """Two tensors sharing bytes would make one model out of another's weights: the format forbids it."""
    spans = sorted((i.start, i.end, name) for name, i in infos.items() if i.end > i.start)
    for (_, end_a, a), (start_b, _, b) in zip(spans, spans[1:]):
        if start_b < end_a:
            raise ConvertError(f"{path}: tensors {a!r} and {b!r} claim overlapping bytes (from {start_b} on); each "
                               "tensor must have its own bytes")


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | str  # or its name (see mconvert.ir.dtypes)


def entry_nbytes(e: Entry) -> int:
    return dtypes.itemsize(dtypes.name_of(e.dtype)) * math.prod(e.shape)


@dataclass(frozen=True)
class Layout:
    """Where everything goes in one safetensors file, known before any tensor is produced: the header (with its
    8-byte length) and each tensor's absolute offset. Writers of different tensor ranges can then work at once."""

    header: bytes
    entries: tuple[Entry, ...]
    starts: tuple[int, ...]
    size: int


def layout(entries: Iterable[Entry], metadata: dict[str, str] | None = None,
           sources: Callable[[Entry], Blocks | ByteBlocks | None] | None = None) -> Layout:
    """The file's layout. The header is padded with spaces (the format allows trailing whitespace in it) so that
    the data starts 8-byte aligned, as safetensors' own writer keeps it, and, among those offsets, where the most
    bytes copied file to file land page-congruent with their sources (`sources(entry)`: the entry's blocks, asked
    for their provenance only; see mconvert.io.page_offsets); with none, on a page boundary."""
    entries = tuple(entries)
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    found: dict[int, int] = {}
    for e in entries:
        nbytes = entry_nbytes(e)
        header[e.name] = {"dtype": CODES[dtypes.name_of(e.dtype)], "shape": list(e.shape),
                          "data_offsets": [offset, offset + nbytes]}
        blocks = sources(e) if sources is not None else None
        if blocks is not None:
            page_offsets.votes(blocks, offset, found)
        offset += nbytes
    start = page_offsets.best(found, 8) or 0  # where the data starts, mod PAGE
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * ((start - 8 - len(blob)) % page_offsets.PAGE)
    base = 8 + len(blob)
    starts = tuple(base + header[e.name]["data_offsets"][0] for e in entries)  # type: ignore[index]
    return Layout(struct.pack("<Q", len(blob)) + blob, entries, starts, base + offset)


def write(path: Path | str, entries: Iterable[Entry], produce: Callable[[Entry], torch.Tensor | Blocks | ByteBlocks],
          metadata: dict[str, str] | None = None, on_tensor: Callable[[int], None] | None = None) -> int:
    """Write a safetensors file, asking `produce` for each entry's tensor (or its blocks) in order; returns bytes
    written."""
    plan = layout(entries, metadata)
    write_range(path, plan, 0, len(plan.entries), produce, on_tensor)
    return plan.size


def write_range(path: Path | str, plan: Layout, first: int, stop: int,
                produce: Callable[[Entry], torch.Tensor | Blocks | ByteBlocks],
                on_tensor: Callable[[int], None] | None = None) -> None:
    """Tensors [first, stop) of the file `plan` describes, each at its offset; the range starting at 0 also writes
    the header and sets the file's size. Other ranges of the same file may be written at the same time (the file
    is opened without truncation and every write goes to its own offset): the file is whole when all are done."""
    with contextlib.ExitStack() as stack:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        stack.callback(os.close, fd)
        if first == 0:
            os.ftruncate(fd, plan.size)
            with file_turn(fd):
                pwrite_all(fd, memoryview(plan.header), 0)
        writeback = Writeback(fd, plan.starts[first] if first < len(plan.entries) else plan.size)
        sender = stack.enter_context(contextlib.closing(Sender()))
        for e, start in zip(plan.entries[first:stop], plan.starts[first:stop]):
            produced = produce(e)
            made = produced.dtype_name if isinstance(produced, ByteBlocks) else dtypes.name_of(produced.dtype)
            if tuple(produced.shape) != tuple(e.shape) or made != dtypes.name_of(e.dtype):
                raise ConvertError(f"{path}: tensor {e.name} came out {list(produced.shape)} torch.{made}, "
                                   f"planned {list(e.shape)} torch.{dtypes.name_of(e.dtype)}")
            blocks = produced if isinstance(produced, ByteBlocks) else as_blocks(produced)
            sender.send(blocks, fd, start, writeback=writeback)
            if on_tensor:
                on_tensor(blocks.nbytes)
