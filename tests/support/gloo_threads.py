"""gloo's threads left in this process: none may outlive `destroy_process_group()` in a torchrun test.

Left running, one of them can release a collective's tensors while the interpreter shuts down, which aborts the
process after every check has passed (see mconvert.workers.init_process_group). Linux names the threads.
"""

from __future__ import annotations

from pathlib import Path

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


def gloo_threads() -> int:
    tasks = Path("/proc/self/task")
    return sum((t / "comm").read_text().strip() in GLOO_THREADS for t in tasks.iterdir())
