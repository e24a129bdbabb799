"""The one thread that runs the model. HTTP threads submit Jobs and read their results as they come.

    loop:  take every job that arrived since the last step -> one new batch (a BatchGeneration) of their rows
           run one step (one position) of the next batch in turn, hand each row's token to its job

Requests that arrive together are batched (their rows run as one forward pass per step, each request sampled
with its own settings and seed); a request arriving while others generate starts its own batch at the next step,
and the batches then advance one token each in turn, so a long generation slows the others down but never holds
them back until it ends. This is not continuous batching: a batch does not take in rows after it starts.
"""

from __future__ import annotations

import queue
import sys
import threading
import traceback
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from mtrain.generation import BatchGeneration, Emitted, RowGroup, Sampling, prompt_logprobs
from mtrain.models.model import Transformer
from mtrain.serving.fields import BadRequest


@dataclass
class Job:
    """One request: its rows (token ids of each prompt, one row per choice) and how to sample them."""

    prompts: list[list[int]]
    max_new_tokens: int
    sampling: Sampling
    seed: int
    eos_ids: frozenset[int] = frozenset()
    top_logprobs: int | None = None  # see RowGroup
    with_prompt_logprobs: bool = False  # those of the prompt's tokens too (Megatron's logprobs, OpenAI's echo)
    events: queue.Queue = field(default_factory=queue.Queue)
    ended: set[int] = field(default_factory=set)  # rows the reader needs no more of (a stop string came)
    cancelled: bool = False  # the client went away

    def end_row(self, row: int) -> None:
        self.ended.add(row)

    def cancel(self) -> None:
        self.cancelled = True

    def results(self) -> Iterator[tuple[str, object]]:
        """("prompt_logprobs", [[Emitted, ...] per row]) when asked for, then ("tokens", [Emitted, ...]) per step,
        ending with ("done", outputs) or ("error", message)."""
        while True:
            kind, value = self.events.get()
            yield kind, value
            if kind in ("done", "error"):
                return


class Scheduler:
    """`max_jobs`: requests waiting or generating at once; submit() refuses more (each holds a key/value cache)."""

    def __init__(self, model: Transformer, max_batch_rows: int = 64, max_jobs: int = 256):
        self.model, self.max_batch_rows, self.max_jobs = model, max_batch_rows, max_jobs
        self.jobs = 0  # submitted and not yet answered
        self.count_lock = threading.Lock()
        self.pending: queue.Queue[Job] = queue.Queue()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="mtrain-generation", daemon=True)
        self.device = next(model.parameters()).device

    def start(self) -> Scheduler:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=30)

    def submit(self, job: Job) -> Job:
        with self.count_lock:
            if self.jobs >= self.max_jobs:
                raise BadRequest(f"the server is busy: {self.jobs} requests are being served (at most "
                                 f"{self.max_jobs}); retry later", status=503, code="server_busy")
            self.jobs += 1
        self.pending.put(job)
        return job

    def _end(self, job: Job, kind: str, value: object) -> None:
        """The job's last event: "done" or "error"."""
        with self.count_lock:
            self.jobs -= 1
        job.events.put((kind, value))

    def _run(self) -> None:
        batches: deque[tuple[BatchGeneration, list[tuple[Job, int]]]] = deque()
        while not self.stopping.is_set():
            jobs = self._take(wait=not batches)
            while jobs:  # at most max_batch_rows rows per batch (a single bigger request runs alone)
                take, rows = [], 0
                while jobs and (not take or rows + len(jobs[0].prompts) <= self.max_batch_rows):
                    rows += len(jobs[0].prompts)
                    take.append(jobs.pop(0))
                started = self._start(take)
                if started is not None:
                    batches.append(started)
            if not batches:
                continue
            batch = batches.popleft()
            if self._step(*batch):
                batches.append(batch)
        for _, members in batches:
            for job, _ in members:
                self._end(job, "error", "the server is shutting down")

    def _take(self, wait: bool) -> list[Job]:
        jobs = []
        try:
            jobs.append(self.pending.get(timeout=0.2) if wait else self.pending.get_nowait())
            while True:
                jobs.append(self.pending.get_nowait())
        except queue.Empty:
            pass
        for job in jobs:
            if job.cancelled:
                self._end(job, "done", [[] for _ in job.prompts])
        return [job for job in jobs if not job.cancelled]

    def _start(self, jobs: list[Job]) -> tuple[BatchGeneration, list[tuple[Job, int]]] | None:
        prompts, groups, limits, members = [], [], [], []
        for job in jobs:
            first = len(prompts)
            prompts += job.prompts
            limits += [job.max_new_tokens] * len(job.prompts)
            generator = torch.Generator(device=self.device).manual_seed(job.seed)
            groups.append(RowGroup(tuple(range(first, len(prompts))), job.sampling, generator, job.eos_ids,
                                   job.top_logprobs))
            members.append((job, first))
        try:
            for job in jobs:
                if job.with_prompt_logprobs:
                    job.events.put(("prompt_logprobs", [prompt_logprobs(self.model, p, job.top_logprobs or 0)
                                                        for p in job.prompts]))
            batch = BatchGeneration(self.model, prompts, max_new_tokens=limits, groups=groups)
        except Exception as e:  # noqa: BLE001 - the jobs were checked; anything here is a bug, told to the client
            self._fail(members, e)
            return None
        return batch, members

    def _step(self, batch: BatchGeneration, members: list[tuple[Job, int]]) -> bool:
        """One step of `batch`; False once it is finished (its jobs are told)."""
        for job, first in members:
            for row in range(len(job.prompts)):
                if job.cancelled or row in job.ended:
                    batch.finish(first + row)
        try:
            emitted = batch.step() if not batch.done else []
        except Exception as e:  # noqa: BLE001
            self._fail(members, e)
            return False
        owners = sorted(members, key=lambda m: m[1])
        for job, first in owners:
            mine = [Emitted(e.row - first, e.token, e.logprob, e.top) for e in emitted
                    if first <= e.row < first + len(job.prompts)]
            if mine:
                job.events.put(("tokens", mine))
        if not batch.done:
            return True
        outputs = batch.outputs()
        for job, first in members:
            self._end(job, "done", outputs[first:first + len(job.prompts)])
        return False

    def _fail(self, members: list[tuple[Job, int]], error: Exception) -> None:
        traceback.print_exception(error, file=sys.stderr)
        for job, _ in members:
            self._end(job, "error", f"generation failed: {type(error).__name__}: {error}")
