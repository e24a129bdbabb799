"""The staging directory an output is written into, and what keeps it from outliving a failed run.

    parent/
        out/                                              the destination (--save-dir), replaced only when complete
        .out.partial-mconvert-<host>-<pid>-<random>/      being written by process <pid> on <host>
        .out.old-mconvert-<host>-<pid>-<random>/          the previous `out` during the final swap (--force)

- A failure, Ctrl-C (SIGINT) or SIGTERM (what `timeout` and schedulers send) removes the staging directory:
  `terminating_raises` turns SIGTERM into an `Interrupted` exception, so the same cleanup runs as for an error.
  A signal that lands just after the final rename says so instead (`Interrupted.complete`): the output is whole.
- `kill -9` leaves it behind; the names say whose it is, so a later run into the same parent removes those of
  processes on this host that no longer exist (`remove_stale`), and nothing else. An `.old` directory of such a
  process whose output never took its place is moved back to its place first (kill -9 in a --force swap).
- Staging directories are made with `os.mkdir`, so they get the user's umask like any directory (tempfile's
  0700 would follow them into place). Their name is registered for cleanup before they exist
  (`make_dir(..., into=)`), so a signal arriving just after the `mkdir` cannot strand one.
- The final rename replaces only what the caller checked (`move_into_place`): a --save-dir that did not exist
  must still not exist (`rename_noreplace`), an empty one must still be empty (rename(2) replaces nothing else),
  and only --force replaces whatever is there. Two conversions into one new --save-dir: one wins, the other fails
  and leaves the winner's output alone; a directory somebody creates meanwhile is never deleted.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import secrets
import shutil
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from mconvert.errors import ConvertError

_TAG = "mconvert"
_OURS = re.compile(rf"\..*\.(?P<kind>partial|old|probe)-{_TAG}-(?P<host>[\w.]+)-(?P<pid>\d+)-[0-9a-f]+")


class Interrupted(BaseException):
    """A termination signal arrived: unwinds like KeyboardInterrupt (cleanup runs), not caught as an error.
    `complete`: the output, when the signal came after it was moved into place (it is there, whole)."""

    def __init__(self, signum: int, complete: Path | None = None) -> None:
        super().__init__(signum)
        self.signum, self.complete = signum, complete

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def _host() -> str:
    return re.sub(r"[^\w.]", "_", socket.gethostname()) or "host"


def make_dir(parent: Path, name: str, kind: str = "partial", into: list[Path] | None = None) -> Path:
    """A new, uniquely named `.{name}.{kind}-mconvert-<host>-<pid>-<random>` directory in `parent`. `into`
    receives its path before it is created: a cleanup that removes what `into` lists misses nothing, whenever
    an interruption lands."""
    while True:
        path = parent / f".{name}.{kind}-{_TAG}-{_host()}-{os.getpid()}-{secrets.token_hex(4)}"
        if into is not None:
            into.append(path)
        try:
            path.mkdir()  # mode 0o777 minus the umask, as any directory the user creates
            return path
        except FileExistsError:
            if into is not None:
                into.remove(path)
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
            if m["kind"] == "old":
                _restore(entry, parent)
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _restore(aside: Path, parent: Path) -> None:
    """A `.NAME.old-...` directory of a process killed (kill -9) during a --force swap holds the previous NAME. If
    NAME is gone (the new output never arrived), put the old one back rather than delete the only copy."""
    inner = list(aside.iterdir())
    if len(inner) == 1 and aside.name.startswith(f".{inner[0].name}.old-"):
        with contextlib.suppress(OSError):  # FileExistsError: the swap had finished; the old copy can go
            rename_noreplace(inner[0], parent / inner[0].name)


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
    made: list[Path] = []
    try:
        make_dir(ancestor, dst.name or "out", "probe", into=made)
    except OSError as e:
        raise ConvertError(f"--save-dir {dst}: cannot write in {ancestor}: {e.strerror}") from None
    finally:
        for probe in made:
            with contextlib.suppress(OSError):
                probe.rmdir()


# What the final rename may replace at --save-dir: what was checked before the conversion started.
Replace = Literal["nothing", "empty", "anything"]


def move_into_place(work: Path, dst: Path, replace: Replace) -> None:
    """Rename the finished `work` to `dst`, replacing only what `replace` allows: "nothing" (dst did not exist
    when checked), "empty" (an empty directory, as checked), "anything" (--force). Anything else found at `dst`
    is left alone and refused."""
    try:
        if replace == "anything" and os.path.lexists(dst):
            _swap(work, dst)
        elif replace == "empty":
            os.rename(work, dst)  # replaces an empty directory only: ENOTEMPTY, ENOTDIR for anything else
        else:
            rename_noreplace(work, dst)
    except OSError as e:
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
            raise
        raise ConvertError(f"--save-dir {dst} was created (or filled) by someone else while converting (another "
                           "conversion?); it was left as it is, and this conversion's output removed; pass --force "
                           "to replace it") from None


def _swap(work: Path, dst: Path) -> None:
    """--force: move the old `dst` aside, `work` into its place, then delete the old one. Interrupted halfway, the
    old `dst` goes back to its place (unless something has taken it meanwhile)."""
    made: list[Path] = []
    try:
        old = make_dir(dst.parent, dst.name, "old", into=made) / dst.name
        os.replace(dst, old)
        rename_noreplace(work, dst)
    except BaseException:
        for aside in made:
            with contextlib.suppress(OSError):
                if os.path.lexists(aside / dst.name):
                    rename_noreplace(aside / dst.name, dst)
                aside.rmdir()
        raise
    remove(old.parent)


_RENAME_NOREPLACE = 1  # linux/fs.h
_AT_FDCWD = -100


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename `src` to `dst`, failing with FileExistsError if anything exists at `dst`: Linux's
    renameat2(RENAME_NOREPLACE). Where that is missing (another OS, an old C library, a file system without
    it), `dst` is claimed by an exclusive mkdir and `src` renamed onto that empty directory."""
    renameat2 = getattr(_libc(), "renameat2", None)
    if renameat2 is not None:
        if renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise OSError(code, os.strerror(code), str(dst))
    os.mkdir(dst)  # FileExistsError if anything is there
    try:
        os.rename(src, dst)
    except BaseException:
        with contextlib.suppress(OSError):
            os.rmdir(dst)
        raise


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


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
