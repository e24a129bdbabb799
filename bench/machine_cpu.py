"""What the whole machine spends on a conversion against `cp -r` of its source: CPU seconds of every process and
kernel thread (the kernel's flusher threads write back what `cp` leaves dirty, and nobody's process-tree CPU
counts them), from /proc/stat, beside each command's own process-tree CPU.

    python bench/machine_cpu.py [--rounds 4] SOURCE -- mconvert -q --workers 1 --saver core --tp 2 --pp 2

Each round runs `cp -r SOURCE` and then the conversion of SOURCE (`--load-dir`/`--save-dir` are added), each
followed by `sync`, both after reading SOURCE once (page cache warm). The machine's background rate, measured for
2 s before each command, is subtracted. Only meaningful on a quiet machine: on a shared one the background moves
while the command runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert import warm  # noqa: E402  (bench/ is not a package)

HZ = os.sysconf("SC_CLK_TCK")


def busy() -> float:
    """CPU seconds the machine has spent, all CPUs, anything but idle and I/O wait, since boot."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    return (sum(values) - values[3] - values[4]) / HZ


def measure(cmd: list[str], src: Path, out: Path) -> tuple[float, float, float]:
    """(machine CPU beyond the background, the command's own CPU, the background rate) of `cmd` then `sync`."""
    shutil.rmtree(out, ignore_errors=True)
    warm(src)
    os.sync()
    before = busy()
    time.sleep(2)
    background = (busy() - before) / 2
    start, used = time.perf_counter(), busy()
    proc = subprocess.Popen(cmd)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{' '.join(cmd)} failed")
    os.sync()
    machine = busy() - used - background * (time.perf_counter() - start)
    shutil.rmtree(out, ignore_errors=True)
    return machine, usage.ru_utime + usage.ru_stime, background


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("source", type=Path)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the conversion, after --")
    args = parser.parse_args()
    command = [c for c in args.command if c != "--"]
    out = Path(tempfile.mkdtemp(prefix="machine-cpu-", dir=args.source.parent)) / "out"
    results: dict[str, list[tuple[float, float]]] = {"cp -r": [], "mconvert": []}
    try:
        for r in range(args.rounds):
            for name, cmd in (("cp -r", ["cp", "-r", str(args.source), str(out)]),
                              ("mconvert", [*command, "--load-dir", str(args.source), "--save-dir", str(out)])):
                machine, own, background = measure(cmd, args.source, out)
                results[name].append((machine, own))
                print(f"round {r + 1}/{args.rounds}: {name:<9} machine {machine:5.2f} s  own {own:5.2f} s  "
                      f"(background {background:.2f} CPU s per s)", flush=True)
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)
    for name, rs in results.items():
        print(f"{name:<9} median: machine {statistics.median(m for m, _ in rs):.2f} s, own "
              f"{statistics.median(o for _, o in rs):.2f} s")
    ratios = [m / c for (m, _), (c, _) in zip(results["mconvert"], results["cp -r"])]
    print(f"machine CPU, mconvert / cp -r: median {statistics.median(ratios):.2f}x "
          f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)})")


if __name__ == "__main__":
    main()
