"""One run per run directory: `checkpoint.dir` is locked while a run trains into it.

Two runs sharing a checkpoint.dir would resume each other's steps and overwrite each other's checkpoints, both
exiting 0. The first run (its rank 0) holds an exclusive `flock` on `{checkpoint.dir}/.mtrain.lock` for as long as
it runs, and writes there who it is (`pid 1234 on host node7, since 2026-01-01T12:00:00Z`); a second run is refused,
naming that holder.

- A lock of a dead process is no lock: the kernel drops a `flock` when its holder exits (kill -9 and crashes
  included), so there is nothing stale to clean up; a file left by a killed run just names its last holder and
  is taken over by the next run. On NFS, Linux carries `flock` as a lock of the server, so runs on other hosts
  see it too.
- The holder removes the file when it ends (and the directory, if it made it and nothing else is there). So
  that a run cannot lock a file just removed, a lock counts only if the file it locked is still the one at
  the path (the usual lock-file protocol).
- A file system that cannot lock at all (some parallel file systems mount without lock support) gives a warning,
  not a refusal: the run goes on unguarded.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import os
import socket
from pathlib import Path

from mtrain.errors import TrainError

LOCK_FILE = ".mtrain.lock"


class RunLock:
    """An exclusive lock on a run directory, held until `release` (or until the process ends)."""

    def __init__(self, path: Path, fd: int | None, made_dir: bool) -> None:
        self.path, self._fd, self._made_dir = path, fd, made_dir

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()  # while still holding it: nobody can be locking this file now
        if self._made_dir:
            with contextlib.suppress(OSError):  # not empty: the run's checkpoints are there
                self.path.parent.rmdir()
        os.close(self._fd)  # closing the file drops the flock
        self._fd = None

    def __del__(self) -> None:  # a Trainer dropped without close(): its directory is free again
        self.release()


def acquire(root: Path) -> RunLock:
    """Lock `root` (created if missing) for this run, or raise naming the run that holds it. A lock that the file
    system cannot give returns an unheld RunLock (the caller warns)."""
    made_dir = not root.exists()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file of that name, no permission, a read-only file system
        raise TrainError(f"checkpoint.dir {root}: cannot create it or write there: {e.strerror}") from None
    path = root / LOCK_FILE
    while True:
        fd = _lock(path, root)
        if fd is None:
            return RunLock(path, None, made_dir)
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the file was removed by its last holder between our open and our lock: take the new one
    since = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}, since {since}\n".encode(), 0)
    return RunLock(path, fd, made_dir)


def _lock(path: Path, root: Path) -> int | None:
    """An open descriptor of `path` holding its flock; None where the file system cannot lock."""
    try:  # O_NOFOLLOW: a link planted at the lock's name is refused, not followed into another file
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise TrainError(f"checkpoint.dir {root}: cannot open its lock file {path}: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read(fd) or "a run that is just starting"
        os.close(fd)
        raise TrainError(f"checkpoint.dir {root} is in use by another run ({holder}, holding {path}); two runs in "
                         "one directory would overwrite each other's checkpoints: wait for it to end, or give this "
                         "run another checkpoint.dir") from None
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            return None
        raise TrainError(f"checkpoint.dir {root}: cannot lock {path}: {e.strerror}") from None
    return fd


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""
