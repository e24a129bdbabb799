"""Stopping a run on SIGINT (Ctrl-C) or SIGTERM (a scheduler's warning before it kills) without losing work.

    with graceful_stop() as stop:        the command line (mtrain pretrain / finetune) installs the handlers
        Trainer(config, stop=stop).run()

    first signal     stop.signal is set; the trainer finishes the step it is in, all ranks agree to stop after the
                     same step (Trainer.should_stop: a max over ranks), save a checkpoint and return
    second signal    the default action again: the process ends at once, without saving (from the first signal
                     until the process exits, also while it saves or shuts down)

Under torchrun the launcher forwards the signal it receives to every worker (in their own session, so each gets it
once) and waits `--shutdown-timeout` seconds (30 by default) before killing them: raise it when a step and a save
take longer. The handlers write with os.write: printing from a handler can hit a stream in the middle of a write.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """Whether (and by which signal) this process was asked to stop."""

    def __init__(self) -> None:
        self.signal: int | None = None

    @property
    def requested(self) -> bool:
        return self.signal is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal is not None else ""


@contextlib.contextmanager
def graceful_stop(announce: bool = True) -> Iterator[StopRequest]:
    """Handle SIGINT/SIGTERM as the module docstring says while the block runs (main thread only; elsewhere the
    signals keep their handlers and the request is never set). `announce`: say so on stderr when a signal comes."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def first(signum: int, frame) -> None:
        stop.signal = signum
        for s in SIGNALS:  # a second signal: the default action, which ends the process even inside a C call
            signal.signal(s, signal.SIG_DFL)
        if announce:
            name = signal.Signals(signum).name
            os.write(2, f"mtrain: {name} received: finishing the current step, then saving a checkpoint (send "
                        f"{name} again to abort without saving)\n".encode())

    previous = {s: signal.signal(s, first) for s in SIGNALS}
    try:
        yield stop
    finally:
        if not stop.requested:  # after a signal the default action stays: a second one kills until the very end
            for s, handler in previous.items():
                signal.signal(s, handler)
