"""Start-up of the `mconvert` command: `--help`, `--version` and `mconvert inspect` of each checkpoint format.

    python bench/startup.py [--rounds 5] [--fixtures DIR] [--baseline DIR]

For each case (the Megatron fixtures of ../shared/fixtures: core `torch` at TP1 and TP2 PP2, legacy, torch_dist with
and without common.pt, and the HF checkpoint they came from; made from them in a temporary directory: the GPT-2
fixture's `pytorch_model.bin` alone, the Llama fixture as three `pytorch_model-*.bin` shards with their index, and
as Megatron's zarr when zarr is installed; `mconvert compare` of some pairs) it prints, medians over interleaved
rounds, the wall time and the CPU seconds (user + sys) of the command as its own process, whether torch was
imported (from `python -X importtime`), and the modules whose import cost most. CPU seconds are the figure to
compare on a shared machine: wall time there measures the neighbours too. `--baseline DIR` (a directory holding
another version's `mconvert` package, e.g. `git archive main mconvert | tar -x -C DIR`) runs that version beside
this one in every round; both trees are byte-compiled first, so neither pays for compiling its modules.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
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
MADE = {  # made from the fixtures (see `make`), in a temporary directory
    "HF pytorch_model.bin (GPT-2)": "gpt2_bin",
    "HF pytorch_model-*.bin, 3 shards (Llama)": "llama_bin_shards",
    "zarr (Llama)": "llama_zarr",
}
COMPARES = {  # `mconvert compare A B`
    "HF safetensors with itself": ("llama_gqa/hf", "llama_gqa/hf"),
    "HF safetensors with its .bin shards": ("llama_gqa/hf", "llama_bin_shards"),
    "core torch TP1 PP1 with HF": ("llama_gqa/core_tp1pp1", "llama_gqa/hf"),
    "core torch TP2 PP2 with TP1 PP1": ("llama_gqa/core_tp2pp2", "llama_gqa/core_tp1pp1"),
    "legacy TP2 PP2 with TP1 PP1": ("gpt2/legacy_tp2pp2", "gpt2/legacy_tp1pp1"),
}


def make(fixtures: Path, out: Path) -> None:
    """The checkpoints of MADE: GPT-2's own `pytorch_model.bin` without its safetensors; the Llama fixture's weights
    as three `.bin` shards and an index (torch.save of each part, as `save_pretrained(safe_serialization=False)`
    shards them); and converted by mconvert to zarr (skipped without zarr)."""
    import importlib.util
    import json
    import shutil

    import torch
    from safetensors.torch import load_file

    if (fixtures / "gpt2/hf").is_dir():
        shutil.copytree(fixtures / "gpt2/hf", out / "gpt2_bin", ignore=shutil.ignore_patterns("*.safetensors"))
    llama = fixtures / "llama_gqa/hf"
    if not llama.is_dir():
        return
    shards = out / "llama_bin_shards"
    shutil.copytree(llama, shards, ignore=shutil.ignore_patterns("*.safetensors*"))
    state = load_file(llama / "model.safetensors")
    keys, weight_map = list(state), {}
    for i in range(3):
        name, part = f"pytorch_model-{i + 1:05d}-of-00003.bin", keys[i * len(keys) // 3:(i + 1) * len(keys) // 3]
        torch.save({k: state[k] for k in part}, shards / name)
        weight_map |= dict.fromkeys(part, name)
    (shards / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if importlib.util.find_spec("zarr") and importlib.util.find_spec("tensorstore"):
        subprocess.run([sys.executable, "-m", "mconvert", "-q", "--saver", "core", "--ckpt-format", "zarr",
                        "--load-dir", str(llama), "--save-dir", str(out / "llama_zarr")], check=True, cwd=REPO)


def run(args: list[str], tree: Path) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the child, its stderr) of `python -X importtime -m mconvert ARGS`, with the
    `mconvert` package of `tree` (run from a neutral directory, `tree` first on the path)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "mconvert", *args], capture_output=True,
                          text=True, cwd=tempfile.gettempdir(), env=env)
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


def imports_torch(importtime: str) -> bool:
    """Was torch (or any of its modules) imported, at any depth (a plugin may import it inside a function)?"""
    return any(re.match(r"import time:\s+\d+ \|\s+\d+ \|\s*torch(\.|$)", line) for line in importtime.splitlines())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fixtures", type=Path,
                        default=Path(os.environ.get("MCONVERT_FIXTURES", REPO.parent / "shared" / "fixtures")))
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a directory holding another version's mconvert package, run beside this one")
    args = parser.parse_args()
    trees = {"": REPO} | ({"baseline ": args.baseline.resolve()} if args.baseline else {})
    for tree in trees.values():
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "mconvert")], check=True)
    with tempfile.TemporaryDirectory() as made:
        made = Path(made)
        make(args.fixtures, made)
        where = {rel: args.fixtures / rel for rel in [*CHECKPOINTS.values(), *(x for ab in COMPARES.values()
                                                                              for x in ab)]}
        where |= {rel: made / rel for rel in MADE.values()}
        cases = {"mconvert --help": ["--help"], "mconvert --version": ["--version"]}
        cases |= {f"inspect {name}": ["inspect", str(where[rel])] for name, rel in {**CHECKPOINTS, **MADE}.items()
                  if where[rel].is_dir()}
        cases |= {f"compare {name}": ["compare", str(where[a]), str(where[b])]
                  for name, (a, b) in COMPARES.items() if where[a].is_dir() and where[b].is_dir()}
        runs = {f"{label}{case}": (argv, tree) for case, argv in cases.items() for label, tree in trees.items()}
        walls: dict[str, list[float]] = {c: [] for c in runs}
        cpus: dict[str, list[float]] = {c: [] for c in runs}
        notes: dict[str, str] = {}
        for r in range(args.rounds):
            for case, (argv, tree) in runs.items():
                wall, cpu, err = run(argv, tree)
                walls[case].append(wall)
                cpus[case].append(cpu)
                costs = import_costs(err)
                top = ", ".join(f"{k} {v / 1e6:.2f}s" for k, v in sorted(costs.items(), key=lambda kv: -kv[1])[:3])
                notes[case] = f"{'torch imported' if imports_torch(err) else 'no torch'}; {top}"
            print(f"round {r + 1}/{args.rounds} done (load average {os.getloadavg()[0]:.1f})", flush=True)
    print(f"\nmedians of {args.rounds} rounds:")
    print(f"{'case':<60} {'wall s':>7} {'CPU s':>7}   imports")
    for case in runs:
        print(f"{case:<60} {statistics.median(walls[case]):7.2f} {statistics.median(cpus[case]):7.2f}   "
              f"{notes[case]}")


if __name__ == "__main__":
    main()
