"""Where a writer puts a tensor's bytes so that they lie page-congruent with their source.

On a file system that can copy without the CPU (`mconvert.io.block_writer.copies_offloaded`: XFS and btrfs share
blocks, NFS, SMB and Ceph copy on the server), `mconvert.io.block_writer` sends parts with provenance (`FileBytes`)
by `copy_file_range` where the output offset equals the source offset modulo PAGE (block sharing needs both on a
block boundary: a source on one puts its copy on one); elsewhere the parts are read and written, at any offset. On
ext4 an unequal copy_file_range also costs about half as much again as an equal one (docs/performance.md). A
writer free to pad before a tensor's data (a zip record's extra field, a gap before a DCP item) asks `gap` for
the padding that makes the most copied bytes congruent:

    source  .....|....[ q rows, 2 MiB ]....|.....        source offset s, part at offset r inside the tensor
    output  ..hdr|<gap>[ tensor data: ... q rows ...]     data at d + gap, so d + gap + r = s (mod PAGE)

Only parts the block writer copies count (a source and at least `SPAN_MIN` bytes), weighted by their bytes; the
choice depends on the tensor alone (not on timing, workers or whether the kernel can copy), so the byte path and
the torch path, and any number of workers, put the bytes at the same offsets.
"""

from __future__ import annotations

from mconvert.io.block_writer import PAGE, SPAN_MIN
from mconvert.ir.blocks import Blocks, ByteBlocks


def copied_runs(blocks: Blocks | ByteBlocks) -> list[tuple[int, int, int]]:
    """(offset in the tensor's bytes, offset in its source file, bytes) of each part copied file to file."""
    runs, at = [], 0
    for i, part in enumerate(blocks.parts):
        source = blocks.source(i)
        if source is not None and part.nbytes >= SPAN_MIN:
            runs.append((at, source.offset, part.nbytes))
        at += part.nbytes
    return runs


def votes(blocks: Blocks | ByteBlocks, start: int, into: dict[int, int] | None = None) -> dict[int, int]:
    """For the tensor's data at file offset `start` + g: the bytes each padding g (mod PAGE) makes congruent,
    added to `into`."""
    into = {} if into is None else into
    for at, source, nbytes in copied_runs(blocks):
        g = (source - at - start) % PAGE
        into[g] = into.get(g, 0) + nbytes
    return into


def best(found: dict[int, int], step: int = 1) -> int | None:
    """The padding among `found` (a multiple of `step`) that makes the most bytes congruent, the least on a tie."""
    fits = [g for g in found if g % step == 0]
    return max(fits, key=lambda g: (found[g], -g)) if fits else None


def gap(blocks: Blocks | ByteBlocks, start: int, step: int = 1) -> int | None:
    """The padding (a multiple of `step` below PAGE) to put before the tensor's data at file offset `start`: the
    one making the most copied bytes page-congruent with their sources; for a tensor of SPAN_MIN bytes or more
    none of whose bytes can be (computed, or sources at offsets `step` cannot reach), the one starting it on a
    page, where the next conversion's copies from it can be; else None (no padding beyond the format's own)."""
    found = best(votes(blocks, start), step)
    if found is None and blocks.nbytes >= SPAN_MIN and (-start % PAGE) % step == 0:
        found = -start % PAGE
    return found
