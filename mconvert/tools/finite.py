"""Counting NaN and infinite values, for `mconvert inspect` (replicas and tied copies are checked to hold the same
bytes as they are counted; comparing stored bytes is `mconvert.tools.stored`).

A tensor whose bytes lie unchanged in a file (`LazyTensor.file_bytes`, a safetensors entry) is counted from the
file with numpy, by bit pattern, without importing torch; any other is loaded and counted by torch. IEEE formats
(and bfloat16, float32's upper half) mark both by an exponent of all ones; the mantissa then says which:

    bits without the sign  >  exponent mask  ->  NaN      (mantissa not zero)
    bits without the sign  == exponent mask  ->  Inf      (mantissa zero)
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from mconvert.errors import ConvertError
from mconvert.ir.blocks import FileBytes
from mconvert.lazy import np, torch
from mconvert.tools import stored

if TYPE_CHECKING:
    from mconvert.ir.tensors import LazyTensor

# dtype name -> (unsigned little-endian integer of its width, exponent mask, mantissa mask)
BIT_PATTERNS = {
    "float64": ("<u8", 0x7FF0_0000_0000_0000, 0x000F_FFFF_FFFF_FFFF),
    "float32": ("<u4", 0x7F80_0000, 0x007F_FFFF),
    "float16": ("<u2", 0x7C00, 0x03FF),
    "bfloat16": ("<u2", 0x7F80, 0x007F),
}
_CHUNK = 1 << 24  # elements counted at a time: temporaries stay at a few tens of MB whatever the tensor's size


def count(t: LazyTensor) -> tuple[int, int] | None:
    """(NaN, Inf) in `t`, or None when it is not floating point."""
    if t.file_bytes is not None and t.dtype_name in BIT_PATTERNS:
        return count_file(t.file_bytes, t.dtype_name, t.numel)
    if _finite_pieces(t):
        return 0, 0
    return count_tensor(t.load())


def _finite_pieces(t: LazyTensor) -> bool:
    """Are the stored tensors `t` rearranges (`LazyTensor.elements_of`) all finite, read from their files? Then
    so is `t`, a subset of their elements. Replicas must also hold the same bytes, and each stored copy the same
    bytes as the pieces (reading `t` would check that; where they differ, `t` is loaded and says so). False when
    anything is not known this way: `t` is then loaded and counted."""
    found = t.elements_of.resolved() if t.elements_of is not None else None
    if found is None or t.dtype_name not in BIT_PATTERNS or any(p.dtype_name != t.dtype_name for p in found.pieces):
        return False
    if found.replicas and (any(p.file_bytes is None for p in found.pieces)
                           or len({_raw(p.file_bytes, p.nbytes) for p in found.pieces}) != 1):
        return False
    for copy in found.copies:
        if not all(stored.same(p, q) for p, q in zip(found.pieces, copy)):
            return False
    return all(_finite(p) for p in found.pieces)


def _finite(piece: LazyTensor) -> bool:
    """A stored piece's values are all finite: counted in its file, or in the pieces it is made of."""
    if piece.file_bytes is not None:
        return count_file(piece.file_bytes, piece.dtype_name, piece.numel) == (0, 0)
    return _finite_pieces(piece)


def _raw(where: FileBytes, nbytes: int, start: int = 0) -> bytes:
    if FileBytes.identity_of(os.stat(where.path)) != where.identity:
        raise ConvertError(f"{where.path}: the file changed since its header was read")
    with open(where.path, "rb") as f:
        f.seek(where.offset + start)
        return f.read(nbytes)


def count_tensor(t: torch.Tensor) -> tuple[int, int] | None:
    if not t.is_floating_point():
        return None
    return int(torch.isnan(t).sum()), int(torch.isinf(t).sum())


def count_file(where: FileBytes, dtype: str, numel: int) -> tuple[int, int]:
    """(NaN, Inf) among `numel` elements of `dtype` at `where`, read from the file with numpy."""
    code, exponent, mantissa = BIT_PATTERNS[dtype]
    if FileBytes.identity_of(os.stat(where.path)) != where.identity:
        raise ConvertError(f"{where.path}: the file changed since its header was read")
    if numel == 0:
        return 0, 0
    values = np.memmap(where.path, dtype=code, mode="r", offset=where.offset, shape=(numel,))
    magnitude_mask = np.array(exponent | mantissa, dtype=code)
    nan = inf = 0
    for start in range(0, numel, _CHUNK):
        bits = values[start:start + _CHUNK] & magnitude_mask
        nan += int(np.count_nonzero(bits > exponent))
        inf += int(np.count_nonzero(bits == exponent))
    return nan, inf


def describe(counts: tuple[int, int] | None) -> str | None:
    """`3 NaN, 1 Inf` when there are any, else None."""
    if counts is None:
        return None
    nan, inf = counts
    parts = [f"{nan} NaN" if nan else "", f"{inf} Inf" if inf else ""]
    return ", ".join(p for p in parts if p) or None
