"""Parallel conversion: a saver's output as jobs, run by threads here or shared by the ranks of a torchrun launch.

A saver describes its output as `Job`s (one or a few output files, or a byte range of one big file, each writing
the same bytes whoever runs it) plus a `finish` step for the small files that need every job's result (DCP's
`.metadata`, an index, the tracker). `run` executes them:

    one process:   the jobs on `workers` threads (the copying, checksumming and writing release the GIL)
    torchrun:      rank r takes the jobs `assign` gives it (largest first, to the least loaded rank), runs them on
                   its own threads into the shared staging directory, results are gathered, rank 0 finishes

Jobs are assigned by their bytes only, never by timing, so any number of workers writes the same bytes. Each job
streams its own files, one layer at a time, so memory per worker stays about one layer. When a job is done its
files are synced by the worker that wrote them, while the other jobs go on.

Under torchrun every rank reads the source's headers itself and plans the same jobs; the process group (gloo:
only small objects travel) exists just to agree on the staging directory, gather results and agree on success.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mconvert.errors import ConvertError
from mconvert.lazy import torch
from mconvert.progress import Progress
from mconvert.staging import fsync_path

MAX_DEFAULT_WORKERS = 8  # past a few writers the disk, not the CPU, sets the pace


@dataclass(frozen=True)
class Job:
    """Write `name` (`nbytes` of tensor data): `run(advance)` writes it, calling `advance(n)` as bytes go out, and
    returns what the saver's finish step needs (picklable: it may travel between ranks). `files` are synced when
    the job is done."""

    name: str
    nbytes: int
    run: Callable[[Callable[[int], None]], Any] = field(repr=False)
    files: tuple[Path, ...] = ()


@dataclass(frozen=True)
class Team:
    """This process's place in a torchrun launch (rank 0 of 1 outside one)."""

    rank: int = 0
    size: int = 1

    @property
    def leader(self) -> bool:
        return self.rank == 0


def default_workers() -> int:
    """One worker per CPU this process may use, up to MAX_DEFAULT_WORKERS."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_WORKERS, cpus))


def slots(workers: int | None) -> int:
    """How many jobs can run at once: threads per process times the ranks of a torchrun launch."""
    return (workers or default_workers()) * team().size


def team() -> Team:
    dist = sys.modules.get("torch.distributed")  # never imported: no process group (and no import cost)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return Team(dist.get_rank(), dist.get_world_size())
    return Team()


def assign(sizes: list[int], n: int) -> list[list[int]]:
    """Job indices for each of `n` workers: largest job first, to the least loaded worker (ties: lowest index)."""
    shares: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    for j in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
        w = min(range(n), key=lambda i: (load[i], i))
        shares[w].append(j)
        load[w] += sizes[j]
    return [sorted(s) for s in shares]


def run(jobs: list[Job], *, workers: int | None, progress: Progress,
        finish: Callable[[list[Any]], None] | None = None) -> list[Any]:
    """Run `jobs` (this rank's share of them under torchrun) on `workers` threads, then `finish(results)` on rank 0
    with every job's result in job order; returns the results (on every rank)."""
    me = team()
    pending = _STAGING.get()
    if pending is not None:
        pending.ran = True
    mine = assign([j.nbytes for j in jobs], me.size)[me.rank]
    results: dict[int, Any] = {}
    error: BaseException | None = None
    try:
        with one_op_thread():
            results = _run_local([jobs[i] for i in mine], mine, workers or default_workers(), progress)
    except BaseException as e:  # noqa: BLE001 - the other ranks must hear of it before this one re-raises
        error = e
    if me.size > 1:
        results = _gather(results, error, me)
    elif error is not None:
        raise error
    ordered = [results[i] for i in range(len(jobs))]
    if finish is not None and me.leader:
        finish(ordered)
    return ordered


@contextlib.contextmanager
def one_op_thread() -> Iterator[None]:
    """torch runs each operation on one thread while jobs run, then on as many as before.

    Jobs move bytes: their torch operations are copies, casts and joins, limited by memory, and every worker is a
    thread already. torch's own threads (OpenMP) would split each copy and then busy-wait for the next one: about
    5% of a conversion's CPU time (perf, core -> torch_dist), for no gain in wall time on a busy machine.
    Without torch imported (jobs that only move bytes, see `mconvert.io.file_views`) nothing is set.
    """
    if "torch" not in sys.modules:  # jobs that only move bytes never import it (a saver that needs torch has)
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class _Stopped(Exception):
    """Raised in a job when another job has failed: the rest of the work is abandoned."""


def _run_local(jobs: list[Job], ids: list[int], workers: int, progress: Progress) -> dict[int, Any]:
    stop = threading.Event()

    def one(job: Job) -> Any:
        try:
            with progress.task(job.name, job.nbytes) as bar:
                def advance(n: int) -> None:
                    if stop.is_set():
                        raise _Stopped
                    bar(n)

                result = job.run(advance)
            for path in job.files:
                fsync_path(path)
            return result
        except BaseException:
            stop.set()
            raise

    if workers <= 1 or len(jobs) <= 1:
        return {i: one(job) for i, job in zip(ids, jobs)}
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(workers, len(jobs)),
                                               thread_name_prefix="mconvert-worker") as pool:
        futures = {pool.submit(one, job): i for i, job in zip(ids, jobs)}
        try:
            concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
        except BaseException:  # Ctrl-C: the running jobs stop at their next tensor
            stop.set()
            raise
        if stop.is_set():
            for f in futures:
                f.cancel()  # not started yet: never starts; running: stops at its next tensor
            concurrent.futures.wait(futures)
            errors = [f.exception() for f in futures if not f.cancelled() and f.exception() is not None]
            raise next((e for e in errors if not isinstance(e, _Stopped)), errors[0])
        return {i: f.result() for f, i in futures.items()}


