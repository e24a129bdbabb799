"""Counting the bytes a conversion sends from its source files rather than from memory: `copy_file_range`, or
`preadv` into the writer's buffer where the output lies otherwise within a page (mconvert.io.block_writer)."""

from __future__ import annotations

import os


def count_file_sends(monkeypatch) -> list[int]:
    """Patch both ways of sending a file's bytes; returns the list each call appends its byte count to."""
    counts: list[int] = []
    for name in ("copy_file_range", "preadv"):
        real = getattr(os, name)

        def counting(*args, _real=real):
            n = _real(*args)
            counts.append(n)
            return n

        monkeypatch.setattr(os, name, counting)
    return counts
