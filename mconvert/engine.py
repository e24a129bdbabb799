"""Loader -> IR -> saver as a plain function call, with all-or-nothing output.

The saver writes into a fresh staging directory beside the destination; only when it has finished and every
file is synced to disk is the staging directory renamed into place. A failure (or Ctrl-C) removes the staging
directory, so the destination either holds a complete checkpoint or is left as it was.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mconvert import staging, workers
from mconvert.errors import ConvertError
from mconvert.io import contained, hf_dir
from mconvert.ir.adapter import merged
from mconvert.ir.tensors import ModelIR
from mconvert.options import Options
from mconvert.progress import QUIET, Progress
from mconvert.registry import Plugin, detect_loader, get_adapter, get_loader, get_saver


@dataclass(frozen=True)
class Summary:
    seconds: float
    bytes_written: int
    files: int
    ir: ModelIR


def check_destination(src: Path, dst: Path, force: bool) -> staging.Replace:
    """Refuse to touch an existing output without --force, never write into the source or replace the current
    directory, and fail now (before reading the source) when the output cannot be created. Returns what the
    final rename may replace (what was checked here: see `staging.move_into_place`)."""
    src_r, dst_r = contained.real_path(src), contained.real_path(dst)
    if dst_r == src_r or src_r in dst_r.parents or dst_r in src_r.parents:
        raise ConvertError(f"--save-dir {dst} overlaps --load-dir {src}; choose a separate directory")
    cwd = Path.cwd().resolve()
    if dst_r == cwd or dst_r in cwd.parents:
        raise ConvertError(f"--save-dir {dst} is the current directory or holds it; the output directory is created "
                           "(or replaced) whole, so name a new one, e.g. --save-dir converted")
    if dst.exists() and not dst.is_dir():
        raise ConvertError(f"--save-dir {dst} exists and is not a directory")
    if dst.is_dir() and any(dst.iterdir()) and not force:
        raise ConvertError(f"--save-dir {dst} already exists and is not empty; pass --force to replace it")
    staging.check_writable(dst_r)
    return "anything" if force else "empty" if dst.is_dir() else "nothing"


@contextmanager
def staged_output(dst: Path, replace: staging.Replace = "nothing") -> Iterator[Path]:
    """A staging directory that becomes `dst` only if the block succeeds, replacing only what `replace` allows;
    on any failure or interruption (SIGINT, SIGTERM) nothing is left behind, not even the parent directories it
    created."""
    dst = dst.absolute()
    created = staging.make_parents(dst.parent)
    staging.remove_stale(dst.parent)
    made: list[Path] = []  # the staging directory, listed before it exists (see staging.make_dir)
    committing = False
    with staging.terminating_raises():
        try:
            work = staging.make_dir(dst.parent, dst.name, into=made)
            yield work
            _sync_tree(work)
            committing = True
            staging.move_into_place(work, dst, replace)
        except (KeyboardInterrupt, staging.Interrupted) as e:
            if committing and not os.path.lexists(work):  # the signal came just after the rename: say so
                signum = e.signum if isinstance(e, staging.Interrupted) else signal.SIGINT
                raise staging.Interrupted(signum, complete=dst) from None
            _discard(made, created)
            raise
        except BaseException:
            _discard(made, created)
            raise


def _discard(made: list[Path], created: list[Path]) -> None:
    for path in made:
        staging.remove(path)
    staging.remove_empty(created)


def _sync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*"), reverse=True):
        staging.fsync_path(path)


def tree_size(root: Path) -> tuple[int, int]:
    files = [p for p in root.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def resolve_source(path: Path | str) -> Path:
    """The checkpoint location: an existing path, or a hub id (`org/name`) found in the local HF cache; checked
    to hold no link leading out of it (see mconvert.io.contained) before any reader opens a file."""
    if Path(path).exists():
        found = Path(path)
    elif re.fullmatch(r"[\w.-]+/[\w.-]+", str(path)):
        found = hf_dir.resolve(path)  # a clear error when the id is not in the cache
    else:
        raise ConvertError(f"{path}: no such file or directory")
    contained.check_tree(found)
    return found


def resolve_loader(name: str | None, path: Path) -> Plugin:
    return get_loader(name) if name else detect_loader(resolve_source(path))


def load(path: Path, options: Options, loader: str | None = None) -> ModelIR:
    """Read any checkpoint into the IR (format detected when `loader` is None), checked against its config."""
    path = resolve_source(path)
    plugin = resolve_loader(loader, path)
    ir = plugin.func(path, options)
    ir.check()
    if options.training_state:
        if options.skip_mtp:
            raise ConvertError("--skip-mtp and --training-state: a run resumes with the modules it trained (their "
                               "optimizer state included); give one of them")
        if ir.training is None:
            raise ConvertError(f"{path}: --training-state: loader {plugin.name} ({ir.source.format}) reads no "
                               "training state from this checkpoint; it is read from core torch and torch_dist "
                               "checkpoints and mtrain runs")
        ir.training.check(ir.tensors, str(path))
    if options.merge_adapter is not None:  # checked against the base's names and shapes, merged lazily
        if options.training_state:
            raise ConvertError("--merge-adapter and --training-state: the optimizer state belongs to the weights "
                               "before the merge; give one of them")
        contained.check_tree(Path(options.merge_adapter))  # held to its directory, as a checkpoint is
        adapter = get_adapter("peft").func(Path(options.merge_adapter), ir)
        ir = merged(ir, adapter, f"--merge-adapter {options.merge_adapter}")
    if options.skip_mtp:
        ir = ir.without_mtp()
    if options.dtype:  # every tensor: a checkpoint may mix dtypes (bf16 weights, fp32 norms)
        ir = ir.cast(options.dtype)
    return ir


def save(ir: ModelIR, dst: Path, options: Options, saver: str, progress: Progress = QUIET,
         check: Callable[[Path], None] | None = None, replace: staging.Replace = "nothing") -> None:
    """Write `ir` with `saver` into `dst`, all or nothing (the caller has checked the destination: `replace` is
    what it found there, see `check_destination`). `check` runs on the complete output before it is moved into
    place (e.g. `--verify`); if it raises, nothing is left."""
    plugin = get_saver(saver)
    if options.training_state and "training_state" not in plugin.options:
        raise ConvertError(f"--training-state: saver {plugin.name} writes no training state")
    options = options if options.final_dir else dataclasses.replace(options, final_dir=Path(dst).resolve())
    try:
        staged = functools.partial(staged_output, replace=replace)
        with workers.shared_staging(dst, staged) as work:  # under torchrun, one directory for every rank
            plugin.func(ir, work, options, progress)
            if check is not None and workers.team().leader:  # a failure here fails every rank
                check(work)
    except OSError as e:  # disk full, quota, I/O error (writing, or reading the source): staging is gone already
        where = f" ({e.filename})" if e.filename else ""
        raise ConvertError(f"converting into {dst} failed: {e.strerror or e}{where}; nothing was left behind") from None


def convert(src: Path, dst: Path, *, loader: str | None, saver: str, options: Options, force: bool = False,
            progress: Progress = QUIET, check: Callable[[Path], None] | None = None) -> Summary:
    """Convert the checkpoint at `src` into `saver`'s format at `dst` (`check`: see `save`)."""
    start = time.perf_counter()
    get_saver(saver)  # an unknown saver fails before any reading
    replace = check_destination(src, dst, force)
    if options.tokenizer:  # its files are copied verbatim, held to its directory as a checkpoint's: say so now
        contained.check_tree(options.tokenizer)
    ir = load(src, options, loader)
    save(ir, dst, options, saver, progress, check, replace)
    written, files = tree_size(dst)
    return Summary(time.perf_counter() - start, written, files, ir)
