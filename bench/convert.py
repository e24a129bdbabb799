"""Conversion speed and memory on a 1.1B Llama, side by side with `cp` of the same bytes, in one run.

    python bench/convert.py --vs-cp [--rounds 5] [--layers 22] [--workers 1,2] [--models /tmp/bench-models] [--keep]
                            [--drop-caches]
                            [--cases NAME] [--baseline DIR] [--torch-path]

Builds (once, cached in --models, outside the repository) a random bf16 Llama with TinyLlama-1.1B shapes from a
`transformers` LlamaConfig, as `save_pretrained` lays it out; the Megatron sources (core torch TP2 PP2 and
torch_dist) are made from it with mconvert, untimed. Then, in every round, each case runs once per worker count
right after `cp -r` of its source (this machine's speed drifts several-fold within seconds, so variants are
interleaved and compared within a round), its source read once beforehand (untimed) so that every command finds it
in the page cache (and, with --drop-caches, free memory):

    dense (Llama):  HF -> core TP2 PP2, core -> HF, core -> torch_dist (with integrity.json, and without it:
                    --no-integrity-manifest), torch_dist -> core, torch_dist -> HF (integrity.json verified,
                    and not: --no-verify-integrity),
                    core -> torch_dcp, torch_dcp -> HF, core -> fsdp_dtensor, fsdp_dtensor -> HF,
                    legacy TP2 PP2 -> HF, pytorch_model.bin -> core TP2
    MoE (Mixtral):  HF -> core TP1 EP2, core EP2 -> HF, core EP2 -> torch_dist

Every command runs as its own process, followed by `sync` (mconvert syncs its output itself: moving it into place
needs it on disk; cp does not, hence the sync). Reported per case and worker count: median wall time, user and
system CPU seconds of the whole process tree (from wait4: children are reaped inside it), peak anonymous memory
(RssAnon + RssShmem of the process tree, sampled every 10 ms: mapped checkpoint pages are page cache, not process
memory), the median over rounds of wall / cp-wall and of CPU / cp-CPU (user + sys) of the same round, and of the
1-worker / N-worker wall. CPU seconds are what the machine spends, so they mean about the same on a loaded machine;
wall time there measures the neighbours. Then: the same HF -> core conversion at 4, 8 and 16 layers (peak memory
should stay flat), and start-up (`mconvert --help`, `mconvert inspect` of a tiny checkpoint).
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


MOE = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
           num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=2048)  # 138 MB of experts a layer


def build_llama(root: Path, layers: int, size: str = "1.1b", moe: bool = False) -> None:
    """A random bf16 Llama (or Mixtral with `moe`) as `save_pretrained` would write it, from a transformers config
    (built on the meta device, then filled tensor by tensor: no fp32 copy of the model)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    fields = dict(num_hidden_layers=layers, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    config = MixtralConfig(**fields, **MOE) if moe else LlamaConfig(**fields, **SIZES[size][0])
    config.torch_dtype = "bfloat16"
    with torch.device("meta"):
        model = (MixtralForCausalLM if moe else LlamaForCausalLM)(config)
    gen = torch.Generator().manual_seed(layers)
    tensors = {name: (torch.randn(p.shape, generator=gen) * 0.02).to(torch.bfloat16)
               for name, p in model.state_dict().items()}
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(tmp)
    os.replace(tmp, root)


def build_bin(hf: Path, root: Path) -> None:
    """The same model as one `pytorch_model.bin` (torch.save of the state dict, as save_pretrained writes it with
    safe_serialization=False)."""
    import torch
    from safetensors.torch import load_file

    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save(load_file(hf / "model.safetensors"), tmp / "pytorch_model.bin")
    shutil.copy(hf / "config.json", tmp / "config.json")
    os.replace(tmp, root)


@dataclass
class Run:
    wall: float
    user: float
    sys: float
    peak: int

    @property
    def cpu(self) -> float:
        return self.user + self.sys


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


def compiled(packages: list[Path]) -> None:
    """Write the bytecode of `packages` (this checkout's mconvert, the baseline's), as an installed package has it:
    with PYTHONDONTWRITEBYTECODE set (as on the machines these figures come from) an editable install would
    otherwise compile every module of ours in every timed run (about 0.1 s of CPU), which an install does once."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    for package in packages:
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(package)], env=env, check=True)


DROP_CACHES = Path("/proc/sys/vm/drop_caches")
drop_caches = False  # --drop-caches


def warm(src: Path) -> None:
    """Read every file of `src` once, untimed, so that each measured command finds its source in the page cache:
    a source read from disk charges the kernel's reading to whichever command comes first. With --drop-caches
    (root only) the page cache is emptied first, so every command also finds free memory: with the cache full of
    earlier outputs the kernel reclaims pages for each one it writes, on its time, and `cp -r` of the same 2.2 GB
    took 0.5-3.0 s of system time from run to run (0.54-0.58 s, five runs, with the cache dropped)."""
    if drop_caches:
        os.sync()
        DROP_CACHES.write_text("1\n")
    buffer = bytearray(1 << 20)
    for f in sorted(p for p in src.rglob("*") if p.is_file()):
        with open(f, "rb", buffering=0) as stream:
            while stream.readinto(buffer):
                pass


def measure(cmd: list[str], stdout: list[str] | None = None, env: dict[str, str] | None = None) -> Run:
    """Run `cmd` (in `env`, default: ours), then `sync`: wall seconds (both), the command's CPU seconds, its peak
    process-tree memory (its standard output appended to `stdout` when given)."""
    start = time.perf_counter()
    sink = tempfile.TemporaryFile() if stdout is not None else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.PIPE, env=env)
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


# Megatron sources, made from the HF models with mconvert (untimed): name -> (made from the MoE model?, arguments)
SOURCES = {
    "core_tp2pp2": (False, ["--saver", "core", "--tp", "2", "--pp", "2"]),
    "torch_dist": (False, ["--saver", "core", "--ckpt-format", "torch_dist"]),
    "torch_dcp": (False, ["--saver", "core", "--ckpt-format", "torch_dcp"]),
    "fsdp_dtensor": (False, ["--saver", "core", "--ckpt-format", "fsdp_dtensor"]),
    "legacy_tp2pp2": (False, ["--saver", "legacy", "--tp", "2", "--pp", "2"]),
    "moe_core_ep2": (True, ["--saver", "core", "--ep", "2"]),
}


def cases(models: Path, hf: Path, moe: Path) -> dict[str, tuple[Path, list[str]]]:
    """name -> (source, arguments)."""
    to_hf = ["--saver", "llama_mistral"]
    return {
        "HF -> core TP2 PP2": (hf, ["--saver", "core", "--tp", "2", "--pp", "2"]),
        "core -> HF": (models / "core_tp2pp2", to_hf),
        "core -> torch_dist": (models / "core_tp2pp2", ["--saver", "core", "--ckpt-format", "torch_dist"]),
        "core -> torch_dist (no manifest)": (models / "core_tp2pp2", ["--saver", "core", "--ckpt-format",
                                                                      "torch_dist", "--no-integrity-manifest"]),
        "torch_dist -> core": (models / "torch_dist", ["--saver", "core", "--tp", "2", "--pp", "2"]),
        "torch_dist -> HF": (models / "torch_dist", to_hf),
        "torch_dist -> HF (not verified)": (models / "torch_dist", [*to_hf, "--no-verify-integrity"]),
        "core -> torch_dcp": (models / "core_tp2pp2", ["--saver", "core", "--ckpt-format", "torch_dcp"]),
        "torch_dcp -> HF": (models / "torch_dcp", to_hf),
        "core -> fsdp_dtensor": (models / "core_tp2pp2", ["--saver", "core", "--ckpt-format", "fsdp_dtensor"]),
        "fsdp_dtensor -> HF": (models / "fsdp_dtensor", to_hf),
        "legacy -> HF": (models / "legacy_tp2pp2", to_hf),
        ".bin -> core TP2": (models / "llama_bin", ["--saver", "core", "--tp", "2"]),
        "MoE HF -> core EP2": (moe, ["--saver", "core", "--ep", "2"]),
        "MoE core EP2 -> HF": (models / "moe_core_ep2", ["--saver", "mixtral_hf"]),
        "MoE core -> torch_dist": (models / "moe_core_ep2", ["--saver", "core", "--ckpt-format", "torch_dist"]),
    }


def selected(name: str, only: str) -> bool:
    """Is case `name` among those `only` asks for (comma-separated parts of names; empty: every case)?"""
    return any(part.strip().lower() in name.lower() for part in only.split(","))


def prepare(models: Path, layers: int, moe_layers: int, only: str = "") -> tuple[Path, Path]:
    """The HF sources (Llama with 1.1B shapes and `layers` layers, Mixtral with `moe_layers`) and the sources made
    from them (kept for the next run with --keep: remade when a layer count changes); with `only`, those the cases
    whose name contains it read."""
    hf, moe = models / f"llama_1.1b_{layers}l", models / f"mixtral_{moe_layers}l"
    needed = {src for name, (src, _) in cases(models, hf, moe).items() if selected(name, only)}
    if any(models / name in needed for name, (is_moe, _) in SOURCES.items() if is_moe):
        needed.add(moe)
    if needed - {hf, moe}:
        needed.add(hf)
    for path, n, is_moe in ((hf, layers, False), (moe, moe_layers, True)):
        if path in needed and not (path / "config.json").is_file():
            t = time.perf_counter()
            build_llama(path, n, moe=is_moe)
            print(f"built {path} in {time.perf_counter() - t:.0f} s", flush=True)
    made = models / "llama_bin.source"
    if models / "llama_bin" in needed and (not made.is_file() or made.read_text() != hf.name):
        build_bin(hf, models / "llama_bin")
        made.write_text(hf.name)
    for name, (is_moe, args) in SOURCES.items():
        src = moe if is_moe else hf
        made = models / f"{name}.source"  # which HF model it was made from
        if models / name in needed and (not made.is_file() or made.read_text() != src.name):
            subprocess.run([*mconvert_cmd(), *args, "--load-dir", str(src), "--save-dir", str(models / name)],
                           check=True, stderr=subprocess.DEVNULL)
            made.write_text(src.name)
    return hf, moe


def bench_cases(models: Path, hf: Path, moe: Path, rounds: int, workers: list[int], vs_cp: bool,
                only: str = "", baseline: Path | None = None, torch_path: bool = False) -> None:
    """Each case beside `cp -r` (with `vs_cp`), at each worker count; with `baseline` (a directory holding another
    version's `mconvert` package) that version too, in the same rounds (PYTHONPATH puts it first); with
    `torch_path` this version with its byte path off too (MCONVERT_TORCH_PATH=1: every tensor through torch)."""
    table = {name: case for name, case in cases(models, hf, moe).items() if selected(name, only)}
    out = models / "out"
    variants = [(f"workers {w}", w, None) for w in workers]
    if baseline is not None:
        old = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(baseline.resolve()),
                                                                         os.environ.get("PYTHONPATH")])))
        variants += [(f"baseline w{w}", w, old) for w in workers]
    if torch_path:
        variants += [(f"torch path w{w}", w, dict(os.environ, MCONVERT_TORCH_PATH="1")) for w in workers]
    runs: dict[tuple[str, str], list[Run]] = {}
    cps: dict[str, list[Run]] = {}
    imports: dict[str, list[Run]] = {}  # `import torch` alone, in the same round: the fixed part of the CPU
    for r in range(rounds):
        for name, (src, args) in table.items():
            if vs_cp:
                shutil.rmtree(out, ignore_errors=True)
                warm(src)
                cps.setdefault(name, []).append(measure(["cp", "-r", str(src), str(out)]))
            for label, w, env in variants:
                shutil.rmtree(out, ignore_errors=True)
                warm(src)
                try:
                    run = measure([*mconvert_cmd(), *args, "--workers", str(w), "--load-dir", str(src),
                                   "--save-dir", str(out)], env=env)
                except SystemExit as failed:
                    if not label.startswith("baseline"):
                        raise
                    print(f"round {r + 1}/{rounds}: {name:<32} {label}: not run (the baseline refuses it: "
                          f"{str(failed).strip().splitlines()[-1]})", flush=True)
                    continue
                runs.setdefault((name, label), []).append(run)
                ratio = (f" ({run.wall / cps[name][-1].wall:.2f}x cp; CPU {run.cpu:.2f} s, "
                         f"{run.cpu / cps[name][-1].cpu:.2f}x cp)") if vs_cp else f" (CPU {run.cpu:.2f} s)"
                print(f"round {r + 1}/{rounds}: {name:<32} {label}: {run.wall:6.2f} s{ratio}", flush=True)
            imports.setdefault(name, []).append(measure([sys.executable, "-c", "import torch"]))
        shutil.rmtree(out, ignore_errors=True)
    gb = [sum(f.stat().st_size for f in m.rglob("*") if f.is_file()) / 1e9 for m in (hf, moe)]
    print(f"\nimport torch alone: CPU {statistics.median(t.cpu for ts in imports.values() for t in ts):.2f} s "
          "(median); (CPU-torch)/cp: the conversion's CPU beyond that fixed cost, over cp's")
    print(f"\nLlama with 1.1B shapes ({hf.name}), {gb[0]:.2f} GB bf16; Mixtral ({moe.name}), {gb[1]:.2f} GB bf16; "
          f"medians over {rounds} interleaved rounds; memory = peak RssAnon+RssShmem; CPU = user + sys")
    print(f"{'case':<32} {'variant':<13} {'wall s':>7} {'user s':>7} {'sys s':>6} {'CPU s':>6} {'peak MiB':>9} "
          f"{'wall/cp':>8} {'CPU/cp':>7} {'(CPU-torch)/cp':>15} {'1->N':>6}")
    for name in table:
        rows = [("cp -r + sync", cps[name])] if vs_cp else []
        rows += [(label, runs[(name, label)]) for label, _, _ in variants if (name, label) in runs]
        for i, (label, rs) in enumerate(rows):
            line = (f"{name if i == 0 else '':<32} {label:<13} {_med(rs, 'wall'):7.2f} {_med(rs, 'user'):7.2f} "
                    f"{_med(rs, 'sys'):6.2f} {_med(rs, 'cpu'):6.2f} {max(x.peak for x in rs) / 2**20:9.0f}")
            if vs_cp and label != "cp -r + sync":
                line += f" {statistics.median(x.wall / c.wall for x, c in zip(rs, cps[name])):7.2f}x"
                line += f" {statistics.median(x.cpu / c.cpu for x, c in zip(rs, cps[name])):6.2f}x"
                beyond = [(x.cpu - t.cpu) / c.cpu for x, c, t in zip(rs, cps[name], imports[name])]
                line += f" {statistics.median(beyond):14.2f}x"
            one = runs.get((name, "workers 1"))
            if one is not None and label.startswith("workers") and label != "workers 1":
                line += f" {statistics.median(a.wall / b.wall for a, b in zip(one, rs)):5.2f}x"
            print(line)


def _med(runs: list[Run], field: str) -> float:
    return statistics.median(getattr(r, field) for r in runs)


def bench_growth(models: Path, layer_counts: list[int]) -> None:
    """The same conversion at several depths: peak memory must not grow with the model. Beside each, `cp -r` of
    its source; from the smallest and largest, CPU seconds per GB of both: the fixed cost (importing torch,
    about 1.5-2 s of CPU) cancels, what remains is the cost of the bytes themselves."""
    print(f"\nmemory growth: HF -> core TP2 PP2 (default workers), 1.1B shapes at {layer_counts} layers")
    out = models / "out"
    points = []
    for layers in layer_counts:
        src = models / f"llama_1.1b_{layers}l"
        if not (src / "config.json").is_file():
            build_llama(src, layers)
        shutil.rmtree(out, ignore_errors=True)
        warm(src)
        cp = measure(["cp", "-r", str(src), str(out)])
        shutil.rmtree(out, ignore_errors=True)
        warm(src)
        run = measure([*mconvert_cmd(), "--saver", "core", "--tp", "2", "--pp", "2", "--load-dir", str(src),
                       "--save-dir", str(out)])
        size = sum(f.stat().st_size for f in src.rglob("*.safetensors"))
        points.append((size / 1e9, run.cpu, cp.cpu))
        print(f"  {layers:>3} layers  {size / 1e9:5.2f} GB  wall {run.wall:6.2f} s  CPU {run.cpu:6.2f} s  "
              f"(cp -r: CPU {cp.cpu:5.2f} s)  peak {run.peak / 2**20:6.0f} MiB", flush=True)
        shutil.rmtree(out, ignore_errors=True)
    if len(points) > 1 and points[-1][0] > points[0][0]:
        (g0, m0, c0), (g1, m1, c1) = points[0], points[-1]
        per_gb, cp_per_gb = (m1 - m0) / (g1 - g0), (c1 - c0) / (g1 - g0)
        print(f"  CPU per GB beyond the fixed cost: mconvert {per_gb:.2f} s/GB, cp -r {cp_per_gb:.2f} s/GB "
              f"({per_gb / cp_per_gb:.2f}x); fixed cost (mconvert at 0 GB) {m0 - per_gb * g0:.2f} s")


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
    parser.add_argument("--moe-layers", type=int, default=8, help="layers of the Mixtral the MoE cases convert")
    parser.add_argument("--cases", default="", help="only the cases whose name contains this, or one of these "
                        "comma-separated parts (e.g. 'dcp' or 'HF -> core TP2,core -> HF')")
    parser.add_argument("--workers", default="1,2", help="worker counts to compare, e.g. 1,2")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a directory holding another version's mconvert package (e.g. from `git archive main "
                             "mconvert | tar -x -C DIR`), timed beside this one in every round")
    parser.add_argument("--torch-path", action="store_true",
                        help="also time this version with its byte path off (MCONVERT_TORCH_PATH=1), same rounds")
    parser.add_argument("--models", type=Path, default=Path("/tmp/bench-models"), help="models and outputs live here")
    parser.add_argument("--growth", default="4,8,16", help="layer counts for the memory-growth check ('' to skip)")
    parser.add_argument("--keep", action="store_true", help="keep the models for the next run")
    parser.add_argument("--drop-caches", action="store_true", help="empty the page cache before each timed command "
                        "(root; every command then starts with free memory: steadier system time, see `warm`)")
    parser.add_argument("--startup-only", action="store_true", help="only the start-up figures (seconds, not minutes)")
    args = parser.parse_args()
    global drop_caches
    drop_caches = args.drop_caches
    args.models.mkdir(parents=True, exist_ok=True)
    made = [p for p in args.models.iterdir()]
    ours = Path(__file__).resolve().parents[1] / "mconvert"
    compiled([ours, *([args.baseline / "mconvert"] if args.baseline else [])])
    try:
        if args.startup_only:
            bench_startup(args.models, args.rounds)
            return
        hf, moe = prepare(args.models, args.layers, args.moe_layers, args.cases)
        bench_cases(args.models, hf, moe, args.rounds, [int(w) for w in args.workers.split(",")], args.vs_cp,
                    args.cases, args.baseline, args.torch_path)
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
