"""Start writing a file's pages to disk while the file is still being written.

Written data waits in the page cache until the kernel writes it back: when dirty pages pass a share of memory,
or at fsync. A converter that syncs its output at the end (all-or-nothing output must be on disk before it is
moved into place) would then wait for every byte at the end, the disk idle until then. Asking Linux to start
the write-back of each finished stretch (`sync_file_range(SYNC_FILE_RANGE_WRITE)`, which queues the I/O and
does not wait for it) keeps the disk busy while the next bytes are prepared, and the final fsync finds little
left to do. Elsewhere (or if the call is missing) this does nothing.
"""

from __future__ import annotations

import ctypes
import functools

STRETCH = 32 << 20  # bytes between requests: large sequential I/O, few calls
_SYNC_FILE_RANGE_WRITE = 2


@functools.cache
def _sync_file_range():
    try:
        func = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    func.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    func.restype = ctypes.c_int
    return func


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Queue bytes [offset, offset+nbytes) of `fd` for writing to disk (no wait; errors show at fsync)."""
    func = _sync_file_range()
    if func is not None and nbytes > 0:
        func(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


class Writeback:
    """Follows a file written front to back: `advance(position)` queues each finished `STRETCH` for disk."""

    def __init__(self, fd: int, start: int = 0) -> None:
        self.fd, self.done = fd, start

    def advance(self, position: int) -> None:
        if position - self.done >= STRETCH:
            start_writeback(self.fd, self.done, position - self.done)
            self.done = position
