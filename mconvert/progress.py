"""Progress reporting for long work: a byte bar per output group on a terminal, one line per group otherwise."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


class Progress:
    """`with progress.task("stage 0: 2 files", total_bytes) as advance: advance(n)`."""

    def __init__(self, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.bytes_done = 0

    @contextmanager
    def task(self, desc: str, total: int) -> Iterator[Callable[[int], None]]:
        tty = self.enabled and getattr(self.stream, "isatty", lambda: False)()
        bar = None
        if tty:  # tqdm (about 0.1 s of CPU to import) only where a bar is drawn
            from tqdm import tqdm

            bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=self.stream,
                       leave=True, dynamic_ncols=True)

        def advance(n: int) -> None:
            self.bytes_done += n
            if bar is not None:
                bar.update(n)

        try:
            yield advance
        finally:
            if bar is not None:
                bar.close()
        if self.enabled and not tty:
            print(f"  {desc}: {human_bytes(total)}", file=self.stream, flush=True)

    def note(self, text: str) -> None:
        if self.enabled:
            print(text, file=self.stream, flush=True)


QUIET = Progress(enabled=False)
