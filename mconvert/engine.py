"""Loader -> IR -> saver as a plain function call, with all-or-nothing output.

The saver writes into a fresh staging directory beside the destination; only when it has finished and every
file is synced to disk is the staging directory renamed into place. A failure (or Ctrl-C) removes the staging
directory, so the destination either holds a complete checkpoint or is left as it was.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mconvert import workers
from mconvert.errors import ConvertError
from mconvert.formats import hf_dir
from mconvert.ir import ModelIR
from mconvert.options import Options
from mconvert.progress import QUIET, Progress
from mconvert.registry import Plugin, detect_loader, get_loader, get_saver


@dataclass(frozen=True)
class Summary:
    seconds: float
    bytes_written: int
    files: int
    ir: ModelIR


def check_destination(src: Path, dst: Path, force: bool) -> None:
    """Refuse to touch an existing output without --force, and never write into the source."""
    src_r, dst_r = src.resolve(), dst.resolve()
    if dst_r == src_r or src_r in dst_r.parents or dst_r in src_r.parents:
        raise ConvertError(f"--save-dir {dst} overlaps --load-dir {src}; choose a separate directory")
    if dst.exists() and not dst.is_dir():
        raise ConvertError(f"--save-dir {dst} exists and is not a directory")
    if dst.is_dir() and any(dst.iterdir()) and not force:
        raise ConvertError(f"--save-dir {dst} already exists and is not empty; pass --force to replace it")


@contextmanager
def staged_output(dst: Path) -> Iterator[Path]:
    """A staging directory that becomes `dst` only if the block succeeds (replacing an old `dst`)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    try:
        yield staging
        _sync_tree(staging)
        if dst.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
            os.replace(dst, old / dst.name)
            os.replace(staging, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _sync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*"), reverse=True):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def tree_size(root: Path) -> tuple[int, int]:
    files = [p for p in root.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def resolve_source(path: Path | str) -> Path:
    """The checkpoint location: an existing path, or a hub id (`org/name`) found in the local HF cache."""
    if Path(path).exists():
        return Path(path)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", str(path)):
        return hf_dir.resolve(path)  # a clear error when the id is not in the cache
    raise ConvertError(f"{path}: no such file or directory")


def resolve_loader(name: str | None, path: Path) -> Plugin:
    return get_loader(name) if name else detect_loader(resolve_source(path))


def load(path: Path, options: Options, loader: str | None = None) -> ModelIR:
    """Read any checkpoint into the IR (format detected when `loader` is None), checked against its config."""
    path = resolve_source(path)
    plugin = resolve_loader(loader, path)
    ir = plugin.func(path, options)
    ir.check()
    if options.dtype:  # every tensor: a checkpoint may mix dtypes (bf16 weights, fp32 norms)
        ir = ir.cast(options.dtype)
    return ir


def save(ir: ModelIR, dst: Path, options: Options, saver: str, progress: Progress = QUIET) -> None:
    """Write `ir` with `saver` into `dst`, all or nothing (the caller has checked the destination)."""
    plugin = get_saver(saver)
    with workers.shared_staging(dst, staged_output) as staging:  # under torchrun, one directory for every rank
        plugin.func(ir, staging, options, progress)


def convert(src: Path, dst: Path, *, loader: str | None, saver: str, options: Options, force: bool = False,
            progress: Progress = QUIET) -> Summary:
    """Convert the checkpoint at `src` into `saver`'s format at `dst`."""
    start = time.perf_counter()
    get_saver(saver)  # an unknown saver fails before any reading
    check_destination(src, dst, force)
    ir = load(src, options, loader)
    save(ir, dst, options, saver, progress)
    written, files = tree_size(dst)
    return Summary(time.perf_counter() - start, written, files, ir)
