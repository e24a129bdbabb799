"""A tensor as a row of contiguous blocks: what writers send to disk without joining the pieces first.

Many checkpoint tensors are pieces of other tensors laid end to end: Megatron's fused QKV is q, k and v rows of
each query group one after another, SwiGLU's fc1 is `[gate ; up]`, a column-parallel rank file holds a run of
rows. Joining them with `torch.cat` costs a copy of every byte; a writer can instead write each block where it
belongs. `Blocks` is that promise:

    shape [6144, 2048]  =  parts ( q rows of group 0 | k of group 0 | v of group 0 | q of group 1 | … )
                            each a contiguous tensor; their bytes, in order, are the tensor's bytes

Blocks usually view the source's memory map, so holding one costs no process memory. A part need not be
contiguous (a row-parallel piece is every row's left half). How parts reach a file is `formats.block_writer`'s
business.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mconvert.errors import ConvertError


@dataclass(frozen=True)
class Blocks:
    """`shape`/`dtype` of the whole; `parts` tensors whose bytes (each part's in row-major order), one after
    another, are its bytes. Parts are cut along dimension 0 (rows; the elements of a 1-D tensor)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Blocks:
        t = tensor.detach().cpu()  # a view stays a view: only its own bytes are written
        return cls(tuple(t.shape), t.dtype, (t,) if t.numel() else ())

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

    def rows(self, start: int, stop: int) -> list[torch.Tensor]:
        """Rows [start, stop) as views of the parts."""
        out, at = [], 0
        for p in self.parts:
            n = p.shape[0] if p.dim() else 1
            lo, hi = max(start, at), min(stop, at + n)
            if lo < hi:
                out.append(p[lo - at:hi - at])
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


def reshape(value: torch.Tensor | Blocks, shape: tuple[int, ...]) -> torch.Tensor | Blocks:
    """The same bytes under another shape of as many elements (Blocks keep their parts)."""
    if isinstance(value, torch.Tensor):
        return value.reshape(shape)
    n = 1
    for s in shape:
        n *= s
    if n * value.dtype.itemsize != value.nbytes:
        raise ConvertError(f"cannot view {list(value.shape)} as {list(shape)}")
    return Blocks(tuple(shape), value.dtype, value.parts)
