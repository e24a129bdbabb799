"""Step-by-step pacing of a trainer by bench/train_peers.py (imported by every worker, in every environment).

The bench starts each trainer's ranks as processes of their own and lets them run one optimizer step at a time,
in turn, so the machine's drift hits every trainer alike:

    bench --"step\\n"--> rank's stdin             the trainer runs until the end of its next optimizer step,
    bench <--{"seconds": s, "loss": l}-- reply fd  where a hook of the trainer's own (a callback, a logger)
                                                  calls Pace.step_done and waits for the next "step"

`seconds` is the wall time from the release to the hook: one whole iteration of the trainer's loop (data,
forward, backward, clipping, optimizer, scheduler, logging). Replies go to the file descriptor in
$BENCH_REPLY_FD, so the trainer's own prints (to stdout/stderr, kept in a log) cannot get in the way.
"""

from __future__ import annotations

import json
import os
import sys
import time


class Pace:
    def __init__(self) -> None:
        self.replies = os.fdopen(int(os.environ["BENCH_REPLY_FD"]), "w", buffering=1)
        self.released = time.perf_counter()

    def step_done(self, loss: float) -> None:
        """Report the iteration that just ended, then wait for the next release (or leave on "quit")."""
        seconds = time.perf_counter() - self.released
        self.replies.write(json.dumps({"seconds": seconds, "loss": float(loss)}) + "\n")
        command = sys.stdin.readline().strip()
        if command != "step":  # "quit", or the bench went away: leave without the trainers' teardown
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        self.released = time.perf_counter()


def read_spec() -> dict:
    """The run's settings, written by the bench as JSON (path in argv[1])."""
    with open(sys.argv[1]) as f:
        return json.load(f)


def set_threads(spec: dict) -> None:
    import torch

    torch.set_num_threads(spec["threads"])
