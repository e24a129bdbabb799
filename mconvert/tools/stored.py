"""IR tensors read as the bytes they are stored as, without torch: `mconvert compare`'s test for bit-identical
tensors, and `inspect`'s for stored copies.

An IR tensor whose elements are stored unchanged is known by where they lie (`LazyTensor.file_bytes`), or by the
stored pieces a rule only cuts and joins (`LazyTensor.elements_of`, see `mconvert.ir.tensors.Elements`). Cutting
and joining move whole rows or runs of columns, so the tensor can be read a band of rows at a time straight from
the files, with numpy, as unsigned integers of its element's width (bits, not values: -0.0 is not 0.0 here):

    file_bytes                  the rows of a memory map of the file
    Elements.in_order           pieces one after another along rows (a block cut into DCP or zarr chunks)
    REPLICATE                   the first piece (every replica checked to hold the same bytes)
    COLUMN / ROW                TP pieces joined along rows / columns
    IDENTITY / VOCAB            the joined tensor itself / its first `vocab_size` rows (padding dropped)

Any other rule (QKV regrouped, SwiGLU's halves, transposes, dequantization) computes its tensors: None here, and
the caller loads them with torch.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

from mconvert.errors import ConvertError
from mconvert.io.file_views import RAW
from mconvert.ir import dtypes
from mconvert.ir.blocks import FileBytes
from mconvert.ir.tensors import LazyTensor
from mconvert.lazy import np
from mconvert.rules.table import COLUMN, IDENTITY, REPLICATE, ROW, VOCAB

_BAND = 32 << 20  # bytes of each side compared at a time: memory stays at a few tens of MB whatever the tensor


@dataclass(frozen=True)
class Rows:
    """A tensor of `shape` whose rows [a, b) `read(a, b)` gives as an array of raw integers, once every one of
    `checks` holds (what reading the tensor itself would check: replicas and stored copies equal; they read bytes,
    so they run only when the other side can be read this way too)."""

    shape: tuple[int, ...]
    read: Callable[[int, int], np.ndarray]
    checks: tuple[Callable[[], bool], ...] = ()


def same(a: LazyTensor, b: LazyTensor) -> bool:
    """Do `a` and `b` (one shape and dtype) hold the same bits, read from their files? False also when that is not
    known this way (see the module docstring): the caller then loads and compares them."""
    if tuple(a.shape) != tuple(b.shape) or a.dtype_name != b.dtype_name:
        return False
    x, y = rows_of(a), rows_of(b)
    return x is not None and y is not None and all(check() for check in x.checks + y.checks) and equal(x, y)


def equal(x: Rows, y: Rows) -> bool:
    """Equal bits, compared a band of rows at a time."""
    if x.shape != y.shape:
        return False
    if not x.shape:
        return bool(np.array_equal(x.read(0, 1), y.read(0, 1)))
    row_bytes = max(1, math.prod(x.shape[1:])) * 8
    step = max(1, _BAND // row_bytes)
    return all(np.array_equal(x.read(i, min(i + step, x.shape[0])), y.read(i, min(i + step, x.shape[0])))
               for i in range(0, x.shape[0], step))


def rows_of(t: LazyTensor) -> Rows | None:
    """`t` read from its stored bytes, or None when its elements are not stored unchanged (or not known to be)."""
    raw = RAW.get(dtypes.itemsize(t.dtype_name))
    if raw is None:
        return None
    shape = tuple(t.shape)
    if t.file_bytes is not None:
        return _mapped(t, raw)
    found = t.elements_of.resolved() if t.elements_of is not None else None
    if found is None or not found.pieces or any(p.dtype_name != t.dtype_name for p in found.pieces):
        return None
    pieces = [rows_of(p) for p in found.pieces]
    if any(p is None for p in pieces) or any(len(copy) != len(pieces) for copy in found.copies):
        return None
    # reading `t` checks its stored copies and replicas: the same bytes here, else the caller's load decides
    checks = tuple(c for p in pieces for c in p.checks)
    checks += tuple(lambda copy=copy: all(same(p, q) for p, q in zip(found.pieces, copy)) for copy in found.copies)
    if not found.how:
        whole = _stacked(pieces, shape) if found.in_order else None
        return None if whole is None else dataclasses.replace(whole, checks=checks)
    join, shard = found.how
    if shard is REPLICATE:
        if found.replicas:
            checks += (lambda: all(equal(pieces[0], p) for p in pieces[1:]),)
        whole = pieces[0]
    elif shard is COLUMN:
        whole = _stacked(pieces, None)
    elif shard is ROW:
        whole = _side_by_side(pieces)
    else:
        return None
    if whole is None or len(whole.shape) != len(shape) or whole.shape[1:] != shape[1:]:
        return None
    if join is IDENTITY and whole.shape == shape:
        return dataclasses.replace(whole, checks=checks)
    if join is VOCAB and shape and whole.shape[0] >= shape[0]:
        return Rows(shape, whole.read, checks)  # the padding rows after the first `vocab_size` are never read
    return None


def _mapped(t: LazyTensor, raw: str) -> Rows:
    where, shape = t.file_bytes, tuple(t.shape)

    def read(a: int, b: int) -> np.ndarray:
        if FileBytes.identity_of(os.stat(where.path)) != where.identity:
            raise ConvertError(f"{where.path}: the file changed since its header was read")
        if not math.prod(shape):
            return np.zeros((b - a, *shape[1:]) if shape else (), dtype=raw)
        values = np.memmap(where.path, dtype=raw, mode="r", offset=where.offset, shape=shape or (1,))
        return values[a:b] if shape else values.reshape(())

    return Rows(shape, read)


def _stacked(pieces: list[Rows], shape: tuple[int, ...] | None) -> Rows | None:
    """Pieces one after another along rows (their other dimensions equal; `shape`, when given, theirs joined)."""
    if any(not p.shape or p.shape[1:] != pieces[0].shape[1:] for p in pieces):
        return None
    joined = (sum(p.shape[0] for p in pieces), *pieces[0].shape[1:])
    if shape is not None and joined != shape:
        return None
    starts = [sum(p.shape[0] for p in pieces[:i]) for i in range(len(pieces) + 1)]

    def read(a: int, b: int) -> np.ndarray:
        parts = [p.read(max(a, lo) - lo, min(b, hi) - lo) for p, lo, hi in zip(pieces, starts, starts[1:])
                 if lo < b and a < hi]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)

    return Rows(joined, read)


def _side_by_side(pieces: list[Rows]) -> Rows | None:
    """TP pieces of a row-parallel weight joined along columns (dimension 1)."""
    first = pieces[0].shape
    if len(first) < 2 or any(len(p.shape) != len(first) or p.shape[0] != first[0] or p.shape[2:] != first[2:]
                             for p in pieces):
        return None
    joined = (first[0], sum(p.shape[1] for p in pieces), *first[2:])
    return Rows(joined, lambda a, b: np.concatenate([p.read(a, b) for p in pieces], axis=1))
