"""One run per run directory: `checkpoint.dir` is locked while a run trains into it.

Two runs sharing a checkpoint.dir would resume each other's steps and overwrite each other's checkpoints, both
exiting 0. The first run (its rank 0) holds an exclusive `flock` on `{checkpoint.dir}/.mtrain.lock` for as long as
it runs, and writes there who it is (`pid 1234 on host node7, since 2026-01-01T12:00:00Z`); a second run is refused,
naming that holder.

- A lock of a dead process is no lock: the kernel drops a `flock` when its holder exits (kill -9 and crashes
  included), so there is nothing stale to clean up; the file's text is just the last holder's name, overwritten
  by the next one. On NFS, Linux carries `flock` as a lock of the server, so runs on other hosts see it too.
- A file system that cannot lock at all (some parallel file systems mount without lock support) gives a warning,
  not a refusal: the run goes on unguarded.
"""

from __future__ import annotations

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

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path, self._fd = path, fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the file drops the flock
            self._fd = None

    def __del__(self) -> None:  # a Trainer dropped without close(): its directory is free again
        self.release()


def acquire(root: Path) -> RunLock:
    """Lock `root` (created if missing) for this run, or raise naming the run that holds it. A lock that the file
    system cannot give returns an unheld RunLock (the caller warns)."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_FILE
    try:  # O_NOFOLLOW: a link planted at the lock's name is refused, not followed into another file
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise TrainError(f"checkpoint.dir {root}: cannot open its lock file {path}: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read(fd) or "a process that is just starting"
        os.close(fd)
        raise TrainError(f"checkpoint.dir {root} is in use by another run ({holder}, holding {path}); two runs in "
                         "one directory would overwrite each other's checkpoints: wait for it to end, or give this "
                         "run another checkpoint.dir") from None
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            return RunLock(path, None)
        raise TrainError(f"checkpoint.dir {root}: cannot lock {path}: {e.strerror}") from None
    since = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}, since {since}\n".encode(), 0)
    return RunLock(path, fd)


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""
