"""Counting the bytes a conversion sends from its source files rather than from memory: `copy_file_range`, or
`preadv` into the writer's buffer where the output lies otherwise within a page (mconvert.io.block_writer)."""

from __future__ import annotations

import os


def count_file_sends(monkeypatch) -> dict[str, list[int]]:
    """Patch both ways of sending a file's bytes; returns, for each, the list its calls append their byte counts to
    ("copy_file_range", "preadv")."""
    counts: dict[str, list[int]] = {"copy_file_range": [], "preadv": []}
    for name, calls in counts.items():
        real = getattr(os, name)

        def counting(*args, _real=real, _calls=calls):
            n = _real(*args)
            _calls.append(n)
            return n

        monkeypatch.setattr(os, name, counting)
    return counts
