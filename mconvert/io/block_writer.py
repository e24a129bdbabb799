"""Sending `Blocks` (see mconvert.ir.blocks) to a file: copied file to file where the bytes are a checkpoint's on disk,
written from memory otherwise, a MiB at a time, with the CRC-32 that zip records need when asked.

    part with provenance (FileBytes), >= SPAN_MIN,  copy_file_range(source, out), on a file system that can copy
      at the same offset within a page as its source  without the CPU (XFS, btrfs, NFS...: `copies_offloaded`)
    other part with provenance, >= READ_MIN          read from the source (pread) into a buffer that lies within
                                                     a page as the output does, then written
    other contiguous part                            write() straight from its memory
    strided part (a row-parallel piece)              copied WRITE_SIZE bytes at a time into a reused scratch
                                                     buffer, then written (no buffer the size of the piece)

Parts are torch tensors (`Blocks`) or numpy arrays (`ByteBlocks`, the byte path: no torch), handled alike.

Why reading and writing rather than copy_file_range (measured on ext4, Linux 6.18, docs/performance.md): on a
file system that cannot share or offload the copy, copy_file_range is the kernel's own read and write through a
pipe. Of a 2.2 GB file it cost 0.50-0.65 s of CPU where each output offset lies at the same place within a page
as its source and 0.79-0.90 s where it does not, against 0.57-0.71 s for reading 1 MiB at a time into a buffer
that lies as the output does and writing it; in whole conversions reading and writing cost the same or
less in every case tried, also at equal offsets (the CRC-32 is then taken from that buffer, not the source's map).
Where the file system can copy without the CPU (reflinks, server-side copies), copy_file_range is kept for the
parts placed page-congruent with their sources (`mconvert.io.page_offsets`). Writing straight from a file's map was
dearer than reading first in 256 KiB writes (0.62-1.54 against 0.37-0.39 s per GB) and cheaper in 64 KiB writes
(0.49-0.52 against 0.54-0.59 s).

Provenance is the loader's word that a part shows a file's bytes unchanged (see `mconvert.ir.blocks.FileBytes`);
nothing asks the kernel where memory came from. The source file is opened again by path and used only if it is
still the file the loader mapped (device, inode, size, modification time), else the bytes are written from
memory; if the kernel refuses a copy (another file system on an old kernel), that part is written from memory and
later ones are read and written.

Writes go to explicit offsets (pwrite), so several writers can fill one file at once (safetensors ranges), and
each finished stretch is queued for disk early (`mconvert.io.writeback`). Writers of one file take turns at the
kernel (`file_turn`): a buffered write holds the file's inode lock, which a second writer would otherwise wait for
by spinning in the kernel (15% of a two-worker torch_dist -> HF conversion's CPU, measured with perf), while a
Python lock waits asleep; what comes before the write (CRC-32, gathering a strided part) still runs in parallel.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from mconvert.errors import ConvertError
from mconvert.io.writeback import Writeback
from mconvert.ir.blocks import Blocks, ByteBlocks, FileBytes
from mconvert.lazy import np, torch

try:  # ISA-L's CRC-32 (the very same checksum) runs about 6x faster than zlib's
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - the `isal` wheel is a dependency; zlib's is only slower
    from zlib import crc32

# Bytes per write (and per copy_file_range call): few system calls, and small enough to stay in the CPU caches.
# 8 MiB cost 0.6-0.9 s more system time per 2.2 GB than 1 MiB; 256 KiB 0.2-0.5 s more CPU (docs/performance.md).
WRITE_SIZE = 1 << 20
SPAN_MIN = 1 << 20  # below this a copy_file_range call costs more than reading and writing
READ_MIN = 1 << 18  # below this writing straight from the source's map costs less than reading it first
PAGE = 4096  # what offsets are compared modulo: the usual page and file system block (also on 64 KiB-page kernels)


class Sender:
    """Writes blocks into files; holds one thread's scratch buffer and open source files (`close` them)."""

    def __init__(self) -> None:
        self._fds: dict[tuple[str, tuple[int, int, int, int]], int | None] = {}
        self._scratch = None  # reused for strided parts: a torch or a numpy byte buffer, made when first needed
        self._staging: bytearray | None = None  # read into, then written: `_read_write`
        self._copy_files = hasattr(os, "copy_file_range")
        self.copied = self.written = 0  # bytes sent from their source file (copied or read), and from memory

    def send(self, blocks: Blocks | ByteBlocks, fd: int, position: int, *, crc: int | None = None,
             writeback: Writeback | None = None) -> tuple[int, int | None]:
        """Write `blocks` into `fd` at `position`; returns the end position and the CRC-32 continued from `crc`
        (None: not computed)."""
        turn = file_turn(fd)
        for i, part in enumerate(blocks.parts):
            span = self._span(part, blocks.source(i))
            if span is not None and not (self._copy_files and part.nbytes >= SPAN_MIN
                                         and (span.offset - position) % PAGE == 0 and copies_offloaded(fd)):
                position, crc = self._read_write(span, part.nbytes, fd, position, crc, turn, writeback)
                continue
            for buffer in self._buffers(part):
                if crc is not None:
                    crc = crc32(buffer, crc)
                with turn:
                    if span is not None:
                        span = self._copy(span, fd, position, len(buffer))
                    if span is None:
                        pwrite_all(fd, buffer, position)
                if span is None:
                    self.written += len(buffer)
                else:
                    self.copied += len(buffer)
                position += len(buffer)
                if writeback is not None:
                    writeback.advance(position)
        return position, crc

    def _read_write(self, span: Span, nbytes: int, fd: int, position: int, crc: int | None, turn: threading.Lock,
                    writeback: Writeback | None) -> tuple[int, int | None]:
        """Send `nbytes` at `span` to `position`: read a MiB at a time into a buffer placed at the destination's
        offset within a page, then written (the CRC taken from the buffer, not from the source's map)."""
        if self._staging is None:
            self._staging = bytearray(WRITE_SIZE + 2 * PAGE)  # sliced below from a page boundary of its memory
        end = position + nbytes
        source = span.offset
        base = memoryview(self._staging)
        base = base[-ctypes.addressof(ctypes.c_char.from_buffer(self._staging)) % PAGE:]
        while position < end:
            n = min(WRITE_SIZE, end - position)
            start = position % PAGE
            buffer = base[start:start + n]
            got = 0
            while got < n:
                k = os.preadv(span.fd, [buffer[got:]], source + got)
                if k == 0:
                    raise ConvertError(f"{span.path}: the file ended at byte {source + got} while reading "
                                       f"{n - got} more bytes of a tensor the loader had mapped there (was it "
                                       "truncated during the conversion?)")
                got += k
            if crc is not None:
                crc = crc32(buffer, crc)
            with turn:
                pwrite_all(fd, buffer, position)
            self.copied += n
            position, source = position + n, source + n
            if writeback is not None:
                writeback.advance(position)
        return position, crc

    def buffers(self, blocks: Blocks | ByteBlocks) -> Iterator[memoryview]:
        """The bytes `send` writes, in order, as memoryviews (each valid until the next is asked for)."""
        for part in blocks.parts:
            yield from self._buffers(part)

    def close(self) -> None:
        for fd in self._fds.values():
            if fd is not None:
                os.close(fd)
        self._fds.clear()
        self._staging = None  # a bytearray: freed with the last view of it (a failed write's traceback may hold one)

    def _span(self, part, source: FileBytes | None) -> Span | None:
        if source is None or part.nbytes < READ_MIN:
            return None
        key = (source.path, source.identity)
        if key not in self._fds:
            self._fds[key] = _open_same(source)
        fd = self._fds[key]
        return None if fd is None else Span(fd, source.offset, source.path)

    def _copy(self, span: Span, fd: int, position: int, nbytes: int) -> Span | None:
        """Copy `nbytes` at `span` to `position`; the span of what follows, or None if the kernel refused (then
        this buffer and the rest are written from memory)."""
        done = 0
        try:
            while done < nbytes:
                n = os.copy_file_range(span.fd, fd, nbytes - done, span.offset + done, position + done)
                if n == 0:
                    raise OSError("copy_file_range copied nothing (source shorter than its mapping?)")
                done += n
        except OSError:
            self._copy_files = False  # e.g. across file systems on an older kernel: write from memory from now on
            if done:
                raise  # half a buffer copied: cannot happen silently, let the caller see it
            return None
        return Span(span.fd, span.offset + nbytes, span.path)

    def _buffers(self, part) -> Iterator[memoryview]:
        """The part's bytes (a torch tensor's, or a numpy array's of ByteBlocks) as memoryviews of at most
        WRITE_SIZE bytes; a strided part goes through the scratch buffer (each view valid until the next is asked
        for)."""
        if not part.nbytes:
            return
        if isinstance(part, np.ndarray):
            yield from self._numpy_buffers(part)
            return
        if part.is_contiguous():
            view = memoryview(part.reshape(-1).view(torch.uint8).numpy())
            for i in range(0, len(view), WRITE_SIZE):
                yield view[i:i + WRITE_SIZE]
            return
        row_bytes = part[0].numel() * part.element_size()
        step = max(1, WRITE_SIZE // row_bytes)
        for r in range(0, part.shape[0], step):
            rows = part[r:r + step]
            nbytes = rows.numel() * rows.element_size()
            if not isinstance(self._scratch, torch.Tensor) or self._scratch.numel() < nbytes:
                self._scratch = torch.empty(max(nbytes, WRITE_SIZE), dtype=torch.uint8)
            out = self._scratch[:nbytes]
            out.view(rows.dtype).view(rows.shape).copy_(rows)
            yield memoryview(out.numpy())

    def _numpy_buffers(self, part) -> Iterator[memoryview]:
        """`_buffers` of a numpy part, without torch."""
        if part.flags.c_contiguous:
            view = memoryview(part.reshape(-1).view(np.uint8))
            for i in range(0, len(view), WRITE_SIZE):
                yield view[i:i + WRITE_SIZE]
            return
        row_bytes = part[0].nbytes
        step = max(1, WRITE_SIZE // row_bytes)
        for r in range(0, part.shape[0], step):
            rows = part[r:r + step]
            if not isinstance(self._scratch, np.ndarray) or len(self._scratch) < rows.nbytes:
                self._scratch = np.empty(max(rows.nbytes, WRITE_SIZE), dtype=np.uint8)
            out = self._scratch[:rows.nbytes]
            np.copyto(out.view(rows.dtype).reshape(rows.shape), rows)
            yield memoryview(out)


# File systems whose copy_file_range can spare the CPU (statfs magics): XFS and btrfs share blocks (reflinks) where
# both offsets fall on block boundaries, NFS, SMB and Ceph copy on the server. Elsewhere (ext4, tmpfs, overlayfs and
# whatever is not known) it is the kernel's own read and write through a pipe, dearer than ours on ext4
# (docs/performance.md, eighth pass).
_OFFLOADING = {0x58465342: "xfs", 0x9123683E: "btrfs", 0x6969: "nfs", 0xFE534D42: "smb2", 0xFF534D42: "cifs",
               0x00C36400: "ceph"}
_offloaded: dict[int, bool] = {}


def copies_offloaded(fd: int) -> bool:
    """May copy_file_range into the file at `fd` spare the CPU: is it on a file system of `_OFFLOADING`?"""
    dev = os.fstat(fd).st_dev
    if dev not in _offloaded:
        _offloaded[dev] = _fs_magic(fd) in _OFFLOADING
    return _offloaded[dev]


def _fs_magic(fd: int) -> int | None:
    """The file system's type (statfs f_type) of the file at `fd`; None where it cannot be asked."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buffer = ctypes.create_string_buffer(256)  # struct statfs: f_type is its first field, a C long
        if libc.fstatfs(fd, buffer) != 0:
            return None
        return ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF
    except (OSError, AttributeError):
        return None


_turns: dict[tuple[int, int], threading.Lock] = {}
_turns_lock = threading.Lock()


def file_turn(fd: int) -> threading.Lock:
    """The lock that this process's writers of the file open at `fd` hold while they write to it (by device and
    inode: each writer opens the file itself)."""
    st = os.fstat(fd)
    with _turns_lock:
        return _turns.setdefault((st.st_dev, st.st_ino), threading.Lock())


@dataclass(frozen=True)
class Span:
    """An open source file and the offset of the next bytes to copy from it."""

    fd: int
    offset: int
    path: str


def _open_same(source: FileBytes) -> int | None:
    """The source file, opened for reading, if it is still the file the loader mapped; else None."""
    try:
        fd = os.open(source.path, os.O_RDONLY)
    except OSError:  # removed or renamed since
        return None
    if FileBytes.identity_of(os.fstat(fd)) != source.identity:
        os.close(fd)
        return None
    return fd


def pwrite_all(fd: int, buffer: memoryview, position: int) -> int:
    while len(buffer):
        n = os.pwrite(fd, buffer, position)
        buffer, position = buffer[n:], position + n
    return position
