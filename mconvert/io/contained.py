"""Every file a checkpoint names stays inside the checkpoint.

A checkpoint is untrusted input, and so are the paths written in it: an index's `weight_map`, a DCP
`relative_path`, a tracker file, a `latest` file or a path in Megatron's `args` can say `../../.ssh/id_rsa` or
`/etc/shadow`, and any file of the directory can be a symbolic link to such a place. Reading one would copy a
stranger's choice of file into the output (tokenizer files are copied verbatim). So:

- `inside(root, name)`: a path named by a checkpoint's contents must resolve (symbolic links followed) to a
  place under `root`, else an error naming the entry;
- `check_tree(root)`: before anything is read, every symbolic link under `root` must lead inside it, and every
  entry must be a regular file or a directory (a FIFO would block a reader forever).

A Hugging Face cache is the one legitimate user of outward links: each file of a snapshot links to the
repository's blob store,

    models--org--name/snapshots/<revision>/config.json -> ../../blobs/<sha256>

so a root that is such a snapshot may reach anything inside its `models--org--name` folder, and nothing else.

Checks and reads are apart in time: a link planted after `check_tree` looked would be followed by a later plain
`open`. Files copied verbatim (tokenizer files, the last thing a conversion writes) are therefore opened by
`open_inside`, which checks the file actually opened, not the path it looked at before.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path
from typing import BinaryIO

from mconvert.errors import ConvertError

_HF_REPO = re.compile(r"(models|datasets|spaces)--.+")


def real_path(path: Path | str) -> Path:
    """`path` with every symbolic link followed; a loop of links is refused naming the path (Python raises a
    RuntimeError for it, or an OSError from the system)."""
    try:
        return Path(path).resolve()
    except (RuntimeError, OSError) as e:
        reason = "a loop of symbolic links" if isinstance(e, RuntimeError) or e.errno == errno.ELOOP else e.strerror
        raise ConvertError(f"{path}: cannot follow it: {reason}") from None


def scope(root: Path | str) -> Path:
    """The real directory that `root`'s files may resolve into (the repository folder for a HF cache snapshot)."""
    real = real_path(root)
    if real.parent.name == "snapshots" and _HF_REPO.fullmatch(real.parent.parent.name):
        return real.parent.parent
    return real


def _within(path: Path, bound: Path) -> bool:
    return path == bound or bound in path.parents


def inside(root: Path | str, name: str | os.PathLike, what: str = "file") -> Path:
    """`root / name`, provided it resolves inside `root`'s scope; `what` names the entry in the error."""
    root = Path(root)
    path = root / name
    real, bound = real_path(path), scope(root)
    if not _within(real, bound):
        raise ConvertError(f"{root}: {what} {str(name)!r} resolves to {real}, outside the checkpoint directory "
                           f"{bound}; refusing to read it (a checkpoint may only name its own files)")
    return path


def check_tree(root: Path | str) -> None:
    """Refuse a checkpoint holding a link that leads out of it, or anything but regular files and directories.

    Only looks (lstat); reads nothing. A link inside the tree that points elsewhere inside it is fine.
    """
    root = Path(root)
    bound = scope(root)
    top = real_path(root)
    if not top.is_dir():
        return
    for here, dirs, files in os.walk(top):
        for name in dirs + files:
            path = Path(here) / name
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode):
                target = real_path(path)
                if not _within(target, bound):
                    raise ConvertError(f"{root}: {path.relative_to(top)} is a symbolic link to {target}, outside the "
                                       "checkpoint directory; refusing to read it (copy the file in if you trust "
                                       "it)")
                if not (target.is_file() or target.is_dir()) and target.exists():
                    raise ConvertError(f"{root}: {path.relative_to(top)} links to {target}, which is not a regular "
                                       "file or directory")
            elif not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise ConvertError(f"{root}: {path.relative_to(top)} is not a regular file or directory (a FIFO, "
                                   "socket or device); refusing to read the checkpoint")


def open_inside(path: Path | str, root: Path | str | None = None) -> BinaryIO:
    """`path` opened for reading, provided what is opened is a regular file inside `root`'s scope (default: the
    directory holding `path`), checked at the moment of opening: a link at its name is not followed (O_NOFOLLOW)
    unless it leads inside the scope (a HF cache snapshot's links), and on Linux the real path of the opened file
    is checked too, so a directory swapped in between is caught as well."""
    path = Path(path)
    root = Path(root) if root is not None else path.parent
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)  # NONBLOCK: a FIFO fails
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        target = inside(root, os.path.relpath(path, root), "file").resolve()  # the link, checked now
        fd = os.open(target, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConvertError(f"{path}: not a regular file; refusing to copy it")
        opened = _opened_path(fd)
        if opened is not None and not _within(opened, scope(root)):
            raise ConvertError(f"{root}: {path.name} opened {opened}, outside the checkpoint directory "
                               f"{scope(root)} (a link planted after the checkpoint was checked?); refusing it")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _opened_path(fd: int) -> Path | None:
    """The real path of an open file (Linux's /proc/self/fd), or None where it cannot be told."""
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return None
