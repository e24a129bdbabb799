"""Conversion speed and memory on a 1.1B Llama, side by side with `cp` of the same bytes, in one run.

    python bench/convert.py --vs-cp [--rounds 5] [--layers 22] [--workers 1,2] [--models /tmp/bench-models] [--keep]

Builds (once, cached in --models, outside the repository) a random bf16 Llama with TinyLlama-1.1B shapes from a
`transformers` LlamaConfig, as `save_pretrained` lays it out; the Megatron sources (core torch TP2 PP2 and
torch_dist) are made from it with mconvert, untimed. Then, in every round, each case runs once per worker count
right after `cp -r` of its source (this machine's speed drifts several-fold within seconds, so variants are
interleaved and compared within a round):

    HF -> core TP2 PP2,  core -> HF,  core -> torch_dist,  torch_dist -> HF

Every command runs as its own process, followed by `sync` (mconvert syncs its output itself: moving it into place
needs it on disk; cp does not, hence the sync). Reported per case and worker count: median wall time, user and
system CPU seconds (from wait4), peak anonymous memory (RssAnon + RssShmem of the process tree, sampled every
10 ms: mapped checkpoint pages are page cache, not process memory), the median over rounds of wall / cp-wall of
the same round, and of the 1-worker / N-worker wall. Then: the same HF -> core conversion at 4, 8 and 16 layers
(peak memory should stay flat), and start-up (`mconvert --help`, `mconvert inspect` of a tiny checkpoint).
Outputs are deleted; the models too unless --keep.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

SIZES = {  # transformers LlamaConfig fields and the layer count of the real model
    "1.1b": (dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4,
                  vocab_size=32000, max_position_embeddings=2048), 22),  # TinyLlama-1.1B
    "7b": (dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
                vocab_size=32000, max_position_embeddings=4096), 32),  # Llama-2-7B
}


def build_llama(root: Path, layers: int, size: str = "1.1b") -> None:
    """A random bf16 Llama as `save_pretrained` would write it, from a transformers LlamaConfig (built on the meta
    device, then filled tensor by tensor: no fp32 copy of the model)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=layers, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         **SIZES[size][0])
    config.torch_dtype = "bfloat16"
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(layers)
    tensors = {name: (torch.randn(p.shape, generator=gen) * 0.02).to(torch.bfloat16)
               for name, p in model.state_dict().items()}
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(tmp)
    os.replace(tmp, root)


@dataclass
class Run:
    wall: float
    user: float
    sys: float
    peak: int


