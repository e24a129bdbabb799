"""Where one conversion's CPU goes: the thread CPU seconds spent in each system call and step that moves bytes,
beside the process total, from inside one `mconvert` run.

    python bench/cpu_split.py [--rounds 3] [--drop-caches] [--tmp DIR] SOURCE -- --saver core --tp 2 --pp 2 --workers 1

Each round reads SOURCE once (untimed; with --drop-caches, as root, after emptying the page cache, so the kernel
finds free memory), then runs the conversion in a fresh process with the functions below wrapped: each adds the
CPU time of the thread that calls it (`time.thread_time`: user + system, whatever the neighbours do) to its line.
Nested calls of one line count once. Not a profiler: nothing outside these lines is attributed, and the wrapping
itself costs a few microseconds per call (a few thousand calls per conversion). Lines overlap where one step holds
another (`Sender.send` holds `copy_file_range`, `preadv`, `pwrite`, `crc32` and `sync_file_range`; what it spends beyond
them is gathering strided rows into its scratch buffer and its own Python). The output goes to a temporary
directory (--tmp, default the system's; on SOURCE's file system, as outputs usually are), deleted after
each round; medians over the rounds are printed.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import convert as bench_convert  # noqa: E402  (bench/ is not a package: its warm() and --drop-caches)

_spent: dict[str, float] = collections.defaultdict(float)
_calls: collections.Counter = collections.Counter()
_inside = threading.local()
_order: list[str] = []  # the lines, in the order printed


def _wrap(owner, attr: str, label: str) -> None:
    func = getattr(owner, attr, None)
    if func is None:
        raise SystemExit(f"{owner.__name__}.{attr} is gone: update bench/cpu_split.py's lines")
    _order.append(label)

    @functools.wraps(func)
    def timed(*args, **kwargs):
        if getattr(_inside, label, False):
            return func(*args, **kwargs)
        setattr(_inside, label, True)
        start = time.thread_time()
        try:
            return func(*args, **kwargs)
        finally:
            _spent[label] += time.thread_time() - start
            _calls[label] += 1
            setattr(_inside, label, False)

    setattr(owner, attr, timed)


def instrument() -> None:
    """Wrap the lines (imported here: their import time is in "start-up imports")."""
    import mconvert.engine as engine
    import mconvert.io.block_writer as block_writer
    import mconvert.io.torch_zip as torch_zip
    import mconvert.io.writeback as writeback
    import mconvert.lazy as lazy
    import mconvert.registry as registry
    import mconvert.rules.row_plan as row_plan
    import mconvert.workers as workers

    lines = [
        (block_writer.os, "copy_file_range", "copy_file_range (kernel copy, file to file)"),
        (block_writer.os, "preadv", "preadv (read into the staging buffer)"),
        (block_writer.os, "pwrite", "pwrite (written from memory or the staging buffer)"),
        (block_writer, "crc32", "CRC-32 of zip records (reads the source map or the staging buffer)"),
        (writeback, "start_writeback", "sync_file_range (early writeback)"),
        (workers, "fsync_path", "fsync of finished files"),
        (block_writer.Sender, "send", "Sender.send (all of the above but fsync, + gathering)"),
        (torch_zip._Pickler, "dump", "pickling rank files' objects"),
        (row_plan.RowPlanner, "forward_bytes", "byte plans applied (views, joins)"),
        (registry, "_load_plugins", "plugin modules imported"),
        (lazy, "_import_long_lived", "numpy imported"),
        (engine, "load", "loader (headers, mapping)"),
    ]
    for owner, attr, label in lines:
        _wrap(owner, attr, label)


def one(convert_args: list[str], source: Path, out: Path) -> None:
    """One instrumented conversion in this process; prints its figures as one JSON line."""
    start = time.process_time()
    from mconvert.cli import main as mconvert_main
    instrument()
    spent = {"start-up imports (mconvert.cli)": time.process_time() - start}
    sys.argv = ["mconvert", "--quiet", "--force", *convert_args, "--load-dir", str(source), "--save-dir", str(out)]
    try:
        mconvert_main()
    except SystemExit as e:
        if e.code:
            raise
    spent = {"process CPU after the interpreter started": time.process_time(), **spent,
             **{label: _spent.get(label, 0.0) for label in _order}}
    print(json.dumps({"spent": spent, "calls": dict(_calls)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--drop-caches", action="store_true", help="empty the page cache before each round (root)")
    parser.add_argument("--tmp", type=Path, default=None, help="where outputs go (default: the system's temp dir)")
    parser.add_argument("--one", type=Path, default=None, help=argparse.SUPPRESS)  # a round's own process
    parser.add_argument("source", type=Path)
    parser.add_argument("args", nargs=argparse.REMAINDER, help="mconvert's arguments, after --")
    args = parser.parse_args()
    convert_args = [a for a in args.args if a != "--"]
    if args.one is not None:
        one(convert_args, args.source, args.one)
        return
    bench_convert.drop_caches = args.drop_caches
    rounds = []
    for r in range(args.rounds):
        out = Path(tempfile.mkdtemp(prefix="cpu-split-", dir=args.tmp))
        try:
            bench_convert.warm(args.source)
            done = subprocess.run([sys.executable, __file__, "--one", str(out / "out"), str(args.source), "--",
                                   *convert_args], check=True, capture_output=True, text=True)
        except subprocess.CalledProcessError as e:
            raise SystemExit(f"round {r + 1} failed:\n{e.stderr}") from None
        finally:
            shutil.rmtree(out, ignore_errors=True)
        rounds.append(json.loads(done.stdout.strip().splitlines()[-1]))
        total = rounds[-1]["spent"]["process CPU after the interpreter started"]
        print(f"round {r + 1}/{args.rounds}: {total:.2f} s of process CPU (load average {os.getloadavg()[0]:.1f})",
              flush=True)
    print(f"\nmedians over {args.rounds} rounds, thread CPU seconds (calls per run):")
    for label in rounds[0]["spent"]:
        value = statistics.median(r["spent"].get(label, 0.0) for r in rounds)
        calls = rounds[-1]["calls"].get(label)
        print(f"  {value:7.3f} s  {'' if calls is None else f'{calls}x':>7}  {label}")


if __name__ == "__main__":
    main()