def _gather(results: dict[int, Any], error: BaseException | None, me: Team) -> dict[int, Any]:
    """Every rank's results, or an error on every rank if any rank failed (the failing rank raises its own)."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * me.size
    failure = None if error is None else f"{type(error).__name__}: {error}"
    dist.all_gather_object(gathered, (results, failure))
    if error is not None:
        raise error
    failed = [f"rank {r}: {f}" for r, (_, f) in enumerate(gathered) if f is not None]
    if failed:
        raise ConvertError("the conversion failed on another rank: " + "; ".join(failed))
    return {i: value for part, _ in gathered for i, value in part.items()}


@contextlib.contextmanager
def shared_staging(dst: Path, staged: Callable[[Path], contextlib.AbstractContextManager[Path]]) -> Iterator[Path]:
    """`staged(dst)` (the engine's all-or-nothing output directory), shared by every rank of a torchrun launch.

    Rank 0 creates the staging directory and tells the others; when every rank's block has succeeded rank 0 moves
    it into place, and every rank returns only then. A failure on any rank fails all of them and leaves nothing.
    Outside torchrun this is `staged(dst)` itself.
    """
    me = team()
    if me.size == 1:
        with staged(dst) as path:
            yield path
        return
    import torch.distributed as dist

    with contextlib.ExitStack() as stack:
        block = _Block()
        token = _STAGING.set(block)
        stack.callback(_STAGING.reset, token)
        made: list[Any] = [None, None]
        if me.leader:
            try:
                made[0] = str(stack.enter_context(staged(dst)))
            except BaseException as e:  # noqa: BLE001
                made[1] = f"{type(e).__name__}: {e}"
        dist.broadcast_object_list(made, src=0)
        if made[1] is not None:
            raise ConvertError(f"rank 0 could not create the output directory for {dst}: {made[1]}")
        error: BaseException | None = None
        try:
            yield Path(made[0])
        except BaseException as e:  # noqa: BLE001
            error = e
            if not block.ran:  # failed before the saver's `run`: take part in its gather, as the others do
                with contextlib.suppress(BaseException):
                    _gather({}, error, me)
        _gather({}, error, me)  # every rank done (or all of them fail; rank 0's failure removes the staging)
        status: list[Any] = [None]
        if me.leader:
            try:
                stack.close()  # sync and move into place
            except BaseException as e:  # noqa: BLE001
                status[0] = f"{type(e).__name__}: {e}"
        dist.broadcast_object_list(status, src=0)
        if status[0] is not None:
            raise ConvertError(f"rank 0 could not move the output into place at {dst}: {status[0]}")


@dataclass
class _Block:
    """A shared-staging block: has the saver reached `run` (and its gather) on this rank?"""

    ran: bool = False


# The shared-staging block this code runs in, if any: a rank failing before the saver's `run` must still take part
# in that run's gather, or the ranks' collectives would no longer pair up.
_STAGING: contextvars.ContextVar[_Block | None] = contextvars.ContextVar("mconvert_staging", default=None)


def init_from_env() -> bool:
    """Join the process group when started by torchrun (WORLD_SIZE > 1 in the environment); True if this call
    created it (the caller destroys it at the end)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    import datetime

    import torch.distributed as dist

    if dist.is_initialized():
        return False
    init_process_group("gloo", timeout=datetime.timedelta(hours=2))  # a big share of a big model takes a while
    return True


def init_process_group(backend: str, **kwargs) -> None:
    """`torch.distributed.init_process_group`, after importing torch.distributed.checkpoint.

    Imported while a group exists, torch.distributed.checkpoint (through torch._dynamo) takes references to it that
    `destroy_process_group()` does not drop, so gloo's worker threads outlive it. One of them may then release the
    last collective's tensors while the interpreter shuts down, and the process aborts after its work is done
    ("terminate called without an active exception", SIGABRT: one torchrun launch in eight here). Imported before,
    `destroy_process_group()` stops those threads. mtrain and the torchrun conversions both start here."""
    import torch.distributed as dist
    import torch.distributed.checkpoint  # noqa: F401 - see above

    dist.init_process_group(backend, **kwargs)


def end_process_group() -> None:
    """Destroy the process groups, and with them gloo's worker threads.

    A group outlives `destroy_process_group()` while anything else holds it, and its threads with it; one of them
    may then release a collective's tensors while the interpreter shuts down, which aborts the process after the
    run has ended well (see init_process_group). State that holds collectives (DDP's reducer,
    FSDP's) is collected while the groups are whole; then the groups are destroyed and the device meshes that
    DTensor's caches keep let go of theirs."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.destroy_process_group()
    if "torch.distributed.device_mesh" in sys.modules:
        # DTensor's caches (sharding decisions, redistribution plans) keep device meshes, each mesh its groups
        from torch.distributed.device_mesh import DeviceMesh

        # issubclass(type(o), ...), not isinstance: DeviceMesh's metaclass would read `__class__` of every object,
        # and some warn when read (torch.distributed.reduce_op: a FutureWarning at every run's end)
        for mesh in (o for o in gc.get_objects() if issubclass(type(o), DeviceMesh)):
            getattr(mesh, "_pg_registry", {}).clear()
        gc.collect()