def tree_memory(pid: int) -> int:
    """RssAnon + RssShmem of `pid` and its descendants, in bytes."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith(("RssAnon:", "RssShmem:")):
                    total += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                stack.extend(int(c) for c in (task / "children").read_text().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def measure(cmd: list[str], stdout: list[str] | None = None) -> Run:
    """Run `cmd`, then `sync`: wall seconds (both), the command's CPU seconds, its peak process-tree memory (its
    standard output appended to `stdout` when given)."""
    start = time.perf_counter()
    sink = tempfile.TemporaryFile() if stdout is not None else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.PIPE)
    peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, tree_memory(proc.pid))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    done.set()
    sampler.join()
    if stdout is not None:
        sink.seek(0)
        stdout.append(sink.read().decode())
        sink.close()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err.decode()}")
    os.sync()
    return Run(time.perf_counter() - start, usage.ru_utime, usage.ru_stime, peak)


def mconvert_cmd() -> list[str]:
    return [str(Path(sys.executable).with_name("mconvert")), "--quiet", "--force"]


def cases(models: Path, hf: Path) -> dict[str, tuple[Path, list[str]]]:
    """name -> (source, arguments)."""
    core, dist = models / "core_tp2pp2", models / "torch_dist"
    return {
        "HF -> core TP2 PP2": (hf, ["--saver", "core", "--tp", "2", "--pp", "2"]),
        "core -> HF": (core, ["--saver", "llama_mistral"]),
        "core -> torch_dist": (core, ["--saver", "core", "--ckpt-format", "torch_dist"]),
        "torch_dist -> HF": (dist, ["--saver", "llama_mistral"]),
    }


def prepare(models: Path, layers: int) -> Path:
    """The HF source (1.1B shapes, `layers` layers) and the Megatron sources made from it (kept for the next run
    with --keep: remade when the layer count changes)."""
    hf = models / f"llama_1.1b_{layers}l"
    if not (hf / "config.json").is_file():
        t = time.perf_counter()
        build_llama(hf, layers)
        print(f"built {hf} in {time.perf_counter() - t:.0f} s", flush=True)
    for name, args in (("core_tp2pp2", ["--saver", "core", "--tp", "2", "--pp", "2"]),
                       ("torch_dist", ["--saver", "core", "--ckpt-format", "torch_dist"])):
        made = models / f"{name}.source"  # which HF model it was made from
        if not made.is_file() or made.read_text() != hf.name:
            subprocess.run([*mconvert_cmd(), *args, "--load-dir", str(hf), "--save-dir", str(models / name)],
                           check=True, stderr=subprocess.DEVNULL)
            made.write_text(hf.name)
    return hf


def bench_cases(models: Path, hf: Path, rounds: int, workers: list[int], vs_cp: bool) -> None:
    table = cases(models, hf)
    out = models / "out"
    runs: dict[tuple[str, int], list[Run]] = {}
    cps: dict[str, list[Run]] = {}
    for r in range(rounds):
        for name, (src, args) in table.items():
            if vs_cp:
                shutil.rmtree(out, ignore_errors=True)
                cps.setdefault(name, []).append(measure(["cp", "-r", str(src), str(out)]))
            for w in workers:
                shutil.rmtree(out, ignore_errors=True)
                run = measure([*mconvert_cmd(), *args, "--workers", str(w), "--load-dir", str(src),
                               "--save-dir", str(out)])
                runs.setdefault((name, w), []).append(run)
                ratio = f" ({run.wall / cps[name][-1].wall:.2f}x cp)" if vs_cp else ""
                print(f"round {r + 1}/{rounds}: {name:<20} workers {w}: {run.wall:6.2f} s{ratio}", flush=True)
        shutil.rmtree(out, ignore_errors=True)
    nbytes = sum(f.stat().st_size for f in hf.rglob("*") if f.is_file())
    print(f"\nLlama with 1.1B shapes ({hf.name}), {nbytes / 1e9:.2f} GB bf16; medians over {rounds} interleaved "
          "rounds; memory = peak RssAnon+RssShmem")
    print(f"{'case':<20} {'variant':<12} {'wall s':>7} {'user s':>7} {'sys s':>6} {'peak MiB':>9} {'vs cp':>6} "
          f"{'1->N':>6}")
    for name in table:
        rows = [("cp -r + sync", cps[name])] if vs_cp else []
        rows += [(f"workers {w}", runs[(name, w)]) for w in workers]
        for i, (label, rs) in enumerate(rows):
            line = (f"{name if i == 0 else '':<20} {label:<12} {_med(rs, 'wall'):7.2f} {_med(rs, 'user'):7.2f} "
                    f"{_med(rs, 'sys'):6.2f} {max(x.peak for x in rs) / 2**20:9.0f}")
            if vs_cp and label != "cp -r + sync":
                line += f" {statistics.median(x.wall / c.wall for x, c in zip(rs, cps[name])):5.2f}x"
            one = runs.get((name, 1))
            if one is not None and label.startswith("workers") and label != "workers 1":
                line += f" {statistics.median(a.wall / b.wall for a, b in zip(one, rs)):5.2f}x"
            print(line)


def _med(runs: list[Run], field: str) -> float:
    return statistics.median(getattr(r, field) for r in runs)


def bench_growth(models: Path, layer_counts: list[int]) -> None:
    """The same conversion at several depths: peak memory must not grow with the model."""
    print(f"\nmemory growth: HF -> core TP2 PP2 (default workers), 1.1B shapes at {layer_counts} layers")
    out = models / "out"
    for layers in layer_counts:
        src = models / f"llama_1.1b_{layers}l"
        if not (src / "config.json").is_file():
            build_llama(src, layers)
        shutil.rmtree(out, ignore_errors=True)
        run = measure([*mconvert_cmd(), "--saver", "core", "--tp", "2", "--pp", "2", "--load-dir", str(src),
                       "--save-dir", str(out)])
        size = sum(f.stat().st_size for f in src.rglob("*.safetensors"))
        print(f"  {layers:>3} layers  {size / 1e9:5.2f} GB  wall {run.wall:6.2f} s  peak {run.peak / 2**20:6.0f} MiB",
              flush=True)
        shutil.rmtree(out, ignore_errors=True)


def bench_startup(models: Path, rounds: int) -> None:
    """`mconvert --help` and `mconvert inspect` of a tiny checkpoint (HF: read without torch; its torch_dist
    conversion: with torch): what a user waits for before any work."""
    tiny = models / "tiny_llama"
    if not (tiny / "config.json").is_file():
        import torch
        from safetensors.torch import save_file
        from transformers import LlamaConfig

        tiny.mkdir(parents=True)
        config = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False)
        shapes = {"model.embed_tokens.weight": (128, 64), "model.norm.weight": (64,), "lm_head.weight": (128, 64)}
        for i in range(2):
            p = f"model.layers.{i}."
            shapes |= {p + "input_layernorm.weight": (64,), p + "post_attention_layernorm.weight": (64,),
                       p + "self_attn.q_proj.weight": (64, 64), p + "self_attn.k_proj.weight": (32, 64),
                       p + "self_attn.v_proj.weight": (32, 64), p + "self_attn.o_proj.weight": (64, 64),
                       p + "mlp.gate_proj.weight": (128, 64), p + "mlp.up_proj.weight": (128, 64),
                       p + "mlp.down_proj.weight": (64, 128)}
        save_file({k: torch.randn(s) for k, s in shapes.items()}, tiny / "model.safetensors")
        config.save_pretrained(tiny)
    exe = str(Path(sys.executable).with_name("mconvert"))
    dist = models / "tiny_llama_torch_dist"
    if not dist.is_dir():
        subprocess.run([exe, "--saver", "core", "--ckpt-format", "torch_dist", "--load-dir", str(tiny), "--save-dir",
                        str(dist), "-q"], check=True)
    print(f"\nstart-up (median of {rounds}):")
    for label, cmd in (("mconvert --help", [exe, "--help"]),
                       ("mconvert inspect (tiny HF)", [exe, "inspect", str(tiny)]),
                       ("mconvert inspect (torch_dist)", [exe, "inspect", str(dist)]),
                       ("python -c 'import torch'", [sys.executable, "-c", "import torch"])):
        walls = [measure(cmd) for _ in range(rounds)]
        print(f"  {label:<29} wall {_med(walls, 'wall'):5.2f} s  user {_med(walls, 'user'):5.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vs-cp", action="store_true", help="time cp -r of each source beside its conversions")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=SIZES["1.1b"][1],
                        help="layers of the model the cases convert (1.1B shapes; 22 is the real 1.1B)")
    parser.add_argument("--workers", default="1,2", help="worker counts to compare, e.g. 1,2")
    parser.add_argument("--models", type=Path, default=Path("/tmp/bench-models"), help="models and outputs live here")
    parser.add_argument("--growth", default="4,8,16", help="layer counts for the memory-growth check ('' to skip)")
    parser.add_argument("--keep", action="store_true", help="keep the models for the next run")
    parser.add_argument("--startup-only", action="store_true", help="only the start-up figures (seconds, not minutes)")
    args = parser.parse_args()
    args.models.mkdir(parents=True, exist_ok=True)
    made = [p for p in args.models.iterdir()]
    try:
        if args.startup_only:
            bench_startup(args.models, args.rounds)
            return
        hf = prepare(args.models, args.layers)
        bench_cases(args.models, hf, args.rounds, [int(w) for w in args.workers.split(",")], args.vs_cp)
        if args.growth:
            bench_growth(args.models, [int(n) for n in args.growth.split(",")])
        bench_startup(args.models, args.rounds)
    finally:
        shutil.rmtree(args.models / "out", ignore_errors=True)
        if not args.keep:
            for p in args.models.iterdir():
                if p not in made:
                    shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink()


if __name__ == "__main__":
    main()
