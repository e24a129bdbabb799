"""Start-up of the `mconvert` command: `--help`, `--version` and `mconvert inspect` of each checkpoint format.

    python bench/startup.py [--rounds 5] [--fixtures DIR]

For each case (the Megatron fixtures of ../shared/fixtures: core `torch` at TP1 and TP2 PP2, legacy, torch_dist with
and without common.pt, and the HF checkpoint they came from; `mconvert compare` of some pairs) it prints, medians
over interleaved rounds, the wall time and the CPU seconds (user + sys) of the command as its own process, whether
torch was imported (from `python -X importtime`), and the modules whose import cost most. CPU seconds are the
figure to compare on a shared machine: wall time there measures the neighbours too.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHECKPOINTS = {
    "HF safetensors (Llama)": "llama_gqa/hf",
    "core torch TP1 PP1": "llama_gqa/core_tp1pp1",
    "core torch TP2 PP2": "llama_gqa/core_tp2pp2",
    "core torch TP1 PP2 bf16": "llama_gqa/core_tp1pp2_bf16",
    "legacy TP1 PP1 (GPT-2)": "gpt2/legacy_tp1pp1",
    "legacy TP2 PP2 (GPT-2)": "gpt2/legacy_tp2pp2",
    "torch_dist (common.pt)": "llama_gqa/torch_dist",
    "torch_dist (common_state)": "llama_gqa/torch_dist_head",
}
COMPARES = {  # `mconvert compare A B`
    "HF safetensors with itself": ("llama_gqa/hf", "llama_gqa/hf"),
    "core torch TP1 PP1 with HF": ("llama_gqa/core_tp1pp1", "llama_gqa/hf"),
    "legacy TP2 PP2 with TP1 PP1": ("gpt2/legacy_tp2pp2", "gpt2/legacy_tp1pp1"),
}


def run(args: list[str]) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the child, its stderr) of `python -X importtime -m mconvert ARGS`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "mconvert", *args], capture_output=True,
                          text=True, cwd=REPO)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode not in (0, 1) or (done.returncode and args[0] != "compare"):  # compare: 1 = they differ
        sys.exit(f"mconvert {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), done.stderr


def import_costs(importtime: str) -> dict[str, int]:
    """Microseconds each top-level package cost to import (cumulative, from `-X importtime`)."""
    costs: dict[str, int] = {}
    for line in importtime.splitlines():
        found = re.match(r"import time:\s+\d+ \|\s+(\d+) \| (\s*)(\S+)", line)
        if found and not found.group(2):  # a top-level import
            name = found.group(3).split(".")[0]
            costs[name] = costs.get(name, 0) + int(found.group(1))
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fixtures", type=Path,
                        default=Path(os.environ.get("MCONVERT_FIXTURES", REPO.parent / "shared" / "fixtures")))
    args = parser.parse_args()
    cases = {"mconvert --help": ["--help"], "mconvert --version": ["--version"]}
    cases |= {f"inspect {name}": ["inspect", str(args.fixtures / rel)] for name, rel in CHECKPOINTS.items()
              if (args.fixtures / rel).is_dir()}
    cases |= {f"compare {name}": ["compare", str(args.fixtures / a), str(args.fixtures / b)]
              for name, (a, b) in COMPARES.items() if (args.fixtures / a).is_dir() and (args.fixtures / b).is_dir()}
    walls: dict[str, list[float]] = {c: [] for c in cases}
    cpus: dict[str, list[float]] = {c: [] for c in cases}
    notes: dict[str, str] = {}
    for r in range(args.rounds):
        for case, argv in cases.items():
            wall, cpu, err = run(argv)
            walls[case].append(wall)
            cpus[case].append(cpu)
            costs = import_costs(err)
            top = ", ".join(f"{k} {v / 1e6:.2f}s" for k, v in sorted(costs.items(), key=lambda kv: -kv[1])[:3])
            notes[case] = f"{'torch imported' if 'torch' in costs else 'no torch'}; {top}"
        print(f"round {r + 1}/{args.rounds} done (load average {os.getloadavg()[0]:.1f})", flush=True)
    print(f"\nmedians of {args.rounds} rounds:")
    print(f"{'case':<42} {'wall s':>7} {'CPU s':>7}   imports")
    for case in cases:
        print(f"{case:<42} {statistics.median(walls[case]):7.2f} {statistics.median(cpus[case]):7.2f}   "
              f"{notes[case]}")


if __name__ == "__main__":
    main()
