"""The staging directory an output is written into, and what keeps it from outliving a failed run.

    parent/
        out/                                              the destination (--save-dir), replaced only when complete
        .out.partial-mconvert-<host>-<pid>-<random>/      being written by process <pid> on <host>
        .out.old-mconvert-<host>-<pid>-<random>/          the previous `out` during the final swap (--force)

- A failure, Ctrl-C (SIGINT) or SIGTERM (what `timeout` and schedulers send) removes the staging directory:
  `terminating_raises` turns SIGTERM into an `Interrupted` exception, so the same cleanup runs as for an error.
- `kill -9` leaves it behind; the names say whose it is, so a later run into the same parent removes those of
  processes on this host that no longer exist (`remove_stale`), and nothing else.
- Staging directories are made with `os.mkdir`, so they get the user's umask like any directory (tempfile's
  0700 would follow them into place).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

from mconvert.errors import ConvertError

_TAG = "mconvert"
_OURS = re.compile(rf"\..*\.(partial|old|probe)-{_TAG}-(?P<host>[\w.]+)-(?P<pid>\d+)-[0-9a-f]+")


class Interrupted(BaseException):
    """A termination signal arrived: unwinds like KeyboardInterrupt (cleanup runs), not caught as an error."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def _host() -> str:
    return re.sub(r"[^\w.]", "_", socket.gethostname()) or "host"


def make_dir(parent: Path, name: str, kind: str = "partial") -> Path:
    """A new, uniquely named `.{name}.{kind}-mconvert-<host>-<pid>-<random>` directory in `parent`."""
    while True:
        path = parent / f".{name}.{kind}-{_TAG}-{_host()}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            path.mkdir()  # mode 0o777 minus the umask, as any directory the user creates
            return path
        except FileExistsError:
            continue


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale(parent: Path) -> list[Path]:
    """Remove staging directories in `parent` left by dead mconvert processes of this host; returns them."""
    removed = []
    if not parent.is_dir():
        return removed
    host = _host()
    for entry in parent.iterdir():
        m = _OURS.fullmatch(entry.name)
        if m and m["host"] == host and int(m["pid"]) != os.getpid() and not _alive(int(m["pid"])) \
                and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's entries to the disk (a directory: so a rename into it survives a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    """rmtree that tries twice (a writer thread may have been finishing a file during the first pass)."""
    for _ in range(2):
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            return


def make_parents(path: Path) -> list[Path]:
    """mkdir -p `path`; returns the directories it created (deepest last), to remove them after a failure."""
    missing = []
    for p in [path, *path.parents]:
        if p.exists():
            break
        missing.append(p)
    for p in reversed(missing):
        p.mkdir(exist_ok=True)
    return list(reversed(missing))


def remove_empty(dirs: list[Path]) -> None:
    for d in reversed(dirs):
        with contextlib.suppress(OSError):
            d.rmdir()


def check_writable(dst: Path) -> None:
    """Fail before any reading when the output cannot be created: try to make (and remove) a directory in the
    nearest existing ancestor of `dst`."""
    ancestor = next((p for p in dst.parents if p.exists()), None)
    if ancestor is None or not ancestor.is_dir():
        raise ConvertError(f"--save-dir {dst}: {ancestor} is not a directory")
    try:
        probe = make_dir(ancestor, dst.name or "out", "probe")
        probe.rmdir()
    except OSError as e:
        raise ConvertError(f"--save-dir {dst}: cannot write in {ancestor}: {e.strerror}") from None


@contextlib.contextmanager
def terminating_raises() -> Iterator[None]:
    """Within the block SIGTERM raises `Interrupted` (in the main thread; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Interrupted(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
