"""Which file, and where in it, a tensor's bytes come from when they are memory-mapped from a checkpoint.

Tensors read from checkpoints are views of memory-mapped files (ours for safetensors and DCP files, torch's for
`torch.load(mmap=True)`). Writing such bytes with write() makes the kernel fault every source page into this
process and copy it; `copy_file_range` copies from page cache to page cache inside the kernel instead, for about
a third of the CPU time (it is what `cp` does). To use it for any mapped tensor, whoever mapped it, the address
is looked up in the kernel's own table of this process's mappings (Linux `/proc/self/maps`):

    7f3a00000000-7f3a83000000 rw-p 00000000 fd:00 1234567  /ckpt/model.safetensors
    start        end          perm offset   dev   inode    path

    file offset of address a = offset + (a - start), when [a, a + nbytes) lies inside one file mapping

The file is reopened by path and must still be the same inode. A private mapping may hold pages changed in memory
since (torch byte-swaps a big-endian checkpoint in place): such a span is only used when the kernel's page table
(`/proc/self/pagemap`) shows none of its pages turned anonymous. Elsewhere (no /proc) nothing is found, and the
caller writes the bytes as usual.
"""

from __future__ import annotations

import bisect
import os
import time
from dataclasses import dataclass

import torch

REFRESH_SECONDS = 0.01  # an address in no known mapping re-reads the table, at most this often
MAPS = "/proc/self/maps"
PAGEMAP = "/proc/self/pagemap"
_PRESENT, _SWAPPED, _FILE = 1 << 63, 1 << 62, 1 << 61  # pagemap entry flags (Documentation/admin-guide/mm/pagemap)


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    offset: int
    private: bool  # copy-on-write: pages written in memory no longer match the file
    inode: int
    path: str  # "" for anonymous memory


@dataclass(frozen=True)
class Span:
    fd: int
    offset: int


class SourceMap:
    """Finds the file span of a tensor's memory; keeps the source files open until `close`. One per thread."""

    def __init__(self) -> None:
        self._mappings: list[Mapping] = []
        self._starts: list[int] = []
        self._read_at = float("-inf")
        self._fds: dict[tuple[str, int], int | None] = {}
        self._pagemap: int | None = None
        self.refreshes = 0

    def find(self, t: torch.Tensor) -> Span | None:
        """Where the bytes of contiguous `t` are in a file, or None (not mapped from a file, or not known)."""
        if not t.is_contiguous() or t.device.type != "cpu" or not t.numel():
            return None
        start, nbytes = t.data_ptr(), t.numel() * t.element_size()
        m = self._lookup(start)
        if m is None and time.monotonic() - self._read_at > REFRESH_SECONDS:  # mapped since the table was read
            self._refresh()
            m = self._lookup(start)
        if m is None or not m.path.startswith("/") or start + nbytes > m.end:
            return None
        if m.private and not self._unchanged(start, nbytes):
            return None
        fd = self._open(m)
        return None if fd is None else Span(fd, m.offset + start - m.start)

    def _unchanged(self, start: int, nbytes: int) -> bool:
        """Do the pages of [start, start+nbytes) of a private file mapping still hold the file's bytes? Each is
        either not in memory yet (read from the file when touched) or a page of the file, never an anonymous
        copy. Unknown (no pagemap) counts as changed."""
        import numpy as np

        page = os.sysconf("SC_PAGE_SIZE")
        first, last = start // page, (start + nbytes - 1) // page
        try:
            if self._pagemap is None:
                self._pagemap = os.open(PAGEMAP, os.O_RDONLY)
            raw = os.pread(self._pagemap, (last - first + 1) * 8, first * 8)
        except OSError:
            return False
        entries = np.frombuffer(raw, dtype=np.uint64)
        if len(entries) != last - first + 1:
            return False
        resident = (entries & np.uint64(_PRESENT | _SWAPPED)) != 0
        return bool(np.all(~resident | ((entries & np.uint64(_FILE)) != 0)))

    def _lookup(self, address: int) -> Mapping | None:
        i = bisect.bisect_right(self._starts, address) - 1
        if i >= 0 and address < self._mappings[i].end:
            return self._mappings[i]
        return None

    def _refresh(self) -> None:
        self._read_at = time.monotonic()
        self.refreshes += 1
        try:
            with open(MAPS) as f:
                lines = f.read().splitlines()
        except OSError:
            return
        mappings = []
        for line in lines:
            fields = line.split(maxsplit=5)
            if len(fields) < 5:
                continue
            lo, hi = fields[0].split("-")
            mappings.append(Mapping(int(lo, 16), int(hi, 16), int(fields[2], 16), fields[1].endswith("p"),
                                    int(fields[4]), fields[5] if len(fields) > 5 else ""))
        mappings.sort(key=lambda m: m.start)
        self._mappings, self._starts = mappings, [m.start for m in mappings]

    def _open(self, m: Mapping) -> int | None:
        key = (m.path, m.inode)
        if key not in self._fds:
            try:
                fd = os.open(m.path, os.O_RDONLY)
            except OSError:  # deleted or renamed since it was mapped (the table then says "(deleted)")
                fd = None
            if fd is not None and os.fstat(fd).st_ino != m.inode:
                os.close(fd)
                fd = None
            self._fds[key] = fd
        return self._fds[key]

    def close(self) -> None:
        for fd in [*self._fds.values(), self._pagemap]:
            if fd is not None:
                os.close(fd)
        self._fds.clear()
        self._pagemap = None
