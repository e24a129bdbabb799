"""Tensors that lie unchanged in a file, viewed as numpy arrays of their raw bytes: the byte path, without torch.

A loader that knows where a tensor's bytes are (`LazyTensor.file_bytes`: a safetensors entry, a contiguous torch
record) lets a conversion that only moves bytes (rows picked, columns cut: see `mconvert.rules.row_maps`) view
them through a read-only map of the file, as unsigned integers of the dtype's size (bfloat16 as uint16: numpy has
no bfloat16, and the bytes are only moved, never computed with). Nothing imports torch.

    views = FileViews()
    blocks = views.view(lazy_tensor)      # ByteBlocks of one part (or None: not in a file, or the file changed)

`MCONVERT_TORCH_PATH=1` in the environment turns the byte path off (every tensor through torch, as before it
existed): the tests compare the two outputs byte for byte. The HF saver still maps its sources to choose where the
data starts (`mconvert.io.page_offsets`), so that both paths place the bytes alike.
"""

from __future__ import annotations

import mmap
import os
import threading

from mconvert.ir import dtypes
from mconvert.ir.blocks import ByteBlocks, FileBytes
from mconvert.ir.tensors import LazyTensor
from mconvert.lazy import np

RAW = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}  # element size -> the (little-endian) unsigned integer carrying its bits


def enabled() -> bool:
    """Is the byte path on (not turned off by MCONVERT_TORCH_PATH=1)?"""
    return os.environ.get("MCONVERT_TORCH_PATH", "") in ("", "0")


class FileViews:
    """Read-only maps of source files, each opened once and only while it is the file the loader saw (device,
    inode, size, modification time); safe to share between threads."""

    def __init__(self) -> None:
        self._maps: dict[tuple[str, tuple[int, int, int, int]], mmap.mmap | None] = {}
        self._lock = threading.Lock()

    def view(self, t: LazyTensor) -> ByteBlocks | None:
        """`t`'s bytes as one part viewing its file, with their provenance, or as its loader's rule rearranges
        stored pieces (`LazyTensor.byte_blocks`); None when neither is known, or a file is no longer the one it
        was read from."""
        where = t.file_bytes
        size = dtypes.itemsize(t.dtype_name)
        if where is None:  # rows or columns of stored pieces, rearranged by the loader's rule
            return t.byte_blocks(self.view) if t.byte_blocks is not None else self._stored_in_order(t)
        if size not in RAW or not t.numel:
            return None
        mapped = self._map(where)
        if mapped is None or where.offset + t.nbytes > len(mapped):
            return None
        array = np.frombuffer(mapped, dtype=RAW[size], count=t.numel, offset=where.offset).reshape(t.shape)
        return ByteBlocks(tuple(t.shape), t.dtype_name, (array,), (where,))

    def _stored_in_order(self, t: LazyTensor) -> ByteBlocks | None:
        """A tensor stored as pieces one after another along its rows (a torch_dist block's chunks, verified
        against the integrity manifest when found: `Elements.in_order`)."""
        found = t.elements_of.resolved() if t.elements_of is not None and t.shape else None
        if found is None or not found.in_order or found.replicas or found.copies or found.how or \
                any(p.dtype_name != t.dtype_name or tuple(p.shape[1:]) != tuple(t.shape[1:]) for p in found.pieces) \
                or sum(p.shape[0] for p in found.pieces) != t.shape[0]:
            return None
        views = [self.view(p) for p in found.pieces]
        if any(v is None for v in views):
            return None
        sources = tuple(v.source(i) for v in views for i in range(len(v.parts)))
        return ByteBlocks(tuple(t.shape), t.dtype_name, tuple(p for v in views for p in v.parts),
                          sources if any(s is not None for s in sources) else ())

    def _map(self, where: FileBytes) -> mmap.mmap | None:
        key = (where.path, where.identity)
        with self._lock:
            if key not in self._maps:
                self._maps[key] = _open_map(where)
            return self._maps[key]


def _open_map(where: FileBytes) -> mmap.mmap | None:
    try:
        fd = os.open(where.path, os.O_RDONLY)
    except OSError:  # removed or renamed since it was read
        return None
    try:
        if FileBytes.identity_of(os.fstat(fd)) != where.identity or not where.identity[2]:
            return None
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    except OSError:  # e.g. out of file descriptors (a map keeps one): the tensor takes the torch path
        return None
    finally:
        os.close(fd)
