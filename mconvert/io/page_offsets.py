"""Where a writer puts a tensor's bytes so that the kernel copies them page for page from their source.

`mconvert.io.block_writer` copies parts with provenance (`FileBytes`) file to file with `copy_file_range`. On this
project's ext4 that costs about 0.5-0.6 s of system time per 2.2 GB when each destination offset equals its
source offset modulo the page size, and 0.8-0.9 s when they differ (docs/performance.md): an unequal copy touches
two destination pages per source page. A writer free to pad before a tensor's data (a zip record's extra field, a
gap before a DCP item) asks `gap` for the padding that makes the most copied bytes congruent:

    source  .....|....[ q rows, 2 MiB ]....|.....        source offset s, part at offset r inside the tensor
    output  ..hdr|<gap>[ tensor data: ... q rows ...]     data at d + gap, so d + gap + r = s (mod PAGE)

Only parts the block writer copies count (a source and at least `SPAN_MIN` bytes), weighted by their bytes; the
choice depends on the tensor alone (not on timing, workers or whether the kernel can copy), so the byte path and
the torch path, and any number of workers, put the bytes at the same offsets.
"""

from __future__ import annotations

from mconvert.io.block_writer import SPAN_MIN
from mconvert.ir.blocks import Blocks, ByteBlocks

PAGE = 4096


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
