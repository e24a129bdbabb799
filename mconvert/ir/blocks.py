"""A tensor as a row of contiguous blocks: what writers send to disk without joining the pieces first.

Many checkpoint tensors are pieces of other tensors laid end to end: Megatron's fused QKV is q, k and v rows of
each query group one after another, SwiGLU's fc1 is `[gate ; up]`, a column-parallel rank file holds a run of
rows. Joining them with `torch.cat` costs a copy of every byte; a writer can instead write each block where it
belongs. `Blocks` is that promise:

    shape [6144, 2048]  =  parts ( q rows of group 0 | k of group 0 | v of group 0 | q of group 1 | … )
                            each a contiguous tensor; their bytes, in order, are the tensor's bytes

Blocks usually view the source's memory map, so holding one costs no process memory. A part need not be
contiguous (a row-parallel piece is every row's left half). How parts reach a file is `mconvert.io.block_writer`'s
business.

Provenance: a loader that maps a stretch of a checkpoint file unchanged (a safetensors entry, the storage of a
torch zip record, a DCP chunk) says so with a `FileBytes` beside the part: which file, where, and the file's
identity when it was opened. Row slices keep it (`rows`: the offset moves by the rows skipped); anything that
computes a new tensor (a cast, a dequantization, a transpose, a join) makes a part without it. A writer may then
copy those bytes file to file, without asking the kernel where the memory came from:

    part  = mapped[100:300]               (rows of a [4096, 2048] bf16 entry starting at byte 8_000)
    bytes = FileBytes(path, 8_000 + 100 * 4096, identity)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mconvert.errors import ConvertError
from mconvert.ir import dtypes
from mconvert.lazy import torch


@dataclass(frozen=True)
class FileBytes:
    """Where a contiguous part's bytes are, unchanged, in a file: `path` at byte `offset`. `identity` (device,
    inode, size, mtime) is the file's when the loader mapped it: a file replaced or changed since is not used.
    `version` is the part's in-place version counter (torch counts writes to a tensor and its views) when its
    provenance was recorded: a part written in place since then no longer holds the file's bytes."""

    path: str
    offset: int
    identity: tuple[int, int, int, int]
    version: int = 0

    @staticmethod
    def identity_of(stat) -> tuple[int, int, int, int]:
        return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)

    def holds(self, part: torch.Tensor) -> bool:
        """Does `part` still show exactly these file bytes (contiguous, never written in place since)?"""
        return part.is_contiguous() and part._version == self.version

    def within(self, base: torch.Tensor, view: torch.Tensor) -> FileBytes | None:
        """The provenance of `view`, a contiguous view into `base` (whose provenance this is)."""
        if not (self.holds(base) and view.is_contiguous()):
            return None
        return FileBytes(self.path, self.offset + view.data_ptr() - base.data_ptr(), self.identity, view._version)


