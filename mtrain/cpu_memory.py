"""Keep freed CPU memory in the process for reuse (`train.cpu_malloc: keep`, the default on a CPU).

PyTorch allocates CPU tensors with the C library's malloc. glibc serves large blocks (its threshold rises to at
most 32 MiB) with fresh mmap()s and unmaps them at free, and gives the top of its heap back to the system when
more than a threshold is free there. A training step frees its activations and gradients at the end and
allocates them again at the next, so every step pays a page fault and a zeroed page for each 4 KiB of them: on
the bench's small Llama (bench/train_peers.py) about 35,000 faults and 50 ms of system time per step, several
percent of the step. GPU trainers never see this: PyTorch's CUDA caching allocator keeps freed blocks.

`keep_freed_memory()` makes glibc do the same on the CPU: no mmap() for large blocks (they come from the heap)
and no trimming of the heap, so freed blocks are reused by the next step without faults. The cost: memory freed
during the run is not returned to the system before the process ends (its resident size stays at its peak, as
a GPU's reserved memory does). It is a setting of the whole process, made once; elsewhere than glibc nothing is
changed.
"""

from __future__ import annotations

import ctypes
import sys

# glibc's mallopt() parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Tell glibc's malloc never to mmap large blocks nor to trim its heap; False where that is not possible."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only: musl's mallopt does nothing
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # -1 disables trimming (mallopt(3)); M_MMAP_MAX 0 serves large blocks from the heap (a thread arena still maps
    # what its heap cannot hold).
    return bool(mallopt(M_TRIM_THRESHOLD, -1)) and bool(mallopt(M_MMAP_MAX, 0))
