"""Run under torchrun (gloo): conversions shared by the ranks, several in one launch (start-up is the slow part).

    torchrun --standalone --nproc-per-node 2 tests/support/scripts/mconvert_ranks.py SPEC.json

SPEC is a list of {"args": [mconvert arguments], "fail_rank": null or a rank, "fail_in": "write" or "plan"}. With a
fail_rank, that rank fails, writing torch-format files (as on a full disk) or planning them (before any collective
of the saver), and every rank must see the conversion fail; otherwise every rank must see it succeed. Exits 1 on
any other outcome.
"""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

from mconvert.cli import main
from mconvert.errors import ConvertError
from mconvert.io.torch_zip import TorchFileWriter
from mconvert.megatron import rank_files
from mconvert.workers import init_process_group
from tests.support.gloo_threads import gloo_threads


def failing_add(self, tensor):
    raise OSError("No space left on device (injected)")


def failing_check(*args, **kwargs):
    raise ConvertError("refusing to write (injected)")


def run(args: list[str]) -> str | None:
    try:
        main(args, standalone_mode=False)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}: {e}"
    return None


if __name__ == "__main__":
    init_process_group("gloo")  # as mconvert's own torchrun start does
    rank = dist.get_rank()
    add, check = TorchFileWriter.add, rank_files.check_plan
    bad = []
    for scenario in json.loads(open(sys.argv[1]).read()):
        fail = scenario.get("fail_rank")
        if fail == rank and scenario.get("fail_in", "write") == "write":
            TorchFileWriter.add = failing_add
        if fail == rank and scenario.get("fail_in") == "plan":
            rank_files.check_plan = failing_check
        error = run(scenario["args"])
        TorchFileWriter.add, rank_files.check_plan = add, check
        if (error is None) != (fail is None):
            bad.append(f"rank {rank}: {scenario['args']}: expected {'failure' if fail is not None else 'success'}, "
                       f"got {error or 'success'}")
    dist.destroy_process_group()
    if gloo_threads():  # left running, one of them can abort the process while the interpreter shuts down
        bad.append(f"rank {rank}: {gloo_threads()} gloo threads outlived destroy_process_group()")
    if bad:
        print("\n".join(bad))
        sys.exit(1)