@dataclass(frozen=True)
class Blocks:
    """`shape`/`dtype` of the whole; `parts` tensors whose bytes (each part's in row-major order), one after
    another, are its bytes. Parts are cut along dimension 0 (rows; the elements of a 1-D tensor). `sources`, when
    not empty, has one entry per part: its `FileBytes`, or None."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: tuple[torch.Tensor, ...]
    sources: tuple[FileBytes | None, ...] = ()

    def __post_init__(self) -> None:
        if self.sources and len(self.sources) != len(self.parts):
            raise ValueError(f"{len(self.sources)} sources for {len(self.parts)} parts")

    @classmethod
    def of(cls, tensor: torch.Tensor, source: FileBytes | None = None) -> Blocks:
        """One tensor as one part; `source` only from a loader that mapped it from a file unchanged."""
        t = tensor.detach().cpu()  # a view stays a view: only its own bytes are written
        if not t.numel():
            return cls(tuple(t.shape), t.dtype, ())
        return cls(tuple(t.shape), t.dtype, (t,), (source,) if source is not None and source.holds(t) else ())

    def source(self, i: int) -> FileBytes | None:
        """Part `i`'s provenance, if it has one and still holds the file's bytes."""
        found = self.sources[i] if self.sources else None
        return found if found is not None and found.holds(self.parts[i]) else None

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n

    @property
    def row_numel(self) -> int:
        n = 1
        for s in self.shape[1:]:
            n *= s
        return n

    def rows(self, start: int, stop: int) -> list[tuple[torch.Tensor, FileBytes | None]]:
        """Rows [start, stop) as views of the parts, each with its provenance (see `FileBytes.within`)."""
        out, at = [], 0
        for i, p in enumerate(self.parts):
            n = p.shape[0] if p.dim() else 1
            lo, hi = max(start, at), min(stop, at + n)
            if lo < hi:
                view = p[lo - at:hi - at]
                source = self.source(i)
                out.append((view, source.within(p, view) if source is not None else None))
            at += n
            if at >= stop:
                break
        return out

    def join(self) -> torch.Tensor:
        """One tensor (a copy, unless there is a single part)."""
        if not self.parts:
            return torch.empty(self.shape, dtype=self.dtype)
        if len(self.parts) == 1:
            return self.parts[0].reshape(self.shape)
        return torch.cat([p.reshape(-1) for p in self.parts]).reshape(self.shape)

    def check(self, shape: tuple[int, ...], dtype: torch.dtype, where: str) -> Blocks:
        """Refuse blocks that do not make the planned tensor (a loader or rule bug, caught before writing)."""
        got = sum(p.numel() for p in self.parts)
        if tuple(self.shape) != tuple(shape) or self.dtype != dtype or got * self.dtype.itemsize != self.nbytes or \
                any(p.dtype != self.dtype for p in self.parts):
            raise ConvertError(f"{where}: expected {list(shape)} {dtype}, got {list(self.shape)} {self.dtype} in "
                               f"{len(self.parts)} blocks of {got} elements")
        return self


def as_blocks(value: torch.Tensor | Blocks) -> Blocks:
    return value if isinstance(value, Blocks) else Blocks.of(value)


def reshape(value: torch.Tensor | Blocks | ByteBlocks, shape: tuple[int, ...]) -> torch.Tensor | Blocks | ByteBlocks:
    """The same bytes under another shape of as many elements (Blocks and ByteBlocks keep their parts)."""
    if not isinstance(value, (Blocks, ByteBlocks)):
        return value.reshape(shape)
    if math.prod(shape) != math.prod(value.shape):
        raise ConvertError(f"cannot view {list(value.shape)} as {list(shape)}")
    if isinstance(value, ByteBlocks):
        return ByteBlocks(tuple(shape), value.dtype_name, value.parts, value.sources)
    return Blocks(tuple(shape), value.dtype, value.parts, value.sources)


@dataclass(frozen=True)
class ByteBlocks:
    """`Blocks` without torch: each part a numpy array of the tensor's raw elements (unsigned integers of the
    dtype's size: bfloat16 as uint16) viewing a read-only map of a source file, so it always holds the file's
    bytes; `dtype_name` names the real dtype. What a conversion whose tensors only move bytes writes (see
    `mconvert.rules.row_plan.RowPlanner.forward_bytes`). A part may be strided (a band of columns), then without
    a source."""

    shape: tuple[int, ...]
    dtype_name: str
    parts: tuple  # numpy arrays
    sources: tuple[FileBytes | None, ...] = ()

    def __post_init__(self) -> None:
        if self.sources and len(self.sources) != len(self.parts):
            raise ValueError(f"{len(self.sources)} sources for {len(self.parts)} parts")

    def source(self, i: int) -> FileBytes | None:
        return self.sources[i] if self.sources else None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.itemsize(self.dtype_name)

    def rows(self, start: int, stop: int) -> list[tuple[object, FileBytes | None]]:
        """Rows [start, stop) as views of the parts, each with its provenance (`Blocks.rows` without torch)."""
        out, at = [], 0
        for i, p in enumerate(self.parts):
            n = p.shape[0] if p.ndim else 1
            lo, hi = max(start, at), min(stop, at + n)
            if lo < hi:
                view = p[lo - at:hi - at]
                source = self.source(i)
                if source is not None:
                    source = FileBytes(source.path, source.offset + (lo - at) * (p.nbytes // n), source.identity)
                out.append((view, source))
            at += n
            if at >= stop:
                break
        return out
